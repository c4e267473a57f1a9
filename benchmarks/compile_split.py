"""Where a CPU train step's compile goes: JAX's trace, its lowering and XLA's compile.

Run: python benchmarks/compile_split.py [--shape 64/8/32] [--repeats 3] [--impls auto,native]
                                        [--set KEY=VALUE ...] [--xla-spans]
The study shape (`study_shape.study_config`) once per MoE dispatch impl in `--impls`
(`model.moe.impl`) and its dense twin, in the config's layout. Each arm's step is built
fresh each repeat, traced under the run's mesh as the trainer traces it, and timed in three
parts, `jax.jit(step).trace(...)`, `.lower()` and `.compile()`; the min of each part over
`--repeats` (arms interleaved). `impl=auto` resolves for the mesh's platform
(`moejax.backend.platforms`), so the `auto` and `native` rows should trace alike. `--xla-spans`
compiles each arm once more under jax.profiler and adds where XLA's compile went: its HLO
passes, its backend, the backend's code generation and the number of fused kernels it
generated code for (`cpu_profile.compile_spans`). Writes
benchmarks/results/compile_split.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
import cpu_profile
from aot_compile_time import _set
from common import write_result
from study_shape import study_config
from train_step import dense_twin, step_and_args

PARTS = ("trace_s", "lower_s", "compile_s")


def lowered(c):
  """`c`'s train step, built fresh, traced and lowered."""
  _, fn, args = step_and_args(c)
  return jax.jit(fn).trace(*args).lower()


def parts(c) -> tuple[float, float, float]:
  """(trace, lower, XLA compile) seconds of `c`'s train step, built fresh."""
  _, fn, args = step_and_args(c)
  t0 = time.perf_counter()
  traced = jax.jit(fn).trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  return t1 - t0, t2 - t1, time.perf_counter() - t2


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", default="64/8/32", help="E/K/f")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--impls", default="auto,native", help="model.moe.impl of each MoE arm")
  p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--result", default="compile_split", help="benchmarks/results/<NAME>.json")
  p.add_argument("--xla-spans", action="store_true", help="XLA:CPU's compile phases per arm")
  args = p.parse_args()
  c = study_config(*(int(v) for v in args.shape.split("/")))
  for assignment in args.set:
    _set(c, assignment)
  arms = {}
  for impl in args.impls.split(","):
    arms[f"moe/{impl}"] = c.copy_and_resolve_references()
    arms[f"moe/{impl}"].model.moe.impl = impl
  arms["dense"] = dense_twin(c)
  parts(arms["dense"])  # the process's one-time costs land on no arm
  best = {name: [float("inf")] * len(PARTS) for name in arms}
  for _ in range(args.repeats):
    for name, a in arms.items():
      best[name] = [min(b, t) for b, t in zip(best[name], parts(a))]
  m = c.model
  print(
    f"backend={jax.default_backend()} shape E/K/f={args.shape} scan={m.scan_layers}/{m.scan_unroll}"
  )
  print("| arm | trace s | lower s | compile s | total s | total over dense |")
  print("|---|---:|---:|---:|---:|---:|")
  dense_total = sum(best["dense"])
  rows = []
  for name, b in best.items():
    row = {"arm": name, **dict(zip(PARTS, b)), "total_s": sum(b)}
    row["total_over_dense"] = row["total_s"] / dense_total
    print("| " + " | ".join([name, *(f"{v:.2f}" for v in list(row.values())[1:])]) + " |")
    rows.append(row)
  if args.xla_spans:
    for row in rows:
      row.update(cpu_profile.compile_spans(lowered(arms[row["arm"]]).compile))
      print(row["arm"], {k: row[k] for k in (*cpu_profile.COMPILE_SPANS, "fused_kernels")})
  shape = {"E/K/f": args.shape, "layers": m.n_layers, "scan_layers": m.scan_layers}
  shape["scan_unroll"] = m.scan_unroll
  write_result(args.result, {"rows": rows, **shape, "repeats": args.repeats})


if __name__ == "__main__":
  main()
