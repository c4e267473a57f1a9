"""A second identical run's time to its first step with the persistent compilation cache
(`train.compile_cache`), against the first's, and against no cache.

Run: python benchmarks/compile_cache.py [--repeats 2] [--set KEY=VALUE ...]
Each arm launches `python -m moejax.train` on a 1-step run of configs/quickstart.py (small
by default: synthetic data, 2 layers, d_model 64; `--set` changes it) into a fresh workdir
and times the process from launch to exit: import, build, compile, the step and its eval.
`cold`: an empty cache folder; `warm`: the same folder again (what a sweep's second run and
a resume see); `off`: `train.compile_cache=''`. Arms interleave, the min of `--repeats` is
kept. Writes benchmarks/results/compile_cache.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import REPO, write_result

SMALL = {
  "data.corpus": "synthetic",
  "data.batch_size": 8,
  "data.seq_len": 64,
  "model.n_layers": 2,
  "model.d_model": 64,
  "train.steps": 1,
  "train.eval_sequences": 8,
  "eval.sequences": 8,
  "eval.batch_size": 8,
  "train.progress": False,
  "wandb.mode": "disabled",
  "train.tensorboard": False,
}


def launch(workdir: str, cache: str, values: dict) -> float:
  """Seconds from launch to exit of a 1-step training process."""
  flags = [f"--config.{k}={v}" for k, v in {**values, "train.compile_cache": cache}.items()]
  argv = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py"]
  t = time.perf_counter()
  out = subprocess.run(
    [*argv, "--workdir", workdir, *flags], cwd=REPO, capture_output=True, text=True, check=False
  )
  if out.returncode:
    sys.exit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
  return time.perf_counter() - t


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--result", default="compile_cache")
  args = p.parse_args()
  values = dict(SMALL, **dict(kv.split("=", 1) for kv in args.set))
  best = {"cold_s": float("inf"), "warm_s": float("inf"), "off_s": float("inf")}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.repeats):
      cache = os.path.join(tmp, f"cache{r}")
      runs = {"cold_s": cache, "warm_s": cache, "off_s": ""}
      for arm, folder in runs.items():
        best[arm] = min(best[arm], launch(os.path.join(tmp, f"{arm}{r}"), folder, values))
        print(f"repeat {r} {arm}: {best[arm]:.2f} s", flush=True)
  figures = {
    "overrides": " ".join(f"{k}={v}" for k, v in values.items()),
    **best,
    "warm_over_cold": best["warm_s"] / best["cold_s"],
    "cold_over_off": best["cold_s"] / best["off_s"],
  }
  write_result(args.result, figures)


if __name__ == "__main__":
  main()
