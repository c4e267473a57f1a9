"""The `batched` kernel: capacity mode as batched matmuls, with no loop.

The capacity buffer is laid out [group, expert, slot] (`plans.capacity_plan`): N = groups·E
blocks of C rows, block n holding expert n mod E. Reshaped to [groups, E, C, D], each
projection is one einsum against the stacked expert weights, as in GShard's and MaxText's
dense (capacity) MoE path: `gecd,edf->gecf` for gate and up (one einsum against the one
[E, D, 2F] parameter), `gecf,efd->gecd` for down. Autodiff gives dx and dW as batched
matmuls too. Rows
of a dropped or empty slot are zeros and contribute zero. As in `fused`, each row's output is
scaled by its combine weight before the K rows of a token are summed (`permute.gather_sum`),
so the combine adds in the same order; its transpose is a gather (`permute.sum_rows`).

Work and memory are the whole buffer, C·E per group, whatever the routing (the capacity
factor bounds the padding): no dynamic trip count, which XLA:GPU compiles into a few large
GEMMs instead of a while loop of small ones (`fused`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import plans
from moejax.kernels.permute import sum_rows, take_rows


def swiglu(x_GxExCxD, ex: plans.ExpertWeights) -> jax.Array:
  """SwiGLU of each expert e on its rows [:, e], batched over groups and experts, in the
  compute dtype (as `fused`'s block matmuls; XLA's GPU and TPU GEMMs accumulate in f32)."""
  F = ex.w_down_ExFxD.shape[1]
  gu_GxExCx2F = jnp.einsum("gecd,edf->gecf", x_GxExCxD, ex.w_gate_up_ExDx2F)
  h_GxExCxF = jax.nn.silu(gu_GxExCx2F[..., :F]) * gu_GxExCx2F[..., F:]
  return jnp.einsum("gecf,efd->gecd", h_GxExCxF, ex.w_down_ExFxD)


def run(a: plans.KernelArgs) -> jax.Array:
  """The capacity buffer ([group, expert, slot], `a.sizes == (C,)`) through batched SwiGLU."""
  T, K = a.weights_TxK.shape
  (C,), E, D = a.sizes, a.ex.w_gate_up_ExDx2F.shape[0], a.x_TxD.shape[1]
  x_RxD = plans.expand(a.x_TxD, a.plan, K)
  R = x_RxD.shape[0]
  y_RxD = swiglu(x_RxD.reshape(R // (E * C), E, C, D), a.ex).reshape(R, D)
  w_Ax1 = a.weights_TxK.reshape(T * K, 1).astype(y_RxD.dtype)
  w_Rx1 = take_rows(w_Ax1, a.plan.assign_of_R, a.plan.row_of_A[:, None])
  return sum_rows(y_RxD * w_Rx1, a.plan.row_of_A.reshape(T, K), a.plan.token_of_R)
