"""Gather, grouped SwiGLU and weighted combine as one custom VJP, for the CPU block loop.

`y[t] = Σ_k w[t,k] · SwiGLU_{e(t,k)}(x[t])`. Unfused, autodiff keeps two [T·K, D] buffers
per layer alive until the backward pass: the expert-sorted inputs (for dW) and the expert
outputs (for dL/dw). Here the combine weight is applied inside the block loop, so the
backward pass recovers dL/dw[r] = Σ_f h·(dy @ W_downᵀ) from a product it needs anyway, and
the sorted inputs are gathered again from `x_TxD` instead of being kept. The only
per-layer residual is the gate/up projection [R, 2F]; [R, D] buffers are transient.

Every row movement is a gather: rows read tokens through `tok_R` (T for padding or a
dropped assignment, which reads zeros) and tokens read their K rows through `row_TxK`
(R for a dropped assignment). Used by both dispatch modes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.grouped import _accumulate, _forward, _get, _put, _t


def _rows(a_NxD, idx):
  """a[idx] with idx == N reading a zero row."""
  return jnp.take(a_NxD, idx, axis=0, mode="fill", fill_value=0)


def _run(x_TxD, w_R, tok_R, row_TxK, w_gate, w_up, w_down, blocks, sizes):
  w_gu = jnp.concatenate([w_gate, w_up], axis=-1)
  y_RxD, gu_Rx2F = _forward(_rows(x_TxD, tok_R), w_gu, w_down, blocks, sizes, w_R)
  return _rows(y_RxD, row_TxK).sum(axis=1), (gu_Rx2F, w_gu)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def gather_swiglu_combine(x_TxD, w_R, tok_R, row_TxK, w_gate, w_up, w_down, blocks, sizes):
  """y[t] = Σ_k w[row(t,k)] · SwiGLU_{e(row)}(x[t]) over the rows covered by `blocks`.

  `tok_R`: each row's token (T for padding); `row_TxK`: each assignment's row (R if
  dropped); `w_R`: each row's combine weight. Each block's rows belong to one expert.
  """
  return _run(x_TxD, w_R, tok_R, row_TxK, w_gate, w_up, w_down, blocks, sizes)[0]


def _fwd(x_TxD, w_R, tok_R, row_TxK, w_gate, w_up, w_down, blocks, sizes):
  y_TxD, (gu_Rx2F, w_gu) = _run(x_TxD, w_R, tok_R, row_TxK, w_gate, w_up, w_down, blocks, sizes)
  return y_TxD, (x_TxD, w_R, tok_R, row_TxK, gu_Rx2F, w_gu, w_down, blocks)


def _backward(x_RxD, dy_RxD, w_R, gu_Rx2F, w_gu, w_down, blocks, sizes):
  F, f32 = w_down.shape[1], jnp.float32
  w_gu_Ex2FxD, w_down_ExDxF = jnp.swapaxes(w_gu, 1, 2), jnp.swapaxes(w_down, 1, 2)
  carry = (
    jnp.zeros_like(x_RxD),
    jnp.zeros_like(w_R),
    jnp.zeros(w_gu.shape, f32),
    jnp.zeros(w_down.shape, f32),
  )
  for size, blk in zip(sizes, blocks):

    def body(i, carry, size=size, blk=blk):
      dx_RxD, dw_R, dwgu, dwd = carry
      e, start = blk.expert_N[i], blk.start_N[i]
      x_BxD, dy_BxD = _get(x_RxD, start, size), _get(dy_RxD, start, size)
      w_Bx1 = _get(w_R, start, size)[:, None]
      gu_Bx2F = _get(gu_Rx2F, start, size)
      g_BxF, u_BxF = gu_Bx2F[:, :F], gu_Bx2F[:, F:]
      sig = jax.nn.sigmoid(g_BxF)
      a_BxF = g_BxF * sig
      h_BxF = a_BxF * u_BxF
      dhu_BxF = dy_BxD @ w_down_ExDxF[e]  # dL/dh before the combine weight
      dw_R = _put(dw_R, jnp.sum(h_BxF * dhu_BxF, -1), start)
      dh_BxF = dhu_BxF * w_Bx1
      dg_BxF = dh_BxF * u_BxF * sig * (1 + g_BxF * (1 - sig))
      dgu_Bx2F = jnp.concatenate([dg_BxF, dh_BxF * a_BxF], axis=-1)
      dwd = _accumulate(dwd, e, _t(h_BxF * w_Bx1) @ dy_BxD)
      dwgu = _accumulate(dwgu, e, _t(x_BxD) @ dgu_Bx2F)
      return _put(dx_RxD, dgu_Bx2F @ w_gu_Ex2FxD[e], start), dw_R, dwgu, dwd

    carry = jax.lax.fori_loop(0, blk.n_used, body, carry)
  return carry


def _bwd(sizes, res, dy_TxD):
  x_TxD, w_R, tok_R, row_TxK, gu_Rx2F, w_gu, w_down, blocks = res
  x_RxD, dy_RxD = _rows(x_TxD, tok_R), _rows(dy_TxD, tok_R)
  dx_RxD, dw_R, dwgu, dwd = _backward(x_RxD, dy_RxD, w_R, gu_Rx2F, w_gu, w_down, blocks, sizes)
  dx_TxD = _rows(dx_RxD, row_TxK).sum(axis=1)
  none = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)
  dwg, dwu = (d.astype(w_gu.dtype) for d in jnp.split(dwgu, 2, axis=-1))
  ints = (none(tok_R), none(row_TxK))
  return (dx_TxD, dw_R, *ints, dwg, dwu, dwd.astype(w_down.dtype), jax.tree.map(none, blocks))


gather_swiglu_combine.defvjp(_fwd, _bwd)
