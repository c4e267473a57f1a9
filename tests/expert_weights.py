"""Tests' expert weights from separate gate, up and down arrays (the references' layout).

The model holds gate and up as one `w_gate_up [E, D, 2F]` (gate in columns [0, F), up in
[F, 2F)); the tests' NumPy references keep them apart, so the join happens here, in the
test, where autodiff splits the gradient back into the references' two arrays.
"""

import jax.numpy as jnp

from moejax.kernels.plans import ExpertWeights


def expert_weights(w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD) -> ExpertWeights:
  return ExpertWeights(jnp.concatenate([w_gate_ExDxF, w_up_ExDxF], axis=-1), w_down_ExFxD)
