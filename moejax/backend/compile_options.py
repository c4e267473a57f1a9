"""The XLA options moejax compiles its programs with, per platform (docs/performance.md).

`options(platform)` are `compiler_options` (XLA `DebugOptions` fields by name) for every
program moejax compiles for that platform: the trainer's jitted steps and the grid's
forwards on the backend they run on, and `moejax.aot`'s compile-only targets, so that
`describe` and the sweep precheck compile what the run will. An option the user names in
XLA_FLAGS is left to XLA_FLAGS (a jit's options would override it).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax

OPTIONS: dict[str, dict[str, bool | int | str]] = {
  # A scan's stacked outputs (the layer loop's residuals, the backward's stacked gradients)
  # are zero-initialized by JAX (`_empty_array` in jax/_src/lax/control_flow/loops.py). This
  # XLA:GPU pass, off by default, hands such a buffer over uninitialized when every trip of
  # the loop overwrites its row (openxla/xla, dus_accumulator_zero_init_elimination.cc), so
  # a scanned step no longer zero-fills its stacked residuals every step (the bytes:
  # `benchmarks/aot_compile_time.py --hlo-stats`, docs/performance.md). XLA:TPU does it by
  # default; XLA:CPU has no such pass.
  "gpu": {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True},
}
# jax's platform names for what OPTIONS keys by backend (jax.default_backend() says "gpu")
PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


def options(platform: str) -> dict[str, bool | int | str]:
  """The options for `platform` ("cpu", "gpu", "cuda", "rocm", "tpu"), less those XLA_FLAGS
  sets."""
  flags = os.environ.get("XLA_FLAGS", "")
  chosen = OPTIONS.get(PLATFORMS.get(platform, platform), {})
  return {name: v for name, v in chosen.items() if f"--{name}=" not in flags}


def jit(fn: Callable, **kwargs):
  """`jax.jit(fn, **kwargs)` with the options of the backend this process runs on."""
  return jax.jit(fn, compiler_options=options(jax.default_backend()) or None, **kwargs)
