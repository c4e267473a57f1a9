"""The `blocked` kernel: gather rows into the expert-sorted buffer, grouped SwiGLU over its
blocks (`grouped.grouped_swiglu`), then gather back and combine. The same block loop as
`fused`, unfused: autodiff keeps the sorted inputs and outputs for the backward pass."""

from __future__ import annotations

import jax

from moejax.kernels import plans
from moejax.kernels.grouped import grouped_swiglu


def run(a: plans.KernelArgs) -> jax.Array:
  K = a.weights_TxK.shape[1]
  y_RxD = grouped_swiglu(plans.expand(a.x_TxD, a.plan, K), *a.ex, a.blocks, a.sizes)
  return plans.combine(y_RxD, a.plan, a.weights_TxK)
