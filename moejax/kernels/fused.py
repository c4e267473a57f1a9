"""Gather, grouped SwiGLU and weighted combine as one custom VJP, for the CPU block loop.

`y[t] = Σ_k w[t,k] · SwiGLU_{e(t,k)}(x[t])`. Unfused, autodiff keeps two [T·K, D] buffers
per layer alive until the backward pass: the expert-sorted inputs (for dW) and the expert
outputs (for dL/dw). Here the combine weight is applied inside the block loop, so the
backward pass recovers dL/dw[r] = Σ_f h·(dy @ W_downᵀ) from a product it needs anyway. Each
block gathers its input rows (and, backward, its dy rows) from the token layout inside the
loop, so no [R, D] copy of x or dy is built: the only [R, D] buffers are the block outputs
(y forward, dx backward), transient, and the only per-layer residual is the gate/up
projection [R, 2F].

Every row movement is a gather: rows read tokens through `tok_R` (T for padding or a
dropped assignment, which reads zeros) and tokens read their K rows through `row_TxK`
(R for a dropped assignment). Used by both dispatch modes.
"""

from __future__ import annotations

import functools

import jax

from moejax.kernels import residuals
from moejax.kernels.grouped import _backward, _forward
from moejax.kernels.permute import float0_like, gather_sum, take_rows


def _run(x_TxD, w_R, tok_R, row_TxK, w_gu, w_down, blocks, sizes):
  y_RxD, gu_Rx2F = _forward(x_TxD, w_gu, w_down, blocks, sizes, w_R, tok_R)
  return gather_sum(y_RxD, row_TxK), gu_Rx2F


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def gather_swiglu_combine(x_TxD, w_R, tok_R, row_TxK, w_gu, w_down, blocks, sizes):
  """y[t] = Σ_k w[row(t,k)] · SwiGLU_{e(row)}(x[t]) over the rows covered by `blocks`.

  `tok_R`: each row's token (T for padding); `row_TxK`: each assignment's row (R if
  dropped); `w_R`: each row's combine weight. Each block's rows belong to one expert.
  """
  return _run(x_TxD, w_R, tok_R, row_TxK, w_gu, w_down, blocks, sizes)[0]


def _fwd(x_TxD, w_R, tok_R, row_TxK, w_gu, w_down, blocks, sizes):
  y_TxD, gu_Rx2F = _run(x_TxD, w_R, tok_R, row_TxK, w_gu, w_down, blocks, sizes)
  return y_TxD, residuals.named((x_TxD, w_R, tok_R, row_TxK, gu_Rx2F, w_gu, w_down, blocks))


def _bwd(sizes, res, dy_TxD):
  x_TxD, w_R, tok_R, row_TxK, gu_Rx2F, w_gu, w_down, blocks = res
  dx_RxD, dw_R, dwgu, dwd = _backward(
    x_TxD, dy_TxD, gu_Rx2F, w_gu, w_down, blocks, sizes, w_R, tok_R
  )
  dx_TxD = gather_sum(dx_RxD, row_TxK)
  ints = (float0_like(tok_R), float0_like(row_TxK))
  blocks0 = jax.tree.map(float0_like, blocks)
  return (dx_TxD, dw_R, *ints, dwgu.astype(w_gu.dtype), dwd.astype(w_down.dtype), blocks0)


gather_swiglu_combine.defvjp(_fwd, _bwd)


def run(a) -> jax.Array:
  """The `fused` kernel on `plans.KernelArgs`: each row's combine weight is gathered from
  its assignment, then one custom VJP runs gather, block loop and combine."""
  T, K = a.weights_TxK.shape
  w_Ax1 = a.weights_TxK.reshape(T * K, 1).astype(a.x_TxD.dtype)
  w_R = take_rows(w_Ax1, a.plan.assign_of_R, a.plan.row_of_A[:, None])[:, 0]
  row_TxK = a.plan.row_of_A.reshape(T, K)
  return gather_swiglu_combine(a.x_TxD, w_R, a.plan.token_of_R, row_TxK, *a.ex, a.blocks, a.sizes)
