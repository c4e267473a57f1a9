"""Gated full attention of Qwen3.5 / Qwen3-Next as a mixer (`moejax.nn.mixer`;
docs/gated-deltanet.md).

    [q_h | gate_h] = (x · W_q)_h                 per head h, interleaved head by head
    q, k = zero-centred RMSNorm per head         x̂ · (1 + w), `moejax.nn.norms`
    q, k = RoPE on the first rotary_dim dims     rotate-half, rotary_dim = head_dim · factor
    o = causal GQA softmax(q·kᵀ / sqrt(head_dim)) · v
    y = (o · σ(gate)) · W_o

For text-only input Qwen3.5's mRoPE is this 1-D RoPE (its three position rows are equal;
tests/test_gated_deltanet.py checks it against transformers).

Decode: a KV cache [B, S, G, head_dim] per k and v (`GatedAttentionCache`); a call writes its
L tokens at `at.index` and reads the slots `at.mask_BxLxS` allows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.errors import UserError
from moejax.nn.attention import ATTENTION_IMPLS, masked_attention
from moejax.nn.layers import init_normal, rope
from moejax.nn.mixer import DecodeAt, write_slots
from moejax.nn.norms import ZeroCentredRMSNorm

PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3.5's and Qwen3-Next's


class GatedAttentionCache(NamedTuple):
  """Post-norm, post-RoPE keys and values of every slot so far."""

  k_BxSxGxK: jax.Array
  v_BxSxGxK: jax.Array


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
  """The rotated dims, transformers' `int(head_dim * partial_rotary_factor)`; must be even."""
  rd = int(head_dim * partial_rotary_factor)
  if rd < 2 or rd % 2:
    raise UserError(
      f"partial_rotary_factor={partial_rotary_factor} gives {rd} rotary dims of head_dim="
      f"{head_dim}; use a factor that gives an even number >= 2"
    )
  return rd


def partial_rope(x_BxLxHxK: jax.Array, positions_BxL: jax.Array, theta: float, rd: int):
  """RoPE (rotate-half, frequencies of a rd-wide head) on the first `rd` dims; the rest pass."""
  rotated = rope(x_BxLxHxK[..., :rd], positions_BxL, theta)
  return jnp.concatenate([rotated, x_BxLxHxK[..., rd:]], axis=-1)


class GatedAttention(nnx.Module):
  """Gated full attention: float32 parameters, computed in `dtype`; `impl` names the
  training/scoring kernel (`moejax.nn.attention.ATTENTION_IMPLS`)."""

  def __init__(
    self,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    partial_rotary_factor: float = PARTIAL_ROTARY_FACTOR,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-6,
    dtype: str = "float32",
    init_std: float = 0.02,
    out_std: float | None = None,
    impl: str = "xla",
    rngs: nnx.Rngs,
  ):
    self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
    self.rotary_dim = rotary_dim(head_dim, partial_rotary_factor)
    self.rope_theta, self.impl, self.dtype = rope_theta, impl, dtype
    cdt = jnp.dtype(dtype)

    def proj(n_in: int, n_out: int, std: float) -> nnx.Linear:
      return nnx.Linear(
        n_in, n_out, use_bias=False, dtype=cdt, param_dtype=jnp.float32,
        kernel_init=init_normal(std), rngs=rngs,
      )  # fmt: skip

    self.q_proj = proj(d_model, 2 * n_heads * head_dim, init_std)  # [q_h | gate_h] per head
    self.k_proj = proj(d_model, n_kv_heads * head_dim, init_std)
    self.v_proj = proj(d_model, n_kv_heads * head_dim, init_std)
    self.o_proj = proj(n_heads * head_dim, d_model, init_std if out_std is None else out_std)
    self.q_norm = ZeroCentredRMSNorm(head_dim, eps=norm_eps, rngs=rngs)
    self.k_norm = ZeroCentredRMSNorm(head_dim, eps=norm_eps, rngs=rngs)

  def init_cache(self, batch: int, max_len: int, dtype) -> GatedAttentionCache:
    shape = (batch, max_len, self.n_kv_heads, self.head_dim)
    return GatedAttentionCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  def _qkv_gate(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
    B, L, _ = x_BxLxD.shape
    H, G, K = self.n_heads, self.n_kv_heads, self.head_dim
    qg = self.q_proj(x_BxLxD).reshape(B, L, H, 2 * K)
    q, gate = self.q_norm(qg[..., :K]), qg[..., K:]
    k = self.k_norm(self.k_proj(x_BxLxD).reshape(B, L, G, K))
    v = self.v_proj(x_BxLxD).reshape(B, L, G, K)
    q = partial_rope(q, positions_BxL, self.rope_theta, self.rotary_dim)
    k = partial_rope(k, positions_BxL, self.rope_theta, self.rotary_dim)
    return q, k, v, gate

  def __call__(
    self,
    x_BxLxD: jax.Array,
    positions_BxL: jax.Array,
    *,
    cache: GatedAttentionCache | None = None,
    at: DecodeAt | None = None,
  ) -> tuple[jax.Array, GatedAttentionCache | None]:
    B, L, _ = x_BxLxD.shape
    q, k, v, gate = self._qkv_gate(x_BxLxD.astype(jnp.dtype(self.dtype)), positions_BxL)
    if cache is None:
      o = ATTENTION_IMPLS[self.impl](q, k, v)
    else:
      cache = GatedAttentionCache(
        write_slots(cache.k_BxSxGxK, k, at.index), write_slots(cache.v_BxSxGxK, v, at.index)
      )
      mask = at.mask_BxLxS(L, cache.k_BxSxGxK.shape[1])
      o = masked_attention(
        q, cache.k_BxSxGxK.astype(q.dtype), cache.v_BxSxGxK.astype(q.dtype), mask
      )
    o = o.reshape(B, L, self.n_heads * self.head_dim)
    o = o * jax.nn.sigmoid(gate.reshape(o.shape).astype(jnp.float32)).astype(o.dtype)
    return self.o_proj(o), cache
