"""Token dispatch to experts (docs/design.md §3): dropless and capacity modes, over a table of
expert kernels.

Both modes build a plan (`moejax.kernels.plans`): each (token, slot) assignment's row in an
expert-sorted buffer, and back. A kernel in `KERNELS` runs the experts over the buffer and
combines: it gets `plans.KernelArgs` and returns y_TxD (a kernel that plans dropless
dispatch itself, `native`, takes the routing instead: `Kernel.dropless`). Adding an impl is
one entry here plus its file. `impl="auto"` is a lookup per platform (`AUTO`), resolved for
the platform the program is lowered for, not the host's backend: the context mesh's
platform where it names one (the trainer's steps, an AOT target's; only that kernel is
traced), else `jax.lax.platform_dependent` over every platform's kernel, so an export for
`("cuda",)` from a CPU machine carries the GPU choice (`moejax.platforms`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax import platforms, sharding
from moejax.errors import UserError, check_choice
from moejax.kernels import batched, blocked, fused, megablox, plans, ragged, tokamax_ragged
from moejax.kernels.grouped import Blocks
from moejax.kernels.native import kernel as native
from moejax.kernels.native import loader as native_loader
from moejax.kernels.plans import ExpertWeights

KEY = "model.moe"  # error messages name the config keys
MODES = ("dropless", "capacity")
SECOND_EXPERT = ("all", "random")
EVAL_SECOND_EXPERT = ("same", "all")
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


class Kernel(NamedTuple):
  """One expert kernel: `run(plans.KernelArgs) -> y_TxD`."""

  run: Callable[[plans.KernelArgs], jax.Array]
  backends: tuple[str, ...]  # platforms it is meant for (others may run it, slowly)
  modes: tuple[str, ...]  # dispatch modes it serves
  contiguous: bool  # rows contiguous per expert (counts_E), not padded to blocks
  description: str
  per_device: bool = False  # opaque to GSPMD (a Mosaic kernel): run in a shard_map
  # dropless on the routing itself, (x, experts, weights, ex, used) -> y, the kernel planning
  # inside; None: `plans.dropless_plan` here, then `run`
  dropless: Callable | None = None


KERNELS: dict[str, Kernel] = {
  "fused": Kernel(
    fused.run,
    PLATFORMS,
    MODES,
    False,
    "exact block loop, gather + grouped SwiGLU + combine in one custom VJP; O(rows) anywhere",
  ),
  "native": Kernel(
    native.run,
    ("cpu",),
    MODES,
    True,
    "C++ FFI custom call: per-expert OpenBLAS GEMMs on XLA's CPU thread pool, custom VJP, "
    "the dropless plan built inside the call; fused where not built",
    dropless=native.run_dropless if native_loader.available() else None,
  ),
  "blocked": Kernel(blocked.run, PLATFORMS, MODES, False, "the same block loop unfused (autodiff)"),
  "ragged": Kernel(
    ragged.run,
    ("tpu",),
    ("dropless",),
    True,
    "jax.lax.ragged_dot: native on TPU; densified over all E groups on CPU and NVIDIA GPU",
  ),
  "megablox": Kernel(
    megablox.run,
    ("tpu",),
    ("dropless",),
    True,
    "Pallas TPU grouped matmul gmm/tgmm (MaxText's default); interpret mode elsewhere",
    per_device=True,
  ),
  "tokamax": Kernel(
    tokamax_ragged.run,
    ("cuda",),
    ("dropless",),
    True,
    "tokamax.ragged_dot: Mosaic GPU (sm90+) or Triton kernels, fwd/dx/dW; jax ragged_dot elsewhere",
    per_device=True,
  ),
  "batched": Kernel(
    batched.run,
    PLATFORMS,
    ("capacity",),
    False,
    "capacity buffer [group, E, C, D] as one batched einsum per projection; no loop",
  ),
}
IMPLS = ("auto", *KERNELS)
# What `jax.export` needs to serialize a program holding these kernels (the GPU ones' Triton
# and Mosaic custom calls): `jax.export.export(fn, platforms=..., disabled_checks=...)`.
EXPORT_DISABLED_CHECKS = tokamax_ragged.EXPORT_DISABLED_CHECKS

# `auto` per mode and platform: CUDA `tokamax` (dropless) and `batched` (capacity), the
# kernels that compile with no per-block while loop; TPU `megablox`, whose kernel follows the
# lowering platform (so a CPU host's AOT compile is what the TPU runs); CPU `native` where
# built, else `fused`; ROCm and the rest `fused`. The compile figures behind it (not device
# timings) are in docs/performance.md, from benchmarks/gpu_kernels_compile.py, tpu_ragged_dot.py.
CPU_AUTO = "native" if native_loader.available() else "fused"
AUTO: dict[str, dict[str, str]] = {
  "dropless": {"cpu": CPU_AUTO, "cuda": "tokamax", "rocm": "fused", "tpu": "megablox"},
  "capacity": {"cpu": CPU_AUTO, "cuda": "batched", "rocm": "fused", "tpu": "fused"},
}


def resolve_impl(impl: str, mode: str = "dropless", platform: str | None = None) -> str:
  """The kernel `impl` names on `platform` (default: this host's backend)."""
  check_choice("impl", impl, IMPLS)
  if impl != "auto":
    return impl
  return AUTO[mode][platform or jax.default_backend()]


def _cast(ex: ExpertWeights, dtype) -> ExpertWeights:
  return ExpertWeights(*(jnp.asarray(w, dtype) for w in ex))


@functools.cache
def _dropless_with(name: str, block: int) -> Callable:
  """dropless(x, experts, weights, ex, used) by one kernel, planned here (`plans.dropless_plan`)
  unless the kernel plans inside (`Kernel.dropless`); cached so that equal branches of
  `platform_dependent` are the same callable (it merges them)."""
  kernel = KERNELS[name]

  def planned(x_TxD, experts_TxK, weights_TxK, ex, used_TxK):
    T, K = experts_TxK.shape
    E = ex.w_gate_up_ExDx2F.shape[0]
    sizes = (1,) if kernel.contiguous else plans.block_sizes(block, T * K, E)
    plan, blocks, counts_E = plans.dropless_plan(experts_TxK, E, sizes, used_TxK)
    args = plans.KernelArgs(x_TxD, plan, blocks, sizes, counts_E, weights_TxK, ex)
    return kernel.run(args)

  run = kernel.dropless or planned
  return _per_device(run) if kernel.per_device else run


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
  args = (x_TxD, experts_TxK, weights_TxK, _cast(ex, x_TxD.dtype), used_TxK)
  return _on_platform(impl, "dropless", functools.partial(_dropless_with, block=block), args)


def _on_platform(impl: str, mode: str, make: Callable[[str], Callable], args: tuple):
  """make(impl)(*args); for `auto`, the kernel of `AUTO[mode]` for the lowering platform."""
  if impl != "auto":
    return make(impl)(*args)
  return platforms.platform_dependent(*args, **{p: make(n) for p, n in AUTO[mode].items()})


@functools.cache
def _capacity_with(name: str, cap: int) -> Callable:
  def run(x_TxD, plan, blocks, weights_TxK, ex):
    return KERNELS[name].run(plans.KernelArgs(x_TxD, plan, [blocks], (cap,), None, weights_TxK, ex))

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
  E = ex.w_gate_up_ExDx2F.shape[0]
  plan = plans.capacity_plan(experts_TxK, order, E, cap, group_size, keep_TxK)
  expert_N = jnp.tile(jnp.arange(E, dtype=jnp.int32), T // group_size)
  N = expert_N.shape[0]
  blocks = Blocks(jnp.arange(N, dtype=jnp.int32) * cap, expert_N, jnp.asarray(N, jnp.int32))
  args = (x_TxD, plan, blocks, weights_TxK, _cast(ex, x_TxD.dtype))
  y_TxD = _on_platform(impl, "capacity", functools.partial(_capacity_with, cap=cap), args)
  return y_TxD, plan.kept_A.reshape(T, K)


def check_mode(impl: str, mode: str) -> None:
  """A kernel that cannot serve the dispatch mode is refused (`capacity` with `ragged`)."""
  if impl != "auto" and mode not in KERNELS[impl].modes:
    serving = ", ".join(n for n, k in KERNELS.items() if mode in k.modes)
    raise UserError(
      f"impl={impl!r} is not allowed with dispatch={mode!r}; use auto or one of {serving}"
    )


def describe_kernels() -> list[str]:
  """One line per kernel: name, backends, modes, description (`moejax.describe`)."""
  return [
    f"{name}: {'/'.join(k.backends)}; {'/'.join(k.modes)}; {k.description}"
    for name, k in KERNELS.items()
  ]


class DispatchFields(Protocol):
  """The dispatch fields of `nn.moe.MoEConfig` that `validate_dispatch` checks."""

  dispatch: str
  drop_policy: str
  second_expert: str
  eval_second_expert: str
  impl: str
  capacity_factor: float
  eval_capacity_factor: float
  min_capacity: int
  group_size: int | None


def validate_dispatch(cfg: DispatchFields, n_tokens: int | None = None) -> None:
  """Raises `UserError` naming the `model.moe` dispatch key that is out of range (and a
  group size that does not tile the `n_tokens` of a call)."""
  if cfg.drop_policy in plans.RENAMED_DROP_POLICIES:
    raise UserError(plans.RENAMED_DROP_POLICIES[cfg.drop_policy])
  for field, allowed in (
    ("dispatch", MODES),
    ("drop_policy", plans.DROP_POLICIES),
    ("second_expert", SECOND_EXPERT),
    ("eval_second_expert", EVAL_SECOND_EXPERT),
    ("impl", IMPLS),
  ):
    check_choice(f"{KEY}.{field}", getattr(cfg, field), allowed)
  check_mode(cfg.impl, cfg.dispatch)
  for field in ("capacity_factor", "eval_capacity_factor"):
    if not getattr(cfg, field) > 0:
      raise UserError(f"{KEY}.{field}={getattr(cfg, field)} is not allowed; use a float > 0")
  if cfg.min_capacity < 0:
    raise UserError(f"{KEY}.min_capacity={cfg.min_capacity} is not allowed; use an int >= 0")
  if cfg.group_size is not None and cfg.group_size < 1:
    raise UserError(
      f"{KEY}.group_size={cfg.group_size} is not allowed; use an int >= 1 or 0 (all tokens)"
    )
  if cfg.group_size is not None and n_tokens is not None:
    check_group_size(cfg.group_size, n_tokens)


def check_group_size(group_size: int, n_tokens: int) -> None:
  """Capacity routing groups must tile the tokens of one call exactly."""
  if n_tokens % group_size:
    raise UserError(
      f"{KEY}.group_size={group_size} is not allowed; it must divide the "
      f"{n_tokens} tokens of the local batch"
    )
