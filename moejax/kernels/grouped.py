"""Grouped SwiGLU over expert-sorted row blocks, for backends where ragged_dot densifies.

Rows arrive sorted by expert. Each expert's run is covered by blocks of a few static
sizes (largest first), so most rows go through large matmuls and padding stays under one
small block per expert. One loop per size, with a *dynamic* trip count, visits only the
blocks in use: the static worst-case buffer costs memory, not FLOPs, and expert weights
are sliced in place instead of gathered per block. Gate and up are one parameter
[E, D, 2F] (`plans.ExpertWeights`), so each block does one [B, D] x [D, 2F] matmul for both
and the backward pass accumulates one [E, D, 2F] gradient. The backward pass
is the same loops (custom VJP), accumulating weight gradients in place.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.kernels import residuals
from moejax.kernels.permute import float0_like, take_or_zero


class Blocks(NamedTuple):
  """Blocks of one static size: first row and expert of each, and how many are in use."""

  start_N: jax.Array  # int32
  expert_N: jax.Array  # int32
  n_used: jax.Array  # int32 scalar


def _get(a, start, size):
  return jax.lax.dynamic_slice_in_dim(a, start, size)


def _rows(x, tok_R, start, size):
  """A block's input rows: a slice of the row buffer `x`, or with `tok_R` a gather from the
  token layout `x` (T reads zeros), so no [R, D] copy of the inputs is ever built."""
  if tok_R is None:
    return _get(x, start, size)
  return take_or_zero(x, _get(tok_R, start, size))


def _put(a, v, start):
  return jax.lax.dynamic_update_slice_in_dim(a, v.astype(a.dtype), start, 0)


def _accumulate(w_ExMxN, e, dw_MxN):
  """w[e] += dw as a slice read and write, which XLA does in place inside the loop."""
  cur = jax.lax.dynamic_index_in_dim(w_ExMxN, e, keepdims=True)
  return jax.lax.dynamic_update_index_in_dim(w_ExMxN, cur + dw_MxN.astype(cur.dtype), e, 0)


def _forward(x, w_gu_ExDx2F, w_down_ExFxD, blocks, sizes, w_R=None, tok_R=None):
  """(y_RxD, gu_Rx2F): each block's SwiGLU output (times its rows' `w_R` when given) and
  its gate/up projection, zeros on rows no block covers. `x` is the row buffer [R, D], or
  with `tok_R` the tokens [T, D] that rows read through it."""
  R, D, F2 = (x if tok_R is None else tok_R).shape[0], x.shape[1], w_gu_ExDx2F.shape[-1]
  F = F2 // 2
  carry = (jnp.zeros((R, D), x.dtype), jnp.zeros((R, F2), x.dtype))
  for size, blk in zip(sizes, blocks):

    def body(i, carry, size=size, blk=blk):
      y_RxD, gu_Rx2F = carry
      e, start = blk.expert_N[i], blk.start_N[i]
      gu_Bx2F = _rows(x, tok_R, start, size) @ w_gu_ExDx2F[e]
      h_BxF = jax.nn.silu(gu_Bx2F[:, :F]) * gu_Bx2F[:, F:]
      y_BxD = h_BxF @ w_down_ExFxD[e]
      if w_R is not None:
        y_BxD = y_BxD * _get(w_R, start, size)[:, None]
      return _put(y_RxD, y_BxD, start), _put(gu_Rx2F, gu_Bx2F, start)

    carry = jax.lax.fori_loop(0, blk.n_used, body, carry)
  return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_swiglu(x_RxD, w_gate_up_ExDx2F, w_down_ExFxD, blocks, sizes):
  """y[r] = SwiGLU_{e(r)}(x[r]) on the rows covered by `blocks` (one Blocks per size in
  `sizes`); zeros elsewhere."""
  return _forward(x_RxD, w_gate_up_ExDx2F, w_down_ExFxD, blocks, sizes)[0]


def _fwd(x_RxD, w_gu, w_down, blocks, sizes):
  y_RxD, gu_Rx2F = _forward(x_RxD, w_gu, w_down, blocks, sizes)
  return y_RxD, residuals.named((x_RxD, gu_Rx2F, w_gu, w_down, blocks))


def _t(a_MxN):
  """a.T, materialized: a dot contracting a loop slice's leading axis runs ~2x slower on CPU
  than the same dot on a transposed copy, and the barrier keeps XLA from folding it back."""
  return jax.lax.optimization_barrier(a_MxN.T)


def _backward(x, dy, gu_Rx2F, w_gu, w_down, blocks, sizes, w_R=None, tok_R=None):
  """The block loops of the backward pass: (dx_RxD, dw_R, dW_gu, dW_down), f32 weight
  gradients. `x` and `dy` are row buffers [R, D], or with `tok_R` token layouts [T, D] read
  through it (as in `_forward`). With `w_R` (rows scaled by a weight in the forward pass)
  dw_R[r] = Σ_f h·(dy @ W_downᵀ) comes from the product dh needs anyway; without it, dw_R
  is None."""
  F, f32 = w_down.shape[1], jnp.float32
  w_gu_Ex2FxD, w_down_ExDxF = jnp.swapaxes(w_gu, 1, 2), jnp.swapaxes(w_down, 1, 2)
  dw_R = None if w_R is None else jnp.zeros_like(w_R)
  dx_RxD = jnp.zeros((gu_Rx2F.shape[0], x.shape[1]), x.dtype)
  carry = (dx_RxD, dw_R, jnp.zeros(w_gu.shape, f32), jnp.zeros(w_down.shape, f32))
  for size, blk in zip(sizes, blocks):

    def body(i, carry, size=size, blk=blk):
      dx_RxD, dw_R, dwgu, dwd = carry
      e, start = blk.expert_N[i], blk.start_N[i]
      x_BxD, dy_BxD = _rows(x, tok_R, start, size), _rows(dy, tok_R, start, size)
      gu_Bx2F = _get(gu_Rx2F, start, size)
      g_BxF, u_BxF = gu_Bx2F[:, :F], gu_Bx2F[:, F:]
      sig = jax.nn.sigmoid(g_BxF)
      a_BxF = g_BxF * sig
      h_BxF = a_BxF * u_BxF
      dh_BxF = dy_BxD @ w_down_ExDxF[e]  # dL/dh before any row weight
      if w_R is not None:
        w_Bx1 = _get(w_R, start, size)[:, None]
        dw_R = _put(dw_R, jnp.sum(h_BxF * dh_BxF, -1), start)
        dh_BxF, h_BxF = dh_BxF * w_Bx1, h_BxF * w_Bx1
      dg_BxF = dh_BxF * u_BxF * sig * (1 + g_BxF * (1 - sig))
      dgu_Bx2F = jnp.concatenate([dg_BxF, dh_BxF * a_BxF], axis=-1)
      dwd = _accumulate(dwd, e, _t(h_BxF) @ dy_BxD)
      dwgu = _accumulate(dwgu, e, _t(x_BxD) @ dgu_Bx2F)
      return _put(dx_RxD, dgu_Bx2F @ w_gu_Ex2FxD[e], start), dw_R, dwgu, dwd

    carry = jax.lax.fori_loop(0, blk.n_used, body, carry)
  return carry


def _bwd(sizes, res, dy_RxD):
  x_RxD, gu_Rx2F, w_gu, w_down, blocks = res
  dx, _, dwgu, dwd = _backward(x_RxD, dy_RxD, gu_Rx2F, w_gu, w_down, blocks, sizes)
  return (dx, dwgu.astype(w_gu.dtype), dwd.astype(w_down.dtype), jax.tree.map(float0_like, blocks))


grouped_swiglu.defvjp(_fwd, _bwd)
