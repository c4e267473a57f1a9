"""`model.scan_layers` on CPU: compile time and step time, scanned against unrolled.

Run: python benchmarks/scan_layers.py [--shape 64/8/32] [--repeats 5] [--compile-repeats 3]
                                      [--set KEY=VALUE ...] [--profile]
The study shape (`base_config()` with qwen3_moe, E/K/f) and its dense twin (d_ff = K·f),
each built in three layouts (`LAYOUTS`: scanned as a loop, TPU's and GPU's default;
scanned with `model.scan_unroll=0`, the stacked layout without a loop, the default on CPU
with remat none; unrolled), six train steps compiled in one process and timed interleaved
(min of `--repeats`); each arm's compile is the fastest of `--compile-repeats` rounds, arms
interleaved, after one untimed round. Prints
the compile seconds of each, the MoE/dense compile ratio in each layout, each scanned
layout's step-time ratio to the unrolled one and XLA's step bytes, and writes them to
benchmarks/results/scan_layers.json (`--result NAME` for another name). `--profile` then
traces three steps of each arm and adds the thread time by kind of XLA:CPU op
(`cpu_profile.py`): what the scanned steps spend that the unrolled ones do not.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
import cpu_profile
from aot_compile_time import _set
from common import interleaved_min, write_result
from study_shape import study_config
from train_step import dense_twin, jitted_step

from moejax.kernels import dispatch as dsp

# layout -> (model.scan_layers, model.scan_unroll): the scan as a loop (TPU's and GPU's
# default), the same stacked layout unrolled whole (no loop: the default, -1, on CPU with
# remat none), and the unrolled layout.
LAYOUTS = {"scanned": (True, 1), "unroll0": (True, 0), "unrolled": (False, 1)}


def arms(moe_cfg) -> dict[str, object]:
  """moe/dense × LAYOUTS configs."""
  out = {}
  for kind, c in (("moe", moe_cfg), ("dense", dense_twin(moe_cfg))):
    for layout, (scan, unroll) in LAYOUTS.items():
      a = c.copy_and_resolve_references()
      a.model.update(scan_layers=scan, scan_unroll=unroll)
      out[f"{kind}/{layout}"] = a
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", default="64/8/32", help="E/K/f")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--compile-repeats", type=int, default=3, help="compiles per arm (min kept)")
  p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--result", default="scan_layers", help="benchmarks/results/<NAME>.json")
  p.add_argument("--profile", action="store_true", help="thread time by kind of XLA:CPU op")
  args = p.parse_args()
  if args.profile:
    cpu_profile.enable()  # before the CPU backend starts
  E, K, f = (int(v) for v in args.shape.split("/"))
  c = study_config(E, K, f)
  for assignment in args.set:
    _set(c, assignment)
  configs = arms(c)
  # A first round of compiles pays the process's one-time costs (XLA's and the kernels'
  # initialization), which would land on one arm; then `--compile-repeats` rounds, arms
  # interleaved, and each arm's fastest compile.
  rounds = [
    {n: jitted_step(a) for n, a in configs.items()} for _ in range(1 + args.compile_repeats)
  ]
  built = {n: min((r[n] for r in rounds[1:]), key=lambda b: b.compile_s) for n in configs}
  t = interleaved_min({name: b.step for name, b in built.items()}, args.repeats)
  print(f"backend={jax.default_backend()} shape E/K/f={args.shape} layers={c.model.n_layers}")
  print("| arm | compile s | step ms | step MiB |")
  print("|---|---:|---:|---:|")
  rows, ratios = [], []
  for name, b in built.items():
    print(f"| {name} | {b.compile_s:.2f} | {t[name] * 1e3:.1f} | {b.step_bytes / 2**20:.0f} |")
    mib = b.step_bytes / 2**20
    rows.append({"arm": name, "compile_s": b.compile_s, "step_ms": t[name] * 1e3, "step_MiB": mib})
  for layout in LAYOUTS:
    ratio = built[f"moe/{layout}"].compile_s / built[f"dense/{layout}"].compile_s
    print(f"compile MoE/dense, {layout}: {ratio:.2f}x")
    ratios.append({"ratio": f"compile MoE/dense, {layout}", "value": ratio})
  for kind in ("moe", "dense"):
    for layout in [name for name, (scan, _) in LAYOUTS.items() if scan]:
      step = t[f"{kind}/{layout}"] / t[f"{kind}/unrolled"]
      compile_ratio = built[f"{kind}/{layout}"].compile_s / built[f"{kind}/unrolled"].compile_s
      print(f"step time {layout}/unrolled, {kind}: {step:.3f}; compile {compile_ratio:.2f}x")
      ratios.append({"ratio": f"step time {layout}/unrolled, {kind}", "value": step})
      ratios.append({"ratio": f"compile {layout}/unrolled, {kind}", "value": compile_ratio})
  profile = _profile(built) if args.profile else []
  m = c.model.moe
  impl = f"{m.impl} ({dsp.resolve_impl(m.impl, m.dispatch)})" if m.impl == "auto" else m.impl
  shape = {"E/K/f": args.shape, "layers": c.model.n_layers, "impl": impl}
  figures = {"rows": rows, "ratios": ratios, **({"profile": profile} if profile else {})}
  write_result(args.result, {**figures, **shape, "repeats": args.repeats})


def _profile(built) -> list[dict]:
  """Per kind of op, each arm's thread ms per step (`cpu_profile.op_ms`), printed too."""
  ms = {name: cpu_profile.op_ms(b.step) for name, b in built.items()}
  kinds = sorted(
    {k for v in ms.values() for k in v}, key=lambda k: -sum(v.get(k, 0) for v in ms.values())
  )
  print("| op (thread ms per step) | " + " | ".join(ms) + " |")
  print("|---|" + "---:|" * len(ms))
  rows = []
  for k in [*kinds, "total"]:
    row = {n: (sum(v.values()) if k == "total" else v.get(k, 0.0)) for n, v in ms.items()}
    print(f"| {k} | " + " | ".join(f"{x:.1f}" for x in row.values()) + " |")
    rows.append({"op": k, **{f"{n}_ms": x for n, x in row.items()}})
  return rows


if __name__ == "__main__":
  main()
