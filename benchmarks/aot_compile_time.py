"""How long one train step takes to lower and to compile ahead of time for a target, and the
compiler's bytes per device: what one program costs the sweep precheck (launch/precheck.py).

  JAX_PLATFORMS=cpu python benchmarks/aot_compile_time.py --config configs/study_calibration.py:tpu \
      --topology v5e:4x4 [--set model.n_layers=2 ...]
  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/aot_compile_time.py \
      --config configs/study_calibration.py:gpu --gpu h100:8

Prints CPU seconds and wall seconds of each phase (CPU above wall: the compiler's threads).
`--layouts scanned,unrolled` compiles the program once per `model.scan_layers` value, in this
one process, and prints the compile ratio scanned/unrolled; `--depths 8,32` compiles it at
each `model.n_layers` (the ratio of the two). Each compile takes the target's XLA options
(`moejax.backend.compile_options`, as `describe` and the precheck compile); `--xla-defaults` drops
them. `--hlo-stats` (with `--gpu`) adds what each compiled step does per step, read from its
optimized HLO (kernels launched, while loops, dynamic-update-slice fusions, elementwise
fusions' bytes, zero fills: `hlo_stats.py`). `--grid-forward` also traces, lowers and compiles
the k-grid's forward (`programs.grid_forward`, one k1 with an integer k2, as `moejax.evaluate`
runs it on one device) and prints its CPU seconds against the train step's lower + compile:
the ratio the device study's plan scales a train-step compile by for each grid forward
(`experiments/calibration/device_figures.py`, which also scales the H200's measured compile
by two such runs' lower + compile seconds, at two shapes). Writes
benchmarks/results/aot_compile_time_<target>.json, e.g. aot_compile_time_v5e_4x4.json
(`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from moejax.config import resolve
from moejax import aot, cli
from moejax.aot import programs

sys.path.insert(0, os.path.dirname(__file__))
import hlo_stats
from common import write_result


def _set(c, assignment: str) -> None:
  key, _, text = assignment.partition("=")
  *path, last = key.split(".")
  node = c
  for part in path:
    node = node[part]
  old = node[last]
  node[last] = (text == "True") if isinstance(old, bool) else type(old)(text)


def _timed(fn):
  cpu, wall = time.process_time(), time.perf_counter()
  out = fn()
  return out, time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--topology", default="", help="a TPU topology, e.g. v5e:4x4")
  p.add_argument("--gpu", default="", help="GPU nodes, e.g. h100:8")
  p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument(
    "--layouts", default="", help="scanned,unrolled: compile each model.scan_layers value"
  )
  p.add_argument(
    "--depths", default="", help="8,32: compile at each model.n_layers (after --layouts)"
  )
  p.add_argument(
    "--hlo-stats",
    action="store_true",
    help="--gpu only: each program's kernels, loops and bytes per step (hlo_stats.py)",
  )
  p.add_argument(
    "--xla-defaults",
    action="store_true",
    help="compile without moejax's XLA options for the target (moejax.backend.compile_options)",
  )
  p.add_argument(
    "--grid-forward",
    action="store_true",
    help="also compile the k-grid's forward on one device (its seconds over the train step's)",
  )
  p.add_argument("--result", default="", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  if args.hlo_stats and not args.gpu:
    p.error("--hlo-stats reads XLA:GPU's fusion names and trip counts; use it with --gpu")
  c = cli.load_file(args.config)
  for assignment in args.set:
    _set(c, assignment)
  target = aot.tpu_target(args.topology) if args.topology else aot.gpu_target(args.gpu)
  if args.xla_defaults:
    target = target._replace(compiler_options=())
  layouts = [v for v in args.layouts.split(",") if v]
  figures = {"config": args.config, "target": target.name, "set": " ".join(args.set)}
  figures["compiler_options"] = " ".join(f"{k}={v}" for k, v in target.compiler_options) or "-"
  depths = [int(v) for v in args.depths.split(",") if v]
  rows = []
  for layout in layouts or [""]:
    for depth in depths or [c.model.n_layers]:
      if layout:
        c.model.scan_layers = {"scanned": True, "unrolled": False}[layout]
      c.model.n_layers = depth
      scan = "scanned" if c.model.scan_layers else "unrolled"
      print(f"[{scan}, {depth} layers]")
      rows.append({"layout": scan, "n_layers": depth, **measure(c, target, args)})
  if len(rows) == 2:
    (a, ra), (b, rb) = (
      (f"{r['layout']}_{r['n_layers']}" if depths else r["layout"], r["compile_cpu_s"])
      for r in rows
    )
    print(f"compile CPU-s {a}/{b}: {ra / rb:.2f}")
    figures[f"compile_cpu_{a}_over_{b}"] = ra / rb
  name = args.result or f"aot_compile_time_{target.name.replace(':', '_')}"
  write_result(name, {"rows": rows, **figures})


def measure(c, target, args) -> dict:
  """Lowers and compiles the train step of `c` for `target`; prints and returns its figures."""

  def lower():  # traced as `describe` and the precheck trace it (`programs.footprint`)
    return programs.lower_train_step(programs.abstract_run(resolve(c), target), target)

  lowered, lower_cpu, lower_wall = _timed(lower)
  compiled, compile_cpu, compile_wall = _timed(lambda: target.compile(lowered))
  ma = compiled.memory_analysis()
  print(f"{args.config} on {target.name} {' '.join(args.set)}")
  print(f"  lower:   {lower_cpu:6.1f} CPU-s {lower_wall:6.1f} s")
  print(f"  compile: {compile_cpu:6.1f} CPU-s {compile_wall:6.1f} s")
  print(
    f"  per device: temporaries {ma.temp_size_in_bytes / 2**30:.3f} GiB, "
    f"arguments {ma.argument_size_in_bytes / 2**30:.3f} GiB"
  )
  row = {
    "lower_cpu_s": lower_cpu, "lower_s": lower_wall, "compile_cpu_s": compile_cpu,
    "compile_s": compile_wall, "temporaries_GiB": ma.temp_size_in_bytes / 2**30,
    "arguments_GiB": ma.argument_size_in_bytes / 2**30,
  }  # fmt: skip
  if args.grid_forward:
    fwd, fwd_cpu, fwd_wall = _timed(lambda: programs.grid_forward(resolve(c), target))
    fwd_temp = fwd.memory_analysis().temp_size_in_bytes / 2**30
    ratio = fwd_cpu / (lower_cpu + compile_cpu)  # CPU-s: steadier than wall on a shared host
    print(f"  grid forward (trace, lower, compile): {fwd_cpu:6.1f} CPU-s {fwd_wall:6.1f} s, ")
    print(f"    {ratio:.3f} of the train step's lower + compile; temporaries {fwd_temp:.3f} GiB")
    row.update(
      grid_forward_cpu_s=fwd_cpu,
      grid_forward_s=fwd_wall,
      grid_forward_temporaries_GiB=fwd_temp,
      grid_forward_over_train_step=ratio,
    )
  if args.hlo_stats:
    per_step = hlo_stats.stats(compiled.as_text())._asdict()
    print("  per step: " + ", ".join(f"{k} {v:,.0f}" for k, v in per_step.items()))
    row.update(per_step)
  return row


if __name__ == "__main__":
  main()
