"""Where an XLA:CPU program's time goes: thread time by kind of op, from jax.profiler.

XLA:CPU records one TraceMe per executed op (thunk) when XLA_FLAGS has
`--xla_cpu_enable_xprof_traceme=true` (`enable()` adds it; it must run before the CPU
backend starts). `op_ms(fn, steps)` traces `steps` calls of a compiled step and returns the
thread milliseconds per step of each kind of op (`KINDS`, by the op's HLO name), summed over
XLA's worker threads: the kinds a layer scan adds (the zero-filled stacked outputs, the
dynamic slices and updates of the stacked arrays, the loop itself) show beside the work.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from collections.abc import Callable

import jax

FLAG = "--xla_cpu_enable_xprof_traceme=true"

# kind -> a regex on the HLO op's name (the first that matches wins; fusions are named after
# their ops, e.g. `dynamic-slice_bitcast_fusion.11`)
KINDS = {
  "kernel (ffi_call)": r"^ffi_call|^custom-call",
  "matmul": r"^ynn_fusion|^dot|^onednn|convolution",
  "zero fill (broadcast)": r"^wrapped_broadcast",
  "dynamic-update-slice": r"dynamic-update-slice",
  "dynamic-slice": r"dynamic-slice",
  "copy/transpose": r"copy|transpose",
  "while loop": r"^while",
  "other fusion": r"fusion",
}
OTHER = "other op"


def enable() -> None:
  """Adds XLA:CPU's per-op TraceMe to XLA_FLAGS (before the CPU backend starts)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


def kind(op_name: str) -> str:
  return next((k for k, rx in KINDS.items() if re.search(rx, op_name)), OTHER)


def _events(path: str):
  """(thread line name, event name, duration ns) of every event in the trace under `path`."""
  (pb,) = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
  for plane in jax.profiler.ProfileData.from_file(pb).planes:
    for line in plane.lines:
      for ev in line.events:
        yield line.name, ev.name, ev.duration_ns


def op_ms(fn: Callable[[], object], steps: int = 3) -> dict[str, float]:
  """Thread ms per call of `fn` by kind of op (XLA's threads, without the executor's own
  spans), after one warm-up call."""
  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        jax.block_until_ready(fn())
    out = collections.Counter()
    for line, name, ns in _events(d):
      if line.startswith("tf_") and not name.startswith(("ThunkExecutor", "Slinky")):
        out[kind(name)] += ns / 1e6 / steps
  return dict(out)


# XLA:CPU's compile phases as its TraceMe spans on the compiling thread name them (the
# caller's thread on jax 0.11, a PjRt compiler thread on 0.10), by the start of the name:
# its HLO passes, its backend, and within the backend the code generation of the kernels; a
# fused kernel's codegen is one `FusionCompiler::Compile` span on XLA's codegen threads.
COMPILE_SPANS = {
  "hlo_passes_ms": ("HLO passes through layout assignment", "HLO passes after layout assignment"),
  "backend_ms": ("CpuCompiler::RunBackend",),
  "codegen_ms": ("Codegen",),
}
KERNEL_SPAN = "FusionCompiler::Compile"


def compile_spans(compile_fn: Callable[[], object]) -> dict[str, float | int | None]:
  """ms of each `COMPILE_SPANS` phase of one call of `compile_fn` (an XLA:CPU compile) and
  `fused_kernels`, the kernels it generated code for; None for a phase this XLA does not
  record."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      compile_fn()
    events = list(_events(d))
  out: dict[str, float | int | None] = {}
  for field, starts in COMPILE_SPANS.items():
    spans = [ns for _, name, ns in events if name.startswith(starts)]
    out[field] = sum(spans) / 1e6 if spans else None
  out["fused_kernels"] = sum(1 for _, name, _ in events if name == KERNEL_SPAN)
  return out
