"""Grouped SwiGLU over expert-sorted row blocks, for backends where ragged_dot densifies.

Rows arrive sorted by expert and padded so every block of `block` rows belongs to one
expert. A loop with a *dynamic* trip count visits only the blocks in use, so the static
worst-case padding of the buffer costs memory, not FLOPs, and expert weights are sliced
in place instead of gathered per block. The backward pass is a second loop (custom VJP)
that accumulates each expert's weight gradient in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _block(a, i, block):
  return jax.lax.dynamic_slice_in_dim(a, i * block, block)


def _put(a, v, i, block):
  return jax.lax.dynamic_update_slice_in_dim(a, v.astype(a.dtype), i * block, 0)


def _forward(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_N, n_used, block):
  R, F = x_RxD.shape[0], w_gate_ExDxF.shape[-1]

  def body(i, carry):
    y_RxD, g_RxF, u_RxF = carry
    e = expert_N[i]
    x_BxD = _block(x_RxD, i, block)
    g_BxF = x_BxD @ w_gate_ExDxF[e]
    u_BxF = x_BxD @ w_up_ExDxF[e]
    y_BxD = (jax.nn.silu(g_BxF) * u_BxF) @ w_down_ExFxD[e]
    return _put(y_RxD, y_BxD, i, block), _put(g_RxF, g_BxF, i, block), _put(u_RxF, u_BxF, i, block)

  zeros = lambda n: jnp.zeros((R, n), x_RxD.dtype)
  return jax.lax.fori_loop(0, n_used, body, (zeros(x_RxD.shape[1]), zeros(F), zeros(F)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def grouped_swiglu(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_N, n_used, block):
  """y[r] = SwiGLU_{e(r)}(x[r]) for rows in the first `n_used` blocks; zeros after."""
  return _forward(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_N, n_used, block)[0]


def _fwd(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_N, n_used, block):
  y_RxD, g_RxF, u_RxF = _forward(
    x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_N, n_used, block
  )
  return y_RxD, (x_RxD, g_RxF, u_RxF, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_N, n_used)


def _bwd(block, res, dy_RxD):
  x_RxD, g_RxF, u_RxF, w_gate, w_up, w_down, expert_N, n_used = res
  f32 = jnp.float32

  def body(i, carry):
    dx_RxD, dwg, dwu, dwd = carry
    e = expert_N[i]
    x_BxD, dy_BxD = _block(x_RxD, i, block), _block(dy_RxD, i, block)
    g_BxF, u_BxF = _block(g_RxF, i, block), _block(u_RxF, i, block)
    sig = jax.nn.sigmoid(g_BxF)
    a_BxF = g_BxF * sig
    dh_BxF = dy_BxD @ w_down[e].T
    du_BxF = dh_BxF * a_BxF
    dg_BxF = dh_BxF * u_BxF * sig * (1 + g_BxF * (1 - sig))
    dx_BxD = dg_BxF @ w_gate[e].T + du_BxF @ w_up[e].T
    dwd = dwd.at[e].add(((a_BxF * u_BxF).T @ dy_BxD).astype(f32))
    dwg = dwg.at[e].add((x_BxD.T @ dg_BxF).astype(f32))
    dwu = dwu.at[e].add((x_BxD.T @ du_BxF).astype(f32))
    return _put(dx_RxD, dx_BxD, i, block), dwg, dwu, dwd

  init = (
    jnp.zeros_like(x_RxD),
    jnp.zeros(w_gate.shape, f32),
    jnp.zeros(w_up.shape, f32),
    jnp.zeros(w_down.shape, f32),
  )
  dx, dwg, dwu, dwd = jax.lax.fori_loop(0, n_used, body, init)
  none = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)
  return (
    dx,
    dwg.astype(w_gate.dtype),
    dwu.astype(w_up.dtype),
    dwd.astype(w_down.dtype),
    none(expert_N),
    none(n_used),
  )


grouped_swiglu.defvjp(_fwd, _bwd)
