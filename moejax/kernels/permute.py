"""Row permutations whose backward pass is a gather with the inverse map, not a scatter-add.

Token dispatch moves rows between a token layout and an expert-sorted layout. Plain
indexing differentiates to a scatter-add, which is slow on CPU and nondeterministic on
GPU. Every map here is a partial bijection known in both directions, so the transpose is
itself a gather (summed over the K copies of a token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import residuals


def take_or_zero(x_NxD: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx] where idx == N selects a zero row (the sentinel for padding and drops)."""
  return jnp.take(x_NxD, idx, axis=0, mode="fill", fill_value=0)


def float0_like(a) -> np.ndarray:
  """The cotangent of an integer input."""
  return np.zeros(a.shape, jax.dtypes.float0)


def gather_sum(x_NxD: jax.Array, idx_MxJ: jax.Array) -> jax.Array:
  """out[m] = Σ_j x[idx[m, j]] (index N reads zeros), as J row gathers added in turn.

  Equal to take_or_zero(x, idx).sum(1) without building the [M, J, D] gather: XLA:CPU fuses
  the J gathers and adds into one loop, 1.8-2.6x faster over runs than gather-then-reduce
  at T = 2048, D = 128, J = K = 2 and 8 (`benchmarks/gather_sum.py`)."""
  out_MxD = take_or_zero(x_NxD, idx_MxJ[:, 0])
  for j in range(1, idx_MxJ.shape[1]):
    out_MxD = out_MxD + take_or_zero(x_NxD, idx_MxJ[:, j])
  return out_MxD


@jax.custom_vjp
def take_rows(x_NxD: jax.Array, src_M: jax.Array, dst_NxJ: jax.Array) -> jax.Array:
  """out[m] = x[src[m]] (zero if src[m] == N); `dst` is the inverse: the J rows of out
  that read each input row (M for none). The VJP is dx[n] = Σ_j g[dst[n, j]]."""
  return take_or_zero(x_NxD, src_M)


def _take_rows_fwd(x_NxD, src_M, dst_NxJ):
  return take_or_zero(x_NxD, src_M), residuals.named((src_M, dst_NxJ))


def _take_rows_bwd(res, g_MxD):
  src_M, dst_NxJ = res
  dx_NxD = gather_sum(g_MxD, dst_NxJ)
  return dx_NxD, float0_like(src_M), float0_like(dst_NxJ)


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def sum_rows(x_NxD: jax.Array, idx_MxJ: jax.Array, src_N: jax.Array) -> jax.Array:
  """out[m] = Σ_j x[idx[m, j]] (`gather_sum`) where each input row is read at most once;
  `src` is the inverse: the row of out that reads each input row (M for none). The VJP is
  the gather dx[n] = g[src[n]]."""
  return gather_sum(x_NxD, idx_MxJ)


def _sum_rows_fwd(x_NxD, idx_MxJ, src_N):
  return gather_sum(x_NxD, idx_MxJ), residuals.named((idx_MxJ, src_N))


def _sum_rows_bwd(res, g_MxD):
  idx_MxJ, src_N = res
  return take_or_zero(g_MxD, src_N), float0_like(idx_MxJ), float0_like(src_N)


sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)
