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
