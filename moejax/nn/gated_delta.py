"""The gated delta rule (Gated DeltaNet's core, docs/gated-deltanet.md), two ways, float32.

Per value head, with a state S [dk, dv] (S₀ = 0 or a cache's), at each token t:

    S ← exp(g_t) · S                         (gated decay, g_t ≤ 0 in log space)
    S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)          (delta rule: write the correction of v_t)
    o_t = Sᵀ q_t

* `recurrent_gated_delta`: that loop as a `lax.scan` over tokens: the test oracle, and (one
  token at a time, `recurrent_step`) the decode step.
* `chunk_gated_delta`: the same outputs and final state in chunks of C tokens (the WY/UT form
  of fla and transformers' `torch_chunk_gated_delta_rule`): matmuls within a chunk, a
  `lax.scan` over the L/C chunks carrying S. Autodiff of that scan keeps one [dk, dv] state
  per chunk (its carry), so the backward holds L/C states, never L.

Inputs are per value head: q, k [B, L, H, dk] (already L2-normalized and q scaled by
dk^-½, `normalize_qk`; grouped key heads already repeated, `repeat_heads`), v [B, L, H, dv],
g and β [B, L, H]. A token with g = 0 and β = 0 leaves S exactly unchanged (`mask_padding`):
that is how left padding, and the tail that pads L up to a multiple of C, stay exact.
Outputs are float32 [B, L, H, dv] and the final state [B, H, dk, dv].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64  # tokens per chunk (fla's and transformers' default)
# float32 matmuls at full precision (TPU's default f32 dot uses bf16 passes; GPU's may use
# TF32): the state accumulates over the whole sequence (MaxText's gated delta rule does too).
HIGHEST = jax.lax.Precision.HIGHEST
L2_EPS = 1e-6  # transformers' (and fla's) l2norm epsilon: x · rsqrt(Σx² + eps)


def _ein(spec: str, *xs: jax.Array) -> jax.Array:
  return jnp.einsum(spec, *xs, precision=HIGHEST)


def l2norm(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
  """x · rsqrt(Σx² + eps) over the last axis, float32 (transformers' `l2norm`)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def normalize_qk(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q and k L2-normalized per head, q then scaled by dk^-½ (float32)."""
  K = q_BxLxHxK.shape[-1]
  return l2norm(q_BxLxHxK) * (K**-0.5), l2norm(k_BxLxHxK)


def repeat_heads(x_BxLxGxK: jax.Array, n_heads: int) -> jax.Array:
  """Key heads G repeated to the value heads H: value head h reads key head h // (H/G)
  (transformers' `repeat_interleave`)."""
  return jnp.repeat(x_BxLxGxK, n_heads // x_BxLxGxK.shape[2], axis=2)


def decay_and_beta(
  a_BxLxH: jax.Array, b_BxLxH: jax.Array, A_log_H: jax.Array, dt_bias_H: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """g = −exp(A_log) · softplus(a + dt_bias) (log decay, ≤ 0) and β = σ(b), float32."""
  a32, b32 = a_BxLxH.astype(jnp.float32), b_BxLxH.astype(jnp.float32)
  g = -jnp.exp(A_log_H.astype(jnp.float32)) * jax.nn.softplus(a32 + dt_bias_H.astype(jnp.float32))
  return g, jax.nn.sigmoid(b32)


def mask_padding(
  g_BxLxH: jax.Array, beta_BxLxH: jax.Array, valid_BxL: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """g and β set to 0 where a token is not valid (padding), so the state passes unchanged."""
  if valid_BxL is None:
    return g_BxLxH, beta_BxLxH
  keep = valid_BxL[..., None]
  return jnp.where(keep, g_BxLxH, 0.0), jnp.where(keep, beta_BxLxH, 0.0)


def zero_state(B: int, H: int, K: int, V: int) -> jax.Array:
  return jnp.zeros((B, H, K, V), jnp.float32)


def recurrent_step(S_BxHxKxV, q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH):
  """One token of the rule: (new state, o_t [B, H, dv]), float32."""
  S = S_BxHxKxV * jnp.exp(g_BxH)[..., None, None]
  kv_BxHxV = _ein("bhkv,bhk->bhv", S, k_BxHxK)
  delta_BxHxV = (v_BxHxV - kv_BxHxV) * beta_BxH[..., None]
  S = S + k_BxHxK[..., :, None] * delta_BxHxV[..., None, :]
  return S, _ein("bhkv,bhk->bhv", S, q_BxHxK)


def _f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None):
  """The rule token by token (`lax.scan` over L): (o [B, L, H, dv], final state)."""
  q, k, v, g, beta = _f32(q, k, v, g, beta)
  B, _, H, K = k.shape
  S0 = zero_state(B, H, K, v.shape[-1]) if initial_state is None else initial_state
  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))

  def step(S, x):
    return recurrent_step(S, *x)

  S, o_LxBxHxV = jax.lax.scan(step, S0.astype(jnp.float32), xs)
  return jnp.moveaxis(o_LxBxHxV, 0, 1), S


def _chunked(x_BxLxHx: jax.Array, C: int) -> jax.Array:
  """[B, N·C, H, ...] -> [N, B, H, C, ...]: chunks first (the scan's axis), heads before time."""
  B, L, H = x_BxLxHx.shape[:3]
  x = x_BxLxHx.reshape(B, L // C, C, H, *x_BxLxHx.shape[3:])
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)


def _intra_chunk(q, k, v, g, beta):
  """Every chunk at once ([N, B, H, C, ...]): the solved values u, the decayed keys w that read
  the previous state, the decayed q, the masked q·k matrix, the keys decayed to the chunk's
  end and the chunk's total decay."""
  C = g.shape[-1]
  cum_C = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk's start to t
  lower_CxC = jnp.tril(jnp.ones((C, C), bool))
  diff = cum_C[..., :, None] - cum_C[..., None, :]  # i, j: log decay from j to i (i ≥ j)
  decay_CxC = jnp.where(lower_CxC, jnp.exp(jnp.where(lower_CxC, diff, 0.0)), 0.0)
  k_beta = k * beta[..., None]
  # (I + A) u = β v with A_ij = β_i exp(cum_i − cum_j) k_i·k_j for j < i (unit lower triangle)
  A_CxC = _ein("...ik,...jk->...ij", k_beta, k) * decay_CxC
  T_CxC = jnp.where(jnp.tril(lower_CxC, -1), A_CxC, 0.0) + jnp.eye(C, dtype=A_CxC.dtype)
  rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum_C)[..., None]], axis=-1)
  sol = _ein("...ij,...jk->...ik", unit_lower_inverse(T_CxC), rhs)
  u, w = sol[..., : v.shape[-1]], sol[..., v.shape[-1] :]
  attn_CxC = _ein("...ik,...jk->...ij", q, k) * decay_CxC
  q_dec = q * jnp.exp(cum_C)[..., None]
  k_dec = k * jnp.exp(cum_C[..., -1:] - cum_C)[..., None]
  return u, w, q_dec, attn_CxC, k_dec, jnp.exp(cum_C[..., -1])


def unit_lower_inverse(T_CxC: jax.Array) -> jax.Array:
  """The inverse of unit lower-triangular matrices [..., C, C] by blocked doubling: the
  inverse of [[A, 0], [L, B]] is [[A⁻¹, 0], [−B⁻¹ L A⁻¹, B⁻¹]], from 1×1 blocks up, log2 C
  levels of batched matmuls (stable as forward substitution). Matmuls only: jaxlib's CPU
  triangular-solve custom call deadlocked when two ran at once in one program (two
  forwards of a Gated DeltaNet model in one jit, seen with jaxlib 0.10.2)."""
  C = T_CxC.shape[-1]
  n = 1 << max(C - 1, 0).bit_length()
  lead = T_CxC.shape[:-2]
  T = jnp.broadcast_to(jnp.eye(n, dtype=T_CxC.dtype), (*lead, n, n))
  T = T.at[..., :C, :C].set(T_CxC)
  inv = jnp.ones((*lead, n, 1, 1), T.dtype)  # the 1×1 diagonal blocks' inverses
  s = 1
  while s < n:
    m = n // (2 * s)
    blocks = T.reshape(*lead, m, 2 * s, m, 2 * s)
    diag = jnp.einsum("...aiaj->...aij", blocks)  # the 2s×2s diagonal blocks
    L = diag[..., s:, :s]
    a_inv, b_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
    low = -_ein("...ij,...jk->...ik", _ein("...ij,...jk->...ik", b_inv, L), a_inv)
    zero = jnp.zeros_like(low)
    top = jnp.concatenate([a_inv, zero], axis=-1)
    bottom = jnp.concatenate([low, b_inv], axis=-1)
    inv = jnp.concatenate([top, bottom], axis=-2)
    s *= 2
  return inv[..., 0, :C, :C]


def _chunk_step(S_BxHxKxV, xs):
  """One chunk: its outputs from the previous state and within the chunk; the next state."""
  u, w, q_dec, attn_CxC, k_dec, total = xs
  v_new = u - _ein("bhck,bhkv->bhcv", w, S_BxHxKxV)
  o = _ein("bhck,bhkv->bhcv", q_dec, S_BxHxKxV) + _ein("bhcd,bhdv->bhcv", attn_CxC, v_new)
  S = S_BxHxKxV * total[..., None, None] + _ein("bhck,bhcv->bhkv", k_dec, v_new)
  return S, o


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK):
  """The rule in chunks of `chunk` tokens: (o [B, L, H, dv], final state), equal to
  `recurrent_gated_delta` up to float rounding. L is padded up to a multiple of the chunk
  with g = β = 0 tokens (the state passes them unchanged) whose outputs are dropped."""
  q, k, v, g, beta = _f32(q, k, v, g, beta)
  B, L, H, K = k.shape
  V = v.shape[-1]
  pad = (-L) % chunk

  def padded(x):
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

  q, k, v, g, beta = (_chunked(padded(x), chunk) for x in (q, k, v, g, beta))
  xs = _intra_chunk(q, k, v, g, beta)
  S0 = zero_state(B, H, K, V) if initial_state is None else initial_state.astype(jnp.float32)
  S, o_NxBxHxCxV = jax.lax.scan(_chunk_step, S0, xs)
  o_BxLxHxV = jnp.moveaxis(o_NxBxHxCxV, 0, 1).swapaxes(2, 3).reshape(B, L + pad, H, V)
  return o_BxLxHxV[:, :L], S
