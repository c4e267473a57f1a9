"""The Gated DeltaNet mixer of Qwen3.5 / Qwen3-Next (docs/gated-deltanet.md; the mixer
interface of `moejax.nn.mixer`).

    qkv = silu(causal_conv1d(x · W_qkv))        depthwise, kernel W, no bias
    q, k, v = split(qkv) by heads               q, k: Hk key heads of dk; v: Hv heads of dv
    q, k = l2norm(q) · dk^-½, l2norm(k)         then repeated to the Hv value heads
    β = σ(x · W_b),  g = −exp(A_log) · softplus(x · W_a + dt_bias)
    o = gated delta rule(q, k, v, g, β)         `moejax.nn.gated_delta`, chunked
    y = (rmsnorm(o) · w · silu(x · W_z)) · W_out   the norm per value head

Parameters are Qwen3.5's layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` convert with `split_qwen3_next` (and back
with `join_qwen3_next`).

Decode state (`GatedDeltaNetCache`): the last W−1 conv inputs and the [Hv, dk, dv] float32
recurrent state, whatever the length. A padded token's conv input is zeroed and its g and β
are 0, so a left-padded row's state and window are those of the same row unpadded.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.schema import check_fields, key
from moejax.errors import UserError
from moejax.nn import gated_delta as gd
from moejax.nn.layers import init_normal
from moejax.nn.mixer import DecodeAt
from moejax.nn.norms import gated_rms_norm


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
  """Shapes of a Gated DeltaNet layer (transformers' names; defaults are a miniature)."""

  linear_num_key_heads: int = key(2, "Gated DeltaNet query/key heads", ge=1)
  linear_num_value_heads: int = key(
    4, "Gated DeltaNet value heads; a multiple of linear_num_key_heads", ge=1
  )
  linear_key_head_dim: int = key(32, "width of a Gated DeltaNet query/key head", ge=1)
  linear_value_head_dim: int = key(32, "width of a Gated DeltaNet value head", ge=1)
  linear_conv_kernel_dim: int = key(4, "width of the causal depthwise conv over q, k, v", ge=1)

  def __post_init__(self):
    check_fields(self, "model.gated_deltanet")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise UserError(
        f"model.gated_deltanet.linear_num_value_heads={self.linear_num_value_heads} must be a "
        f"multiple of model.gated_deltanet.linear_num_key_heads={self.linear_num_key_heads}"
      )

  @property
  def key_dim(self) -> int:
    return self.linear_num_key_heads * self.linear_key_head_dim

  @property
  def value_dim(self) -> int:
    return self.linear_num_value_heads * self.linear_value_head_dim

  @property
  def conv_dim(self) -> int:
    """The conv's channels: q, k and v."""
    return 2 * self.key_dim + self.value_dim


class GatedDeltaNetCache(NamedTuple):
  """A Gated DeltaNet's decode state."""

  conv_BxWxC: jax.Array  # the last W−1 conv inputs (q, k, v channels), compute dtype
  state_BxHxKxV: jax.Array  # the recurrent state, float32


def causal_conv(
  x_BxLxC: jax.Array, w_WxC: jax.Array, window_BxWxC: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal conv: y_t = Σ_i w[i] · x_{t−(W−1)+i}, the W−1 inputs before the first
  taken from `window` (zeros for a fresh sequence); float32 math. Returns (y in x's dtype,
  the new window: the last W−1 inputs)."""
  W, L = w_WxC.shape[0], x_BxLxC.shape[1]
  xp = jnp.concatenate([window_BxWxC.astype(x_BxLxC.dtype), x_BxLxC], axis=1)
  xp32, w32 = xp.astype(jnp.float32), w_WxC.astype(jnp.float32)
  y = sum(xp32[:, i : i + L] * w32[i] for i in range(W))
  return y.astype(x_BxLxC.dtype), xp[:, L:].astype(window_BxWxC.dtype)


def split_qwen3_next(qkvz: np.ndarray, ba: np.ndarray, cfg: GatedDeltaNetConfig) -> dict:
  """Qwen3-Next's grouped projections as Qwen3.5's (HF [out, in] layout, rows are outputs).

  `in_proj_qkvz` rows are per key head g: [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)],
  `in_proj_ba` rows per key head: [b_g (r) | a_g (r)], r = Hv / Hk value heads per key head
  (transformers' `fix_query_key_value_ordering`). Returns {in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a}: [q all heads | k | v], z, b, a in value-head order."""
  G, K, V = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
  r = cfg.linear_num_value_heads // G
  qkvz_G = qkvz.reshape(G, 2 * K + 2 * r * V, *qkvz.shape[1:])
  ba_G = ba.reshape(G, 2 * r, *ba.shape[1:])
  q, k, v, z = np.split(qkvz_G, [K, 2 * K, 2 * K + r * V], axis=1)
  b, a = np.split(ba_G, [r], axis=1)

  def flat(x):
    return x.reshape(-1, *x.shape[2:])

  return {
    "in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)], axis=0),
    "in_proj_z": flat(z),
    "in_proj_b": flat(b),
    "in_proj_a": flat(a),
  }


def join_qwen3_next(parts: dict, cfg: GatedDeltaNetConfig) -> tuple[np.ndarray, np.ndarray]:
  """The inverse of `split_qwen3_next`: (in_proj_qkvz, in_proj_ba) from Qwen3.5's four."""
  G, kd = cfg.linear_num_key_heads, cfg.key_dim
  qkv = parts["in_proj_qkv"]
  tail = qkv.shape[1:]

  def per_head(x):
    return x.reshape(G, -1, *tail)

  q, k, v = qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd :]
  qkvz = np.concatenate([per_head(q), per_head(k), per_head(v), per_head(parts["in_proj_z"])], 1)
  ba = np.concatenate([per_head(parts["in_proj_b"]), per_head(parts["in_proj_a"])], 1)
  return qkvz.reshape(-1, *tail), ba.reshape(-1, *tail)


def init_A_log(key_: jax.Array, n: int) -> jax.Array:
  """log A with A ~ U(0.01, 16) (transformers' init: the decay rates of the value heads)."""
  return jnp.log(jax.random.uniform(key_, (n,), jnp.float32, 0.01, 16.0))


class GatedDeltaNet(nnx.Module):
  """The Gated DeltaNet mixer: float32 parameters, computed in `dtype`; the delta rule and
  its state in float32. `chunk` is the chunked rule's chunk length."""

  def __init__(
    self,
    d_model: int,
    cfg: GatedDeltaNetConfig,
    *,
    norm_eps: float = 1e-6,
    dtype: str = "float32",
    init_std: float = 0.02,
    out_std: float | None = None,
    chunk: int = gd.CHUNK,
    rngs: nnx.Rngs,
  ):
    self.cfg, self.norm_eps, self.chunk, self.dtype = cfg, norm_eps, chunk, dtype
    cdt = jnp.dtype(dtype)

    def proj(n_in: int, n_out: int, std: float) -> nnx.Linear:
      return nnx.Linear(
        n_in, n_out, use_bias=False, dtype=cdt, param_dtype=jnp.float32,
        kernel_init=init_normal(std), rngs=rngs,
      )  # fmt: skip

    Hv, W = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    self.in_proj_qkv = proj(d_model, cfg.conv_dim, init_std)
    self.in_proj_z = proj(d_model, cfg.value_dim, init_std)
    self.in_proj_b = proj(d_model, Hv, init_std)
    self.in_proj_a = proj(d_model, Hv, init_std)
    # PyTorch's Conv1d init for a depthwise kernel: U(±1/sqrt(W)); [W, C], tap i reads t−(W−1)+i
    bound = W**-0.5
    self.conv_kernel = nnx.Param(
      jax.random.uniform(rngs.params(), (W, cfg.conv_dim), jnp.float32, -bound, bound)
    )
    self.A_log = nnx.Param(init_A_log(rngs.params(), Hv))
    self.dt_bias = nnx.Param(jnp.ones((Hv,), jnp.float32))
    self.norm_weight = nnx.Param(jnp.ones((cfg.linear_value_head_dim,), jnp.float32))
    self.out_proj = proj(cfg.value_dim, d_model, init_std if out_std is None else out_std)

  def init_cache(self, batch: int, max_len: int, dtype) -> GatedDeltaNetCache:
    """A fresh decode state (its size does not depend on `max_len`)."""
    del max_len
    c = self.cfg
    W = c.linear_conv_kernel_dim
    return GatedDeltaNetCache(
      jnp.zeros((batch, W - 1, c.conv_dim), dtype),
      gd.zero_state(
        batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
      ),
    )

  def _heads(self, qkv_BxLxC: jax.Array):
    """q, k (normalized, repeated to the value heads) and v, per head, float32."""
    c = self.cfg
    B, L, _ = qkv_BxLxC.shape
    kd, Hk, Hv = c.key_dim, c.linear_num_key_heads, c.linear_num_value_heads
    q = qkv_BxLxC[..., :kd].reshape(B, L, Hk, c.linear_key_head_dim)
    k = qkv_BxLxC[..., kd : 2 * kd].reshape(B, L, Hk, c.linear_key_head_dim)
    v = qkv_BxLxC[..., 2 * kd :].reshape(B, L, Hv, c.linear_value_head_dim)
    q, k = gd.normalize_qk(q, k)
    return gd.repeat_heads(q, Hv), gd.repeat_heads(k, Hv), v.astype(jnp.float32)

  def __call__(
    self,
    x_BxLxD: jax.Array,
    positions_BxL: jax.Array,
    *,
    cache: GatedDeltaNetCache | None = None,
    at: DecodeAt | None = None,
  ) -> tuple[jax.Array, GatedDeltaNetCache | None]:
    del positions_BxL  # no positions: order comes from the recurrence
    c, cdt = self.cfg, jnp.dtype(self.dtype)
    B, L, _ = x_BxLxD.shape
    x = x_BxLxD.astype(cdt)
    valid_BxL = None if at is None else at.valid_BxL(L)
    qkv = self.in_proj_qkv(x)
    if valid_BxL is not None:
      qkv = jnp.where(valid_BxL[..., None], qkv, 0)
    window = (
      jnp.zeros((B, c.linear_conv_kernel_dim - 1, c.conv_dim), cdt)
      if cache is None
      else cache.conv_BxWxC
    )
    qkv, window = causal_conv(qkv, self.conv_kernel[...], window)
    q, k, v = self._heads(jax.nn.silu(qkv))
    g, beta = gd.decay_and_beta(
      self.in_proj_a(x), self.in_proj_b(x), self.A_log[...], self.dt_bias[...]
    )
    g, beta = gd.mask_padding(g, beta, valid_BxL)
    S0 = None if cache is None else cache.state_BxHxKxV
    if cache is not None and L == 1:
      S, o = gd.recurrent_step(S0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
      o_BxLxHxV = o[:, None]
    else:
      o_BxLxHxV, S = gd.chunk_gated_delta(q, k, v, g, beta, S0, chunk=self.chunk)
    z = self.in_proj_z(x).reshape(B, L, c.linear_num_value_heads, c.linear_value_head_dim)
    o = gated_rms_norm(o_BxLxHxV, z, self.norm_weight[...], self.norm_eps).astype(cdt)
    y = self.out_proj(o.reshape(B, L, c.value_dim))
    return y, (None if cache is None else GatedDeltaNetCache(window, S))
