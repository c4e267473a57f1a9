"""The RMSNorm variants of the Qwen3.5 / Qwen3-Next hybrid (docs/gated-deltanet.md).

* Zero-centred RMSNorm: x̂ · (1 + w) with w initialized at 0 (transformers'
  `Qwen3NextRMSNorm` / `Qwen3_5MoeRMSNorm`): the layer norms, the final norm and the gated
  attention's q/k norms. The checkpoint's `weight` is w itself.
* Gated RMSNorm: x̂ · w · silu(z) with a plain weight (init ones), per head over the head's
  width (`Qwen3NextRMSNormGated`): the Gated DeltaNet's output norm.

x̂ = x / sqrt(mean(x²) + eps), float32 math, cast back to x's dtype (`layers.rms_norm`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn.layers import rms_norm


def zero_centred_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """x̂ · (1 + w) over the last axis, float32 math, in x's dtype."""
  return rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


class ZeroCentredRMSNorm(nnx.Module):
  """RMSNorm whose output is x̂ · (1 + weight); `weight` starts at 0 (the identity scale)."""

  def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
    del rngs  # deterministic init; kept for a uniform constructor signature
    self.eps = eps
    self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    return zero_centred_rms_norm(x, self.weight[...], self.eps)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """x̂ · w · silu(z) over the last axis (normalize, then gate), float32, in x's dtype."""
  normed = rms_norm(x.astype(jnp.float32), w, eps)
  return (normed * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
