"""Grouped SwiGLU over expert-sorted row blocks, for backends where ragged_dot densifies.

Rows arrive sorted by expert. Each expert's run is covered by blocks of a few static
sizes (largest first, e.g. 512, 128, 32 rows), so most rows go through large, efficient
matmuls and padding stays under one small block per expert. One loop per size, with a
*dynamic* trip count, visits only the blocks in use: the static worst-case buffer costs
memory, not FLOPs, and expert weights are sliced in place instead of gathered per block.
The backward pass is the same loops (custom VJP), accumulating weight gradients in place.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Blocks(NamedTuple):
  """Blocks of one static size: first row and expert of each, and how many are in use."""

  start_N: jax.Array  # int32
  expert_N: jax.Array  # int32
  n_used: jax.Array  # int32 scalar


def _get(a, start, size):
  return jax.lax.dynamic_slice_in_dim(a, start, size)


def _put(a, v, start):
  return jax.lax.dynamic_update_slice_in_dim(a, v.astype(a.dtype), start, 0)


def _forward(x_RxD, w_gate, w_up, w_down, blocks, sizes):
  R, F = x_RxD.shape[0], w_gate.shape[-1]
  zeros = lambda n: jnp.zeros((R, n), x_RxD.dtype)
  carry = (zeros(x_RxD.shape[1]), zeros(F), zeros(F))
  for size, blk in zip(sizes, blocks):

    def body(i, carry, size=size, blk=blk):
      y_RxD, g_RxF, u_RxF = carry
      e, start = blk.expert_N[i], blk.start_N[i]
      x_BxD = _get(x_RxD, start, size)
      g_BxF = x_BxD @ w_gate[e]
      u_BxF = x_BxD @ w_up[e]
      y_BxD = (jax.nn.silu(g_BxF) * u_BxF) @ w_down[e]
      return _put(y_RxD, y_BxD, start), _put(g_RxF, g_BxF, start), _put(u_RxF, u_BxF, start)

    carry = jax.lax.fori_loop(0, blk.n_used, body, carry)
  return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_swiglu(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, blocks, sizes):
  """y[r] = SwiGLU_{e(r)}(x[r]) on the rows covered by `blocks` (one Blocks per size in
  `sizes`); zeros elsewhere."""
  return _forward(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, blocks, sizes)[0]


def _fwd(x_RxD, w_gate, w_up, w_down, blocks, sizes):
  y_RxD, g_RxF, u_RxF = _forward(x_RxD, w_gate, w_up, w_down, blocks, sizes)
  return y_RxD, (x_RxD, g_RxF, u_RxF, w_gate, w_up, w_down, blocks)


def _bwd(sizes, res, dy_RxD):
  x_RxD, g_RxF, u_RxF, w_gate, w_up, w_down, blocks = res
  f32 = jnp.float32
  carry = (
    jnp.zeros_like(x_RxD),
    jnp.zeros(w_gate.shape, f32),
    jnp.zeros(w_up.shape, f32),
    jnp.zeros(w_down.shape, f32),
  )
  for size, blk in zip(sizes, blocks):

    def body(i, carry, size=size, blk=blk):
      dx_RxD, dwg, dwu, dwd = carry
      e, start = blk.expert_N[i], blk.start_N[i]
      x_BxD, dy_BxD = _get(x_RxD, start, size), _get(dy_RxD, start, size)
      g_BxF, u_BxF = _get(g_RxF, start, size), _get(u_RxF, start, size)
      sig = jax.nn.sigmoid(g_BxF)
      a_BxF = g_BxF * sig
      dh_BxF = dy_BxD @ w_down[e].T
      du_BxF = dh_BxF * a_BxF
      dg_BxF = dh_BxF * u_BxF * sig * (1 + g_BxF * (1 - sig))
      dx_BxD = dg_BxF @ w_gate[e].T + du_BxF @ w_up[e].T
      dwd = dwd.at[e].add(((a_BxF * u_BxF).T @ dy_BxD).astype(f32))
      dwg = dwg.at[e].add((x_BxD.T @ dg_BxF).astype(f32))
      dwu = dwu.at[e].add((x_BxD.T @ du_BxF).astype(f32))
      return _put(dx_RxD, dx_BxD, start), dwg, dwu, dwd

    carry = jax.lax.fori_loop(0, blk.n_used, body, carry)
  dx, dwg, dwu, dwd = carry
  none = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)
  grads_w = (dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype), dwd.astype(w_down.dtype))
  return (dx, *grads_w, jax.tree.map(none, blocks))


grouped_swiglu.defvjp(_fwd, _bwd)
