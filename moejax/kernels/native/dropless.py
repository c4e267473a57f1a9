"""The native routed expert FFN in dropless mode, planned inside the FFI calls (CPU).

`y[t] = Σ_k w[t, k] · SwiGLU_{e[t, k]}(x[t])` from the routing itself: each call sorts the
assignments by expert (a counting sort, `src/plan.h`) into the contiguous row buffer that
`plans.dropless_plan` would build with one-row blocks, and runs the kernel of `ops` on it. So
the XLA program holds none of the plan's sort, cumsums, searchsorted loop and scatters,
forward or backward: on the study shape's CPU train step that is 39 fewer fused kernels to
generate code for (docs/performance.md). An expert id of E marks an unused assignment
(elastic-k): it takes no row and gets gradient 0. The backward call plans again from the
same routing, so the only residuals are the inputs and the gate/up projection [T·K, 2F].
"""

from __future__ import annotations

import jax

from moejax.kernels import residuals
from moejax.kernels.native import ops
from moejax.kernels.permute import float0_like

TARGETS = ("moejax_native_dropless_forward", "moejax_native_dropless_backward")


def check(x_TxD, w_TxK, experts_TxK, w_gu_ExDx2F, w_down_ExFxD) -> None:
  """One UserError line for an operand of the wrong dtype or shape (`ops.check_operands`)."""
  T = x_TxD.shape[0] if x_TxD.ndim == 2 else None
  K = w_TxK.shape[-1] if w_TxK.ndim == 2 else None
  ops.check_operands(
    x_TxD,
    w_gu_ExDx2F,
    w_down_ExFxD,
    {"w_TxK": w_TxK, "w_gu": w_gu_ExDx2F, "w_down": w_down_ExFxD},
    {"experts_TxK": experts_TxK},
    {"w_TxK": (w_TxK.shape, (T, K)), "experts_TxK": (experts_TxK.shape, (T, K))},
    "x [T, D], w_gu [E, D, 2F], w_down [E, F, D], w_TxK/experts_TxK [T, K]",
  )


def _forward_call(x_TxD, w_TxK, experts_TxK, w_gu, w_down):
  out = ops.forward_out(x_TxD, w_TxK.size, w_gu)
  call = jax.ffi.ffi_call(TARGETS[0], out, vmap_method="sequential")
  return call(x_TxD, w_TxK, experts_TxK, w_gu, w_down)


def _backward_call(x_TxD, dy_TxD, gu_Rx2F, w_TxK, experts_TxK, w_gu, w_down):
  out = ops.backward_out(x_TxD, w_TxK, w_gu, w_down)
  call = jax.ffi.ffi_call(TARGETS[1], out, vmap_method="sequential")
  return call(x_TxD, dy_TxD, gu_Rx2F, w_TxK, experts_TxK, w_gu, w_down)


@jax.custom_vjp
def swiglu_combine(x_TxD, w_TxK, experts_TxK, w_gu_ExDx2F, w_down_ExFxD):
  """y_TxD; see the module docstring. Call `check` first (the FFI errors are not one line)."""
  return _forward_call(x_TxD, w_TxK, experts_TxK, w_gu_ExDx2F, w_down_ExFxD)[0]


def _fwd(x_TxD, w_TxK, experts_TxK, w_gu, w_down):
  y_TxD, gu_Rx2F = _forward_call(x_TxD, w_TxK, experts_TxK, w_gu, w_down)
  return y_TxD, residuals.named((x_TxD, gu_Rx2F, w_TxK, experts_TxK, w_gu, w_down))


def _bwd(res, dy_TxD):
  x_TxD, gu_Rx2F, w_TxK, experts_TxK, w_gu, w_down = res
  dy_TxD = dy_TxD.astype(x_TxD.dtype)
  dx, dw_TxK, dw_gu, dw_down = _backward_call(
    x_TxD, dy_TxD, gu_Rx2F, w_TxK, experts_TxK, w_gu, w_down
  )
  return (
    dx,
    dw_TxK,
    float0_like(experts_TxK),
    dw_gu.astype(w_gu.dtype),
    dw_down.astype(w_down.dtype),
  )


swiglu_combine.defvjp(_fwd, _bwd)
