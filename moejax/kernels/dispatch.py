"""Token dispatch to experts (docs/design.md §3): dropless and capacity modes, over the table
of expert kernels (`moejax.kernels.registry`).

Both modes build a plan (`moejax.kernels.plans`): each (token, slot) assignment's row in an
expert-sorted buffer, and back. A kernel runs the experts over the buffer and combines: it
gets `plans.KernelArgs` and returns y_TxD (a kernel that plans dropless dispatch itself,
`native`, gets the routing in them instead of a plan: `Kernel.plan`). Its module is imported
when the program is traced. `impl="auto"` is a lookup per platform (`registry.AUTO`),
resolved for the platform the program is lowered for, not the host's backend: the context
mesh's platform where it names one (the trainer's steps, an AOT target's; only that kernel is
traced), else `jax.lax.platform_dependent` over every platform's kernel, so an export for
`("cuda",)` from a CPU machine carries the GPU choice (`moejax.backend.platforms`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax import sharding
from moejax.backend import platforms
from moejax.errors import UserError, check_choice
from moejax.kernels import plans
from moejax.kernels.grouped import Blocks
from moejax.kernels.plans import ExpertWeights
from moejax.kernels.registry import (  # the table, re-exported: dispatch is the public face
  AUTO,
  IMPLS,
  KERNELS,
  MODES,
  PLATFORMS,
  Kernel,
  check_mode,
  check_runnable,
  export_disabled_checks,
  kernel_run,
  preload,
  resolve_impl,
  runnable,
)

KEY = "model.moe"  # error messages name the config keys
SECOND_EXPERT = ("all", "random")
EVAL_SECOND_EXPERT = ("same", "all")
__all__ = [
  "AUTO",
  "IMPLS",
  "KERNELS",
  "MODES",
  "PLATFORMS",
  "ExpertWeights",
  "Kernel",
  "capacity_dispatch",
  "check_group_size",
  "check_mode",
  "check_runnable",
  "dropless",
  "export_disabled_checks",
  "preload",
  "resolve_impl",
]


def _cast(ex: ExpertWeights, dtype) -> ExpertWeights:
  return ExpertWeights(*(jnp.asarray(w, dtype) for w in ex))


def _kernel_args(kernel: Kernel, block: int, x_TxD, experts_TxK, weights_TxK, ex, used_TxK):
  """The dropless `KernelArgs` the kernel takes (`Kernel.plan`): the routing alone, or
  rows planned here (`plans.dropless_plan`), contiguous or padded to block sizes."""
  if kernel.plan == "routing":
    return plans.KernelArgs(x_TxD, None, [], (), None, weights_TxK, ex, experts_TxK, used_TxK)
  T, K = experts_TxK.shape
  E = ex.w_down_ExFxD.shape[0]
  sizes = (1,) if kernel.plan == "rows" else plans.block_sizes(block, T * K, E)
  plan, blocks, counts_E = plans.dropless_plan(experts_TxK, E, sizes, used_TxK)
  return plans.KernelArgs(x_TxD, plan, blocks, sizes, counts_E, weights_TxK, ex)


@functools.cache
def _dropless_with(name: str, block: int, auto: bool) -> Callable:
  """dropless(x, experts, weights, ex, used) by one kernel (`auto`: or its fallback where it
  cannot run here), its module imported when this is called (traced); cached so that equal
  branches of `platform_dependent` are the same callable (it merges them)."""

  def run(*args):
    chosen = runnable(name) if auto else name
    kernel, kernel_fn = KERNELS[chosen], kernel_run(chosen)
    planned = lambda *a: kernel_fn(_kernel_args(kernel, block, *a))
    return (_per_device(planned) if kernel.per_device else planned)(*args)

  return run


def _per_device(run: Callable) -> Callable:
  """`run` on each device's own tokens (plan included), in a shard_map over the batch axes:
  a Mosaic kernel cannot be partitioned by GSPMD. Expert weights enter whole (P(): XLA
  gathers an FSDP-sharded weight first), as in MaxText's sparse matmul without expert
  parallelism."""

  def sharded(x_TxD, experts_TxK, weights_TxK, ex, used_TxK):
    axes = sharding.batch_axes(x_TxD.shape[0])
    if not axes:
      return run(x_TxD, experts_TxK, weights_TxK, ex, used_TxK)
    rows = P(axes)  # `used_TxK` may be None: a spec over an empty pytree
    in_specs = (rows, rows, rows, jax.tree.map(lambda _: P(), ex), rows)
    fn = jax.shard_map(run, in_specs=in_specs, out_specs=rows, check_vma=False)
    return fn(x_TxD, experts_TxK, weights_TxK, ex, used_TxK)

  return sharded


def dropless(
  x_TxD: jax.Array,
  experts_TxK: jax.Array,
  weights_TxK: jax.Array,
  ex: ExpertWeights,
  *,
  impl: str = "auto",
  block: int = 32,
  used_TxK: jax.Array | None = None,
) -> jax.Array:
  """Computes every assignment: sort by expert, run the kernel, unsort and combine.
  Assignments outside `used_TxK` (elastic-k training) are left out of the plan: they take
  no rows of any block, so fewer blocks run; their weights must be 0."""
  check_choice("impl", impl, IMPLS)
  check_mode(impl, "dropless")
  args = (x_TxD, experts_TxK, weights_TxK, _cast(ex, x_TxD.dtype), used_TxK)
  return _on_platform(impl, "dropless", functools.partial(_dropless_with, block=block), args)


def _on_platform(impl: str, mode: str, make: Callable[..., Callable], args: tuple):
  """make(impl, auto=False)(*args); for `auto`, the kernel of `AUTO[mode]` for the lowering
  platform (or its fallback)."""
  if impl != "auto":
    return make(impl, auto=False)(*args)
  branches = {p: make(n, auto=True) for p, n in AUTO[mode].items()}
  return platforms.platform_dependent(*args, **branches)


@functools.cache
def _capacity_with(name: str, cap: int, auto: bool) -> Callable:
  def run(x_TxD, plan, blocks, weights_TxK, ex):
    kernel_fn = kernel_run(runnable(name) if auto else name)
    return kernel_fn(plans.KernelArgs(x_TxD, plan, [blocks], (cap,), None, weights_TxK, ex))

  return run


def capacity_dispatch(
  x_TxD: jax.Array,
  experts_TxK: jax.Array,
  weights_TxK: jax.Array,
  ex: ExpertWeights,
  *,
  cap: int,
  group_size: int,
  order: plans.DropOrder,
  keep_TxK: jax.Array | None = None,
  impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
  """Capacity-limited dispatch; returns (y_TxD, kept_TxK). Buffer rows are laid out
  [group, expert, slot]: one block of `cap` rows per (group, expert)."""
  T, K = experts_TxK.shape
  check_group_size(group_size, T)
  check_mode(impl, "capacity")
  E = ex.w_down_ExFxD.shape[0]
  plan = plans.capacity_plan(experts_TxK, order, E, cap, group_size, keep_TxK)
  expert_N = jnp.tile(jnp.arange(E, dtype=jnp.int32), T // group_size)
  N = expert_N.shape[0]
  blocks = Blocks(jnp.arange(N, dtype=jnp.int32) * cap, expert_N, jnp.asarray(N, jnp.int32))
  args = (x_TxD, plan, blocks, weights_TxK, _cast(ex, x_TxD.dtype))
  y_TxD = _on_platform(impl, "capacity", functools.partial(_capacity_with, cap=cap), args)
  return y_TxD, plan.kept_A.reshape(T, K)


def check_group_size(group_size: int, n_tokens: int, of: str = "the local batch") -> None:
  """Capacity routing groups must tile the tokens of one call exactly (`of`: which call)."""
  if n_tokens % group_size:
    raise UserError(
      f"{KEY}.group_size={group_size} is not allowed; it must divide the {n_tokens} tokens of {of}"
    )
