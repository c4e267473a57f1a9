"""The native routed expert FFN as a custom VJP over two XLA FFI calls (CPU).

`y[t] = Σ_k w[row(t,k)] · SwiGLU_{e(row)}(x[t])`, as `fused.gather_swiglu_combine`, over a
row buffer described by `tok_R` (each row's token, T for an empty row), `expert_R` (each
row's expert) and `row_TxK` (each assignment's row, R if dropped). The forward call keeps one
residual, the gate/up projection [R, 2F]; the backward call returns dx, dL/dw per row and
the f32 weight gradients. Inputs are float32 or bfloat16 (f32 accumulation inside).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.errors import UserError
from moejax.kernels import residuals
from moejax.kernels.permute import float0_like

DTYPES = (jnp.float32, jnp.bfloat16)


def check_operands(x_TxD, w_gu_ExDx2F, w_down_ExFxD, floats, ints, shapes, layout) -> None:
  """One UserError line for the first operand of the wrong dtype or shape: x float32 or
  bfloat16; `floats` (name -> array, the weights first) of x's dtype; `ints` int32; x, w_gu
  and w_down, then `shapes` (name -> (shape, wanted; None where unknown)) as wanted.
  `layout` names every operand's shape in the message."""
  if x_TxD.dtype not in DTYPES:
    raise UserError(f"impl='native' takes float32 or bfloat16 tokens, not {x_TxD.dtype}")
  for name, a in floats.items():
    if a.dtype != x_TxD.dtype:
      raise UserError(f"impl='native': {name} is {a.dtype}, the tokens {x_TxD.dtype}")
  for name, a in ints.items():
    if a.dtype != jnp.int32:
      raise UserError(f"impl='native': {name} must be int32, not {a.dtype}")
  T, D = x_TxD.shape if x_TxD.ndim == 2 else (None, None)
  E, _, F2 = w_gu_ExDx2F.shape if w_gu_ExDx2F.ndim == 3 else (None, None, None)
  expected = {
    "x": (x_TxD.shape, (T, D)),
    "w_gu": (w_gu_ExDx2F.shape, (E, D, F2 if F2 is None or F2 % 2 == 0 else None)),
    "w_down": (w_down_ExFxD.shape, (E, (F2 or 0) // 2, D)),
    **shapes,
  }
  for name, (got, want) in expected.items():
    if None in want or got != want:
      raise UserError(f"impl='native': {name} has shape {got}; shapes are {layout}")


def check(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu_ExDx2F, w_down_ExFxD) -> None:
  """One UserError line for an operand of the wrong dtype or shape."""
  T = x_TxD.shape[0] if x_TxD.ndim == 2 else None
  R = w_R.shape[0] if w_R.ndim == 1 else None
  K = row_TxK.shape[-1] if row_TxK.ndim == 2 else None
  check_operands(
    x_TxD,
    w_gu_ExDx2F,
    w_down_ExFxD,
    {"w_R": w_R, "w_gu": w_gu_ExDx2F, "w_down": w_down_ExFxD},
    {"tok_R": tok_R, "expert_R": expert_R, "row_TxK": row_TxK},
    {
      "w_R": (w_R.shape, (R,)),
      "tok_R": (tok_R.shape, (R,)),
      "expert_R": (expert_R.shape, (R,)),
      "row_TxK": (row_TxK.shape, (T, K)),
    },
    "x [T, D], w_gu [E, D, 2F], w_down [E, F, D], w_R/tok_R/expert_R [R], row_TxK [T, K]",
  )


def forward_out(x_TxD, rows: int, w_gu) -> tuple:
  """A forward call's results: y like x, and the gate/up projection [rows, 2F] (residual)."""
  like_x = jax.ShapeDtypeStruct(x_TxD.shape, x_TxD.dtype)
  return like_x, jax.ShapeDtypeStruct((rows, w_gu.shape[-1]), x_TxD.dtype)


def backward_out(x_TxD, w, w_gu, w_down) -> tuple:
  """A backward call's results: dx like x, dL/dw like the routing weights `w`, and the f32
  weight gradients."""
  f32 = jnp.float32
  return (
    jax.ShapeDtypeStruct(x_TxD.shape, x_TxD.dtype),
    jax.ShapeDtypeStruct(w.shape, w.dtype),
    jax.ShapeDtypeStruct(w_gu.shape, f32),
    jax.ShapeDtypeStruct(w_down.shape, f32),
  )


def _forward_call(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu, w_down):
  out = forward_out(x_TxD, w_R.shape[0], w_gu)
  call = jax.ffi.ffi_call("moejax_native_forward", out, vmap_method="sequential")
  return call(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu, w_down)


def _backward_call(x_TxD, dy_TxD, gu_Rx2F, w_R, tok_R, expert_R, row_TxK, w_gu, w_down):
  out = backward_out(x_TxD, w_R, w_gu, w_down)
  call = jax.ffi.ffi_call("moejax_native_backward", out, vmap_method="sequential")
  return call(x_TxD, dy_TxD, gu_Rx2F, w_R, tok_R, expert_R, row_TxK, w_gu, w_down)


@jax.custom_vjp
def swiglu_combine(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu_ExDx2F, w_down_ExFxD):
  """y_TxD; see the module docstring. Call `check` first (the FFI errors are not one line)."""
  return _forward_call(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu_ExDx2F, w_down_ExFxD)[0]


def _fwd(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu, w_down):
  y_TxD, gu_Rx2F = _forward_call(x_TxD, w_R, tok_R, expert_R, row_TxK, w_gu, w_down)
  return y_TxD, residuals.named((x_TxD, gu_Rx2F, w_R, tok_R, expert_R, row_TxK, w_gu, w_down))


def _bwd(res, dy_TxD):
  x_TxD, gu_Rx2F, w_R, tok_R, expert_R, row_TxK, w_gu, w_down = res
  dy_TxD = dy_TxD.astype(x_TxD.dtype)
  dx, dw_R, dw_gu, dw_down = _backward_call(
    x_TxD, dy_TxD, gu_Rx2F, w_R, tok_R, expert_R, row_TxK, w_gu, w_down
  )
  ints = (float0_like(tok_R), float0_like(expert_R), float0_like(row_TxK))
  return (dx, dw_R, *ints, dw_gu.astype(w_gu.dtype), dw_down.astype(w_down.dtype))


swiglu_combine.defvjp(_fwd, _bwd)
