"""The `native` kernel on `plans.KernelArgs`: a plan's rows (capacity mode), or in dropless
mode the routing itself (`run_dropless`: the plan is built inside the FFI calls). The library
is loaded when this is traced; where it cannot load, one UserError line
(`loader.require`; `auto` runs `fused` instead)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import plans
from moejax.kernels.native import dropless, loader, ops
from moejax.kernels.permute import take_rows


def expert_of_rows(a: plans.KernelArgs, R: int) -> jax.Array:
  """Each buffer row's expert: dropless rows are contiguous per expert from row 0
  (`counts_E`); capacity rows are blocks of C rows, one per (group, expert)."""
  if a.counts_E is not None:
    ends_E = jnp.cumsum(a.counts_E.astype(jnp.int32))
    e_R = jnp.searchsorted(ends_E, jnp.arange(R, dtype=jnp.int32), side="right")
    return jnp.minimum(e_R, a.counts_E.shape[0] - 1).astype(jnp.int32)
  (C,), blk = a.sizes, a.blocks[0]
  return jnp.repeat(blk.expert_N.astype(jnp.int32), C, total_repeat_length=R)


def run(a: plans.KernelArgs) -> jax.Array:
  """Each row's combine weight gathered from its assignment (as `fused`), then one custom
  VJP over the FFI calls; dropless (no plan) by `run_dropless`."""
  loader.require()  # the library loaded (its FFI targets registered), else one UserError line
  if a.plan is None:
    return run_dropless(a.x_TxD, a.experts_TxK, a.weights_TxK, a.ex, a.used_TxK)
  T, K = a.weights_TxK.shape
  w_Ax1 = a.weights_TxK.reshape(T * K, 1).astype(a.x_TxD.dtype)
  w_R = take_rows(w_Ax1, a.plan.assign_of_R, a.plan.row_of_A[:, None])[:, 0]
  tok_R, row_TxK = a.plan.token_of_R, a.plan.row_of_A.reshape(T, K)
  e_R = expert_of_rows(a, tok_R.shape[0])
  args = (a.x_TxD, w_R, tok_R, e_R, row_TxK, *a.ex)
  ops.check(*args)
  return ops.swiglu_combine(*args)


def run_dropless(x_TxD, experts_TxK, weights_TxK, ex: plans.ExpertWeights, used_TxK=None):
  """Dropless y_TxD from the routing: the FFI calls plan it (`native.dropless`); assignments
  outside `used_TxK` are passed as expert E (no row)."""
  E = ex.w_down_ExFxD.shape[0]
  e_TxK = jnp.asarray(experts_TxK, jnp.int32)
  if used_TxK is not None:
    e_TxK = jnp.where(used_TxK, e_TxK, E)
  args = (x_TxD, weights_TxK.astype(x_TxD.dtype), e_TxK, *ex)
  dropless.check(*args)
  return dropless.swiglu_combine(*args)
