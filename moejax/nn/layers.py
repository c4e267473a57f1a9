"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention, SwiGLU FFN.

Pure functions hold the math; the `nnx.Module`s own float32 parameters and cast them (and
their inputs) to the compute dtype at use.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn import mixer
from moejax.nn.attention import ATTENTION_IMPLS, masked_attention

DTYPES = ("float32", "bfloat16")
# QK-norm per head over head_dim (Qwen3), or over the whole projection (OLMoE).
QK_NORM_SCOPES = ("head", "proj")


def init_normal(std: float) -> nnx.Initializer:
  """Truncated normal (±2σ of the untruncated law) with standard deviation `std`."""
  return nnx.initializers.truncated_normal(stddev=std)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) · scale over the last axis, computed in float32 and cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * inv * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned `scale` (init ones)."""

  def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
    del rngs  # deterministic init; kept for a uniform constructor signature
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)


def rope(x_BxLxHxK: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, rotate-half convention (GPT-NeoX/Llama), float32 math."""
  K = x_BxLxHxK.shape[-1]
  inv_freq_F = theta ** (-jnp.arange(0, K // 2, dtype=jnp.float32) * 2.0 / K)
  angle_BxLx1xF = (positions_BxL.astype(jnp.float32)[..., None] * inv_freq_F)[:, :, None, :]
  cos, sin = jnp.cos(angle_BxLx1xF), jnp.sin(angle_BxLx1xF)
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


class KVCache(NamedTuple):
  """A GQA layer's decode state (`moejax.nn.mixer`): roped keys and values per cache slot."""

  k_BxSxGxK: jax.Array
  v_BxSxGxK: jax.Array


class Attention(nnx.Module):
  """Grouped-query causal self-attention with RoPE, optional QK-norm and q/k/v biases; a
  mixer (`moejax.nn.mixer`): `(y, cache)`, with a `KVCache` at decode.

  QK-norm is an RMSNorm on q and k before RoPE: per head over head_dim (`qk_norm_scope=
  "head"`, Qwen3) or over the whole projection, all heads at once (`"proj"`, OLMoE).
  `qkv_bias` adds biases to the q/k/v projections (Qwen2); o_proj never has one.
  `impl` names the attention kernel (`moejax.nn.attention.ATTENTION_IMPLS`).
  """

  def __init__(
    self,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    qk_norm: bool = False,
    qk_norm_scope: str = "head",
    qkv_bias: bool = False,
    rope_theta: float = 10000.0,
    dtype: str = "float32",
    init_std: float = 0.02,
    out_std: float | None = None,
    norm_eps: float = 1e-6,
    impl: str = "xla",
    rngs: nnx.Rngs,
  ):
    self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
    self.impl = impl
    self.rope_theta = rope_theta
    cdt = jnp.dtype(dtype)

    def proj(n_in: int, n_out: int, std: float, bias: bool = False) -> nnx.Linear:
      return nnx.Linear(
        n_in,
        n_out,
        use_bias=bias,
        dtype=cdt,
        param_dtype=jnp.float32,
        kernel_init=init_normal(std),
        rngs=rngs,
      )

    self.q_proj = proj(d_model, n_heads * head_dim, init_std, qkv_bias)
    self.k_proj = proj(d_model, n_kv_heads * head_dim, init_std, qkv_bias)
    self.v_proj = proj(d_model, n_kv_heads * head_dim, init_std, qkv_bias)
    self.o_proj = proj(n_heads * head_dim, d_model, init_std if out_std is None else out_std)
    self.qk_norm_scope = qk_norm_scope
    if qk_norm:
      per_head = qk_norm_scope == "head"
      q_dim, k_dim = (
        (head_dim, head_dim) if per_head else (n_heads * head_dim, n_kv_heads * head_dim)
      )
      self.q_norm = RMSNorm(q_dim, eps=norm_eps, rngs=rngs)
      self.k_norm = RMSNorm(k_dim, eps=norm_eps, rngs=rngs)
    else:
      self.q_norm = self.k_norm = None

  def init_cache(self, batch: int, max_len: int, dtype) -> KVCache:
    """Zeros for `max_len` slots of `batch` rows, in `dtype` (the compute dtype)."""
    shape = (batch, max_len, self.n_kv_heads, self.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  def __call__(
    self,
    x_BxLxD: jax.Array,
    positions_BxL: jax.Array,
    *,
    cache: KVCache | None = None,
    at: mixer.DecodeAt | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    B, L, _ = x_BxLxD.shape
    q_BxLxHK, k_BxLxGK = self.q_proj(x_BxLxD), self.k_proj(x_BxLxD)
    if self.q_norm is not None and self.qk_norm_scope == "proj":
      q_BxLxHK, k_BxLxGK = self.q_norm(q_BxLxHK), self.k_norm(k_BxLxGK)
    q_BxLxHxK = q_BxLxHK.reshape(B, L, self.n_heads, self.head_dim)
    k_BxLxGxK = k_BxLxGK.reshape(B, L, self.n_kv_heads, self.head_dim)
    v_BxLxGxK = self.v_proj(x_BxLxD).reshape(B, L, self.n_kv_heads, self.head_dim)
    if self.q_norm is not None and self.qk_norm_scope == "head":
      q_BxLxHxK, k_BxLxGxK = self.q_norm(q_BxLxHxK), self.k_norm(k_BxLxGxK)
    q_BxLxHxK = rope(q_BxLxHxK, positions_BxL, self.rope_theta)
    k_BxLxGxK = rope(k_BxLxGxK, positions_BxL, self.rope_theta)
    if cache is None:
      o_BxLxHxK = ATTENTION_IMPLS[self.impl](q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    else:
      cache = KVCache(
        mixer.write_slots(cache.k_BxSxGxK, k_BxLxGxK, at.index),
        mixer.write_slots(cache.v_BxSxGxK, v_BxLxGxK, at.index),
      )
      mask_BxLxS = at.mask_BxLxS(L, cache.k_BxSxGxK.shape[1])
      o_BxLxHxK = masked_attention(q_BxLxHxK, cache.k_BxSxGxK, cache.v_BxSxGxK, mask_BxLxS)
    return self.o_proj(o_BxLxHxK.reshape(B, L, self.n_heads * self.head_dim)), cache


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """SwiGLU FFN: (silu(x·W_gate) ⊙ x·W_up)·W_down, in the dtype of its inputs, with
  `w_gate_up = [W_gate | W_up]` ([D, 2F]) one matmul."""
  F = w_down.shape[0]
  gu = x @ w_gate_up
  return (jax.nn.silu(gu[..., :F]) * gu[..., F:]) @ w_down


def gate_up_init(std: float, rngs: nnx.Rngs, shape: tuple[int, ...]) -> jax.Array:
  """A gate/up parameter [..., 2F]: gate [..., :F] and up [..., F:] each drawn as a separate
  [..., F] parameter of std `std` would be (the same keys in the same order), so a seed gives
  the numbers it gave when they were two parameters."""
  init = init_normal(std)
  return jnp.concatenate(
    [init(rngs.params(), shape, jnp.float32), init(rngs.params(), shape, jnp.float32)], -1
  )


class DenseFFN(nnx.Module):
  """Dense SwiGLU feed-forward (also the shared expert): `w_gate_up [d_model, 2·d_ff]` (gate
  then up) and `w_down [d_ff, d_model]`; float32 params, computed in `dtype`."""

  def __init__(
    self,
    d_model: int,
    d_ff: int,
    *,
    dtype: str = "float32",
    init_std: float = 0.02,
    out_std: float | None = None,
    rngs: nnx.Rngs,
  ):
    self.dtype = dtype
    std_out = init_std if out_std is None else out_std
    self.w_gate_up = nnx.Param(gate_up_init(init_std, rngs, (d_model, d_ff)))
    self.w_down = nnx.Param(init_normal(std_out)(rngs.params(), (d_ff, d_model), jnp.float32))

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cdt = jnp.dtype(self.dtype)
    return swiglu(
      x_BxLxD.astype(cdt), self.w_gate_up[...].astype(cdt), self.w_down[...].astype(cdt)
    )
