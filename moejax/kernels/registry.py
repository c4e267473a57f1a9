"""The expert-kernel table (`KERNELS`, `model.moe.impl`) and the choice of a kernel by name.

A kernel is one function, `run(plans.KernelArgs) -> y_TxD`, in its own module. The table names
how to import it (`Kernel.load`), not the function: a kernel's module and its library (the
native `.so`, tokamax, the Pallas megablox kernel) are imported when a program that uses it
is traced, so importing the model imports none of them. `impl="auto"` is a lookup per
platform (`AUTO`); where that kernel cannot run here (`Kernel.missing`), auto takes its
`FALLBACK` and logs one line. A kernel named explicitly that cannot run here is a one-line
`UserError` naming `model.moe.impl`, what is missing and what to use instead: at the config
check (`check_runnable`) and when traced (`kernel_run`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax

from moejax.errors import UserError, check_choice

log = logging.getLogger(__name__)
KEY = "model.moe.impl"
MODES = ("dropless", "capacity")
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# What a kernel's `KernelArgs` hold in dropless mode (capacity mode always gives the plan):
# rows padded to the block sizes (block loops), rows contiguous per expert (`counts_E`:
# grouped matmuls), or only the routing (`experts_TxK`, `used_TxK`: the kernel plans inside).
PLANS = ("blocks", "rows", "routing")
CUDA_EXTRA = "pip install 'moejax[cuda]'"


def _nothing_missing() -> str | None:
  return None


def module_missing(module: str, extra: str = CUDA_EXTRA) -> str | None:
  """'X is not installed (...)' when the module `module` cannot be found, else None; found,
  not imported."""
  if importlib.util.find_spec(module) is None:
    return f"{module} is not installed (it comes with the cuda extra: {extra})"
  return None


def _native_missing() -> str | None:
  from moejax.kernels.native import loader

  return loader.missing()


def _load_fused():
  from moejax.kernels import fused

  return fused.run


def _load_native():
  from moejax.kernels.native import kernel

  return kernel.run


def _load_blocked():
  from moejax.kernels import blocked

  return blocked.run


def _load_ragged():
  from moejax.kernels import ragged

  return ragged.run


def _load_megablox():
  from moejax.kernels import megablox

  return megablox.run


def _load_tokamax():
  from moejax.kernels import tokamax_ragged

  return tokamax_ragged.run


def _load_batched():
  from moejax.kernels import batched

  return batched.run


class Kernel(NamedTuple):
  """One expert kernel: `load()` imports its module and returns its `run(KernelArgs) -> y_TxD`."""

  load: Callable[[], Callable]
  backends: tuple[str, ...]  # platforms it is meant for (others may run it, slowly)
  modes: tuple[str, ...]  # dispatch modes it serves
  plan: str  # what it is given in dropless mode (`PLANS`)
  description: str
  per_device: bool = False  # opaque to GSPMD (a Mosaic kernel): run in a shard_map
  missing: Callable[[], str | None] = _nothing_missing  # what it lacks here; None: it runs


KERNELS: dict[str, Kernel] = {
  "fused": Kernel(
    _load_fused,
    PLATFORMS,
    MODES,
    "blocks",
    "exact block loop, gather + grouped SwiGLU + combine in one custom VJP; O(rows) anywhere",
  ),
  "native": Kernel(
    _load_native,
    ("cpu",),
    MODES,
    "routing",
    "C++ FFI custom call: per-expert OpenBLAS GEMMs on XLA's CPU thread pool, custom VJP, "
    "the dropless plan built inside the call",
    missing=_native_missing,
  ),
  "blocked": Kernel(
    _load_blocked, PLATFORMS, MODES, "blocks", "the same block loop unfused (autodiff)"
  ),
  "ragged": Kernel(
    _load_ragged,
    ("tpu",),
    ("dropless",),
    "rows",
    "jax.lax.ragged_dot: native on TPU; densified over all E groups on CPU and NVIDIA GPU",
  ),
  "megablox": Kernel(
    _load_megablox,
    ("tpu",),
    ("dropless",),
    "rows",
    "Pallas TPU grouped matmul gmm/tgmm (MaxText's default); interpret mode elsewhere",
    per_device=True,
  ),
  "tokamax": Kernel(
    _load_tokamax,
    ("cuda",),
    ("dropless",),
    "rows",
    "tokamax.ragged_dot: Mosaic GPU (sm90+) or Triton kernels, fwd/dx/dW; jax ragged_dot elsewhere",
    per_device=True,
    missing=functools.partial(module_missing, "tokamax"),
  ),
  "batched": Kernel(
    _load_batched,
    PLATFORMS,
    ("capacity",),
    "blocks",
    "capacity buffer [group, E, C, D] as one batched einsum per projection; no loop",
  ),
}
IMPLS = ("auto", *KERNELS)

# `auto` per mode and platform: CUDA `tokamax` (dropless) and `batched` (capacity), the
# kernels that compile with no per-block while loop; TPU `megablox`, whose kernel follows the
# lowering platform (so a CPU host's AOT compile is what the TPU runs); CPU `native`; ROCm and
# the rest `fused`. The compile figures behind it (not device timings) are in
# docs/performance.md, from benchmarks/gpu_kernels_compile.py, tpu_ragged_dot.py.
AUTO: dict[str, dict[str, str]] = {
  "dropless": {"cpu": "native", "cuda": "tokamax", "rocm": "fused", "tpu": "megablox"},
  "capacity": {"cpu": "native", "cuda": "batched", "rocm": "fused", "tpu": "fused"},
}
# What `auto` runs where its kernel cannot run here: `native` not built, tokamax not installed.
FALLBACK = {"native": "fused", "tokamax": "fused"}


@functools.cache
def _fell_back(name: str, reason: str) -> str:
  fallback = FALLBACK[name]
  log.warning("%s=auto: the %s kernel cannot run here (%s); using %s", KEY, name, reason, fallback)
  return fallback


def runnable(name: str) -> str:
  """`name`, or its `FALLBACK` where it cannot run here (one log line, once)."""
  reason = KERNELS[name].missing() if name in FALLBACK else None
  return name if reason is None else _fell_back(name, reason)


@functools.cache
def preload(impl: str, mode: str, lowerings: tuple[str, ...] | None = None) -> None:
  """Imports now, outside any trace, every kernel `impl` can take in `mode` on the platforms
  the model will be lowered for (`lowerings`: `platforms.context_platforms()`, the context
  mesh's; None, no mesh: any platform; `auto`: each such `AUTO` entry that can run here), so
  a CPU training process imports no GPU or TPU kernel library (tokamax: 1.9 s). A kernel's library can change JAX's trace
  context when imported (tokamax registers a `jax.make_user_context`); imported inside a
  program's first trace (a `platform_dependent` branch), that left the program's jit cache
  entry stale, so its second call traced and compiled it again. The model's MoE blocks call
  this when built, before anything is traced. A library that fails to import is left to the
  trace that needs it, whose `kernel_run` reports it as before."""
  if impl != "auto":
    names = (impl,)
  elif lowerings is None:
    names = tuple(AUTO[mode].values())
  else:
    names = tuple(AUTO[mode][p] for p in lowerings if p in AUTO[mode])
  for name in dict.fromkeys(names):
    if KERNELS[name].missing() is None:
      with contextlib.suppress(ImportError):
        KERNELS[name].load()


def resolve_impl(impl: str, mode: str = "dropless", platform: str | None = None) -> str:
  """The kernel `impl` runs on `platform` (default: this host's backend): `auto`'s entry of
  `AUTO`, or its fallback where that cannot run here."""
  check_choice(KEY, impl, IMPLS)
  if impl != "auto":
    return impl
  return runnable(AUTO[mode][platform or jax.default_backend()])


def unavailable(name: str, reason: str) -> str:
  """The one line for a kernel named explicitly that cannot run here."""
  instead = FALLBACK.get(name, "fused")
  return f"{KEY}={name!r} cannot run here: {reason}; use {KEY}=auto or {instead!r}"


def check_mode(impl: str, mode: str) -> None:
  """A kernel that cannot serve the dispatch mode is refused (`capacity` with `ragged`)."""
  if impl != "auto" and mode not in KERNELS[impl].modes:
    serving = ", ".join(n for n, k in KERNELS.items() if mode in k.modes)
    raise UserError(
      f"impl={impl!r} is not allowed with dispatch={mode!r}; use auto or one of {serving}"
    )


def check_runnable(impl: str) -> None:
  """A UserError (`unavailable`) when the kernel named explicitly cannot run here; `auto`
  always can (its fallbacks)."""
  if impl != "auto" and (reason := KERNELS[impl].missing()) is not None:
    raise UserError(unavailable(impl, reason))


def kernel_run(name: str) -> Callable:
  """The kernel's `run`, its module (and library) imported now; refused as `check_runnable`."""
  check_runnable(name)
  return KERNELS[name].load()


def export_disabled_checks() -> tuple:
  """What `jax.export` needs to serialize a program holding the GPU kernels' Triton and
  Mosaic custom calls (tokamax's list; none without tokamax, whose kernels it then lacks)."""
  if module_missing("tokamax") is not None:
    return ()
  from moejax.kernels import tokamax_ragged

  return tokamax_ragged.EXPORT_DISABLED_CHECKS
