"""A program read back from JAX's persistent compilation cache against the same program
compiled, in one process: what a later seed of experiments/calibration/device_study.py pays
for its programs (its arms run in one process, each with new jitted functions, so JAX's
in-memory caches miss and the cache folder serves them).

  JAX_PLATFORMS=cpu python benchmarks/compile_cache_hit.py \
      [--config configs/study_calibration.py:device] [--set KEY=VALUE ...] [--repeats 2]

The train step and the k-grid's forward (one k1) of the config, lowered and compiled for this
host's first device (`moejax.aot.programs`, as `describe` builds them), each timed `cold` (an
empty cache folder: XLA compiles and the cache writes) and `warm` (after `jax.clear_caches()`:
the same program lowered again and its executable read from the folder); lowering is in
both, so `warm` is what a cached program costs end to end. Each repeat is a fresh process
with a fresh folder (JAX opens its cache folder once per process); the min is kept. Writes
benchmarks/results/compile_cache_hit.json (`--result NAME` for another name).
`compile_cache.json` measures whole processes instead (imports, data and the first step
included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax

from moejax import cli
from moejax.aot import programs
from moejax.aot.targets import Target
from moejax.backend import compile_options
from moejax.config import resolve

sys.path.insert(0, os.path.dirname(__file__))
from aot_compile_time import _set
from common import REPO, write_result

CONFIG = "configs/study_calibration.py:device"


def host_target() -> Target:
  """This host's first device as a compile target, with the run's own XLA options."""
  device = jax.devices()[0]
  options = tuple(compile_options.options(device.platform).items())
  return Target(device.platform, device.platform, (device,), 1, 0, "", options)


def _train_step(rc, target):
  return target.compile(programs.lower_train_step(programs.abstract_run(rc, target), target))


def _grid_forward(rc, target):
  return programs.grid_forward(rc, target)


PROGRAMS = {"train_step": _train_step, "grid_forward": _grid_forward}


def timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def measure(rc, target, folder: str) -> dict:
  """{program: (cold s, warm s)} with the persistent cache in `folder` (empty)."""
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  out = {}
  for name, build in PROGRAMS.items():
    jax.clear_caches()
    cold = timed(lambda: build(rc, target))
    jax.clear_caches()
    out[name] = (cold, timed(lambda: build(rc, target)))
    print(f"  {name}: cold {out[name][0]:.2f} s, warm {out[name][1]:.2f} s", file=sys.stderr)
  return out


def child(args) -> None:
  """One repeat: both programs cold and warm in a fresh folder; a JSON line on stdout."""
  c = cli.load_file(os.path.join(REPO, args.config))  # relative to the repository
  for assignment in args.set:
    _set(c, assignment)
  target = host_target()
  with tempfile.TemporaryDirectory() as folder:
    print(json.dumps({"target": target.name, **measure(resolve(c), target, folder)}))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--result", default="compile_cache_hit")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return child(args)
  best: dict[str, list[float]] = {}
  for r in range(args.repeats):
    print(f"repeat {r}", flush=True)
    argv = [sys.executable, __file__, "--child", "--config", args.config]
    argv += [f"--set={a}" for a in args.set]
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True, cwd=REPO)
    seconds = json.loads(out.stdout.splitlines()[-1])
    target = seconds.pop("target")
    for name, (cold, warm) in seconds.items():
      prev = best.get(name, [float("inf"), float("inf")])
      best[name] = [min(prev[0], cold), min(prev[1], warm)]
  rows = [
    {"program": n, "cold_s": cold, "warm_s": warm, "warm_over_cold": warm / cold}
    for n, (cold, warm) in best.items()
  ]
  cold, warm = sum(r["cold_s"] for r in rows), sum(r["warm_s"] for r in rows)
  figures = {
    "config": args.config,
    "set": " ".join(args.set),
    "target": target,
    "rows": rows,
    "warm_over_cold": warm / cold,
  }
  print(f"both programs: warm/cold {warm / cold:.3f}")
  write_result(args.result, figures)


if __name__ == "__main__":
  main()
