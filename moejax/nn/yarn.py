"""RoPE frequencies (default and YaRN) and DeepSeek's adjacent-pair rotation, as pure functions.

YaRN (Peng et al. 2023, arXiv:2309.00071) as transformers 5.24 computes it
(`modeling_rope_utils._compute_yarn_parameters`) and DeepSeek-V2/V3 use it:

* Inverse frequencies: each of the dim/2 frequencies blends the original one, θ^(−2i/d)
  (extrapolation), with the interpolated one, θ^(−2i/d)/factor, by a linear ramp over the
  index i that runs from the dimension making `beta_fast` rotations in
  `original_max_position_embeddings` positions (floored) to the one making `beta_slow`
  (ceiled), clipped to [0, d−1]: fast dimensions keep their frequency, slow ones are
  divided by `factor`.
* cos/sin multiplier (`attention_factor`): mscale(f, mscale) / mscale(f, mscale_all_dim)
  when both are set, else mscale(f, 1), with mscale(f, a) = 0.1·a·ln f + 1 (1 at f <= 1).
  DeepSeek's published values (0.707/0.707, 1.0/1.0) make it exactly 1.
* Softmax-scale factor (DeepSeek's `yarn_apply_mscale`): m² with m = mscale(f, mscale_all_dim)
  when `mscale_all_dim` is set, else 1; the attention's scale is (dn + dr)^-1/2 · m².
  Factor 40: ×1.5896 at mscale_all_dim 0.707 (V2-Lite), ×1.8739 at 1.0 (V3).

Rotation on adjacent pairs (x[2i], x[2i+1]) by angle p·inv_freq[i] (DeepSeek-V2 in
transformers, `view_as_complex`; V3 under `rope_interleave`), the output kept in place.
transformers' V3 (`apply_rotary_pos_emb_interleave`) writes the same rotated pairs as
[evens | odds]; q and k get the same permutation there, so every q·k product, and the
attention, are the same.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Yarn(NamedTuple):
  """YaRN's parameters, as `rope_parameters` of a DeepSeek config names them."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0  # 0: unset
  mscale_all_dim: float = 0.0  # 0: unset (no softmax-scale factor)
  truncate: bool = True  # floor/ceil the ramp's ends (transformers' default)


def default_inv_freq(dim: int, theta: float) -> np.ndarray:
  """θ^(−2i/d) for i < d/2, float32 [d/2]."""
  return (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)


def correction_dim(rotations: float, dim: int, theta: float, max_pos: int) -> float:
  """The (fractional) dimension index whose wavelength fits `rotations` times in max_pos."""
  return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def ramp_range(yarn: Yarn, dim: int, theta: float) -> tuple[float, float]:
  """The ramp's ends [low, high] over the frequency index, clipped to [0, dim − 1]."""
  low = correction_dim(yarn.beta_fast, dim, theta, yarn.original_max_position_embeddings)
  high = correction_dim(yarn.beta_slow, dim, theta, yarn.original_max_position_embeddings)
  if yarn.truncate:
    low, high = math.floor(low), math.ceil(high)
  return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, theta: float, yarn: Yarn) -> np.ndarray:
  """YaRN's blended inverse frequencies, float32 [d/2]."""
  low, high = ramp_range(yarn, dim, theta)
  high = high + 0.001 if low == high else high  # transformers' guard against 0/0
  ramp_F = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrapolated_F = default_inv_freq(dim, theta).astype(np.float64)
  blended_F = extrapolated_F / yarn.factor * ramp_F + extrapolated_F * (1.0 - ramp_F)
  return blended_F.astype(np.float32)


def mscale(factor: float, scale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1·scale·ln(factor) + 1 (1 when factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def cos_sin_scale(yarn: Yarn | None) -> float:
  """The multiplier of cos and sin (transformers' `attention_scaling`); 1 without YaRN."""
  if yarn is None:
    return 1.0
  if yarn.mscale and yarn.mscale_all_dim:
    return mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim)
  return mscale(yarn.factor)


def softmax_factor(yarn: Yarn | None) -> float:
  """m² multiplying the softmax scale, m = mscale(factor, mscale_all_dim); 1 when unset."""
  if yarn is None or not yarn.mscale_all_dim:
    return 1.0
  return mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def inv_freq(dim: int, theta: float, yarn: Yarn | None) -> np.ndarray:
  """The rotation's inverse frequencies: YaRN's when given, else the default ones."""
  return default_inv_freq(dim, theta) if yarn is None else yarn_inv_freq(dim, theta, yarn)


def cos_sin(positions_BxL: jax.Array, inv_freq_F, scale: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin of p·inv_freq, each × scale, float32 [B, L, 1, F] (broadcast over heads)."""
  angle_BxLxF = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
  return (
    (jnp.cos(angle_BxLxF) * scale)[:, :, None, :],
    (jnp.sin(angle_BxLxF) * scale)[:, :, None, :],
  )


def rope_pairs(x_BxLxHxK: jax.Array, cos_BxLx1xF: jax.Array, sin_BxLx1xF: jax.Array) -> jax.Array:
  """Each adjacent pair (x[2i], x[2i+1]) rotated by angle i, in place; float32 math."""
  x_BxLxHxFx2 = x_BxLxHxK.astype(jnp.float32).reshape(*x_BxLxHxK.shape[:-1], -1, 2)
  x0, x1 = x_BxLxHxFx2[..., 0], x_BxLxHxFx2[..., 1]
  cos, sin = cos_BxLx1xF, sin_BxLx1xF
  out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)
  return out.reshape(x_BxLxHxK.shape).astype(x_BxLxHxK.dtype)


def rope_halves(x_BxLxHxK: jax.Array, cos_BxLx1xF: jax.Array, sin_BxLx1xF: jax.Array) -> jax.Array:
  """Pairs (x[i], x[i + K/2]) rotated by angle i (rotate-half, `layers.rope`'s convention)."""
  x0, x1 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_BxLx1xF, sin_BxLx1xF
  return jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).astype(x_BxLxHxK.dtype)
