"""Sweep throughput on one machine: `--parallel 1` against `--parallel 2 --cores-per-run N`.

  JAX_PLATFORMS=cpu python benchmarks/sweep_throughput.py [--steps 80] [--rounds 2]

Two of the calibration study's own runs (factor A's core pair, seed 0, the CPU preset),
shortened to `--steps`, trained through the local launcher (`launch.local.run`) with no
grid, in alternating rounds (ABAB) so a busy machine slows both arms alike:
  serial   one run at a time, unpinned (XLA uses every core);
  pinned   two at once, each pinned to its own `--cores-per-run` cores (affinity mask; XLA
           sizes its intra-op pool from it).
Per arm it prints the sweep's wall time, the aggregate training tokens/s while runs train
(the sum over concurrent runs of their median logged tokens_per_sec), and the ratio. Writes
benchmarks/results/sweep_throughput.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)  # the sweep's config paths are relative to the repo

from common import write_result

from experiments.calibration import sweep as study
from launch import commands, local
from launch.spec import Sweep

TOKENS_PER_STEP = 16 * 128  # configs/study_calibration.py: batch 16 x seq 128


def study_runs(steps: int):
  """Factor A's core pair at seed 0, cut to `steps` with nothing saved or evaluated on the way."""
  runs = [r for r in study.factor_a() if r.name.endswith("-s0")]
  short = {"train.steps": steps, "train.eval_every": steps, "train.ckpt_every": steps}
  return [dataclasses.replace(r, overrides={**r.overrides, **short}) for r in runs]


def median_tokens_per_sec(workdir: str) -> float:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r][1:]  # first has compile
  return statistics.median(rates)


def one_arm(root: str, runs, parallel: int, cores_per_run: int) -> dict:
  sweep = Sweep(name="throughput", runs=runs)
  jobs = [
    local.Job(r, w, [commands.train_argv(sweep, r, w, sys.executable)])
    for r in runs
    for w in [commands.run_dir(root, sweep, r)]
  ]
  t = time.perf_counter()
  with open(os.devnull, "w") as quiet:
    failed = local.run(sweep, jobs, parallel, out=quiet, cores_per_run=cores_per_run)
  wall = time.perf_counter() - t
  if failed:
    raise SystemExit(f"error: {[j.run.name for j in failed]} failed; see {failed[0].log}")
  rates = [median_tokens_per_sec(j.workdir) for j in jobs]
  steps = int(runs[0].overrides["train.steps"])
  concurrent = sum(rates) if parallel > 1 else statistics.mean(rates)
  return {
    "wall_s": wall,
    "train_tok_s": concurrent,
    "sweep_tok_s": len(runs) * steps * TOKENS_PER_STEP / wall,
    "per_run": rates,
  }


def run_rounds(runs, arms: dict, rounds: int) -> tuple[dict[str, list[dict]], list[dict]]:
  """Every arm once per round, printing each: ({arm: its one_arm results}, a row per arm run)."""
  results = {name: [] for name in arms}
  rows = []
  for i in range(rounds):
    for name, (parallel, cpr) in arms.items():
      with tempfile.TemporaryDirectory() as root:
        res = one_arm(root, runs, parallel, cpr)
      results[name].append(res)
      rates = ", ".join(f"{r:.0f}" for r in res["per_run"])
      print(
        f"round {i} {name:6s} wall {res['wall_s']:6.1f} s  training {res['train_tok_s']:6.0f} "
        f"tok/s (per run {rates})  sweep {res['sweep_tok_s']:6.0f} tok/s",
        flush=True,
      )
      totals = {k: v for k, v in res.items() if k != "per_run"}
      rows.append({"round": i, "arm": name, **totals, "per_run_tok_s": rates})
  return results, rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=80)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--cores-per-run", type=int, default=1)
  p.add_argument("--result", default="sweep_throughput", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  os.environ.setdefault("WANDB_MODE", "disabled")
  runs = study_runs(args.steps)
  arms = {"serial": (1, 0), "pinned": (2, args.cores_per_run)}
  results, rows = run_rounds(runs, arms, args.rounds)
  best = {n: min(rs, key=lambda r: r["wall_s"]) for n, rs in results.items()}
  training = best["pinned"]["train_tok_s"] / best["serial"]["train_tok_s"]
  faster = best["serial"]["wall_s"] / best["pinned"]["wall_s"]
  print(
    f"pinned/serial ({len(runs)} runs x {args.steps} steps, {os.cpu_count()} cores, best of "
    f"{args.rounds}): training tokens/s {training:.2f}x, sweep wall time {faster:.2f}x faster"
  )
  sweep = {"runs": len(runs), "steps": args.steps, "cores_per_run": args.cores_per_run}
  ratios = {"train_tok_s_pinned_over_serial": training, "wall_serial_over_pinned": faster}
  figures = {"rows": rows, **sweep, "rounds": args.rounds, **ratios}
  write_result(args.result, figures, argv=[__file__, *sys.argv[1:]])  # argv[0]: before chdir


if __name__ == "__main__":
  main()
