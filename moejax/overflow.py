"""SwiGLU experts over a few expert-sorted assignments, gathered and combined in place.

The bucketed dropless path (dispatch.dropless, impl="bucketed") runs the first C
assignments of every expert as one batched einsum; this loop computes the rest, the
*overflow*. Each block is `b` consecutive expert-sorted assignments of one expert: it
gathers its tokens' rows straight from x, runs the expert, and adds r·y to the tokens'
outputs. No row buffer is built, so memory does not grow with the worst case, and the
trip count is the number of overflow blocks in use (zero on a balanced routing).

The backward pass is the same loop (custom VJP): it recomputes the block's activations
from x instead of saving them, and returns gradients for x, the routing weights r and
the expert weights.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class OverflowBlocks(NamedTuple):
  """Blocks of `b` sorted positions: first position, end of its expert's run, expert."""

  start_N: jax.Array  # int32
  end_N: jax.Array  # int32
  expert_N: jax.Array  # int32
  n_used: jax.Array  # int32 scalar
  order_A: jax.Array  # int32 [A]: the assignment at each sorted position


def _rows(blocks: OverflowBlocks, i, b: int, K: int, r_A: jax.Array):
  """(assignment, token, weight) of block i's b rows; rows past the run get weight 0."""
  pos_B = blocks.start_N[i] + jnp.arange(b)
  valid_B = pos_B < blocks.end_N[i]
  a_B = jnp.where(valid_B, blocks.order_A[jnp.minimum(pos_B, r_A.shape[0] - 1)], 0)
  return a_B, a_B // K, jnp.where(valid_B, r_A[a_B], 0).astype(r_A.dtype), valid_B


def _swiglu(x_BxD, w_gu_Dx2F, w_down_FxD):
  gu_Bx2F = x_BxD @ w_gu_Dx2F
  F = w_down_FxD.shape[0]
  h_BxF = jax.nn.silu(gu_Bx2F[:, :F]) * gu_Bx2F[:, F:]
  return gu_Bx2F, h_BxF, h_BxF @ w_down_FxD


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def overflow_swiglu(x_TxD, r_A, w_gu_ExDx2F, w_down_ExFxD, blocks, b, K):
  """y[t] = Σ over t's assignments a in `blocks` of r[a] · SwiGLU_{e(a)}(x[t])."""

  def body(i, y_TxD):
    _, t_B, r_B, _ = _rows(blocks, i, b, K, r_A)
    e = blocks.expert_N[i]
    y_BxD = _swiglu(x_TxD[t_B], w_gu_ExDx2F[e], w_down_ExFxD[e])[2]
    return y_TxD.at[t_B].add(r_B[:, None].astype(y_BxD.dtype) * y_BxD)

  return jax.lax.fori_loop(0, blocks.n_used, body, jnp.zeros_like(x_TxD))


def _fwd(x_TxD, r_A, w_gu, w_down, blocks, b, K):
  return overflow_swiglu(x_TxD, r_A, w_gu, w_down, blocks, b, K), (x_TxD, r_A, w_gu, w_down, blocks)


def _bwd(b, K, res, dy_TxD):
  x_TxD, r_A, w_gu, w_down, blocks = res
  F = w_down.shape[1]
  f32 = jnp.float32

  def body(i, carry):
    dx_TxD, dr_A, dwgu, dwd = carry
    a_B, t_B, r_B, valid_B = _rows(blocks, i, b, K, r_A)
    e = blocks.expert_N[i]
    x_BxD, g_BxD = x_TxD[t_B], dy_TxD[t_B]
    gu_Bx2F, h_BxF, y_BxD = _swiglu(x_BxD, w_gu[e], w_down[e])
    dr_A = dr_A.at[jnp.where(valid_B, a_B, r_A.shape[0])].set(
      jnp.sum(g_BxD * y_BxD, -1).astype(dr_A.dtype), mode="drop"
    )
    dy_BxD = g_BxD * r_B[:, None].astype(g_BxD.dtype)
    g, u = gu_Bx2F[:, :F], gu_Bx2F[:, F:]
    sig = jax.nn.sigmoid(g)
    dh_BxF = dy_BxD @ w_down[e].T
    dgu_Bx2F = jnp.concatenate([dh_BxF * u * sig * (1 + g * (1 - sig)), dh_BxF * g * sig], -1)
    dwd = dwd.at[e].add((h_BxF.T @ dy_BxD).astype(f32))
    dwgu = dwgu.at[e].add((x_BxD.T @ dgu_Bx2F).astype(f32))
    return dx_TxD.at[t_B].add(dgu_Bx2F @ w_gu[e].T), dr_A, dwgu, dwd

  init = (
    jnp.zeros_like(x_TxD),
    jnp.zeros_like(r_A),
    jnp.zeros(w_gu.shape, f32),
    jnp.zeros(w_down.shape, f32),
  )
  dx, dr, dwgu, dwd = jax.lax.fori_loop(0, blocks.n_used, body, init)
  none = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)
  return dx, dr, dwgu.astype(w_gu.dtype), dwd.astype(w_down.dtype), jax.tree.map(none, blocks)


overflow_swiglu.defvjp(_fwd, _bwd)
