"""Two runs of the same config compared step by step: where their logged metrics first
differ, by how much, and how far apart they end (losses and the k-grid). Used to compare the
jax lines (docs/tests.md): the same command trained under Python 3.11 / jax 0.10.2 and
Python 3.12 / jax 0.11.2, on the same documents.

  python benchmarks/line_parity.py RUN_A RUN_B

The quickstart's stdlib corpus is the interpreter's own standard library (3.12's has fewer
tokens than 3.11's), so a comparison across Pythons trains both on one copy of it:
  --config.data.corpus=files "--config.data.paths=DIR/**/*.py"
with DIR a copy of one line's stdlib files (`moejax.data.corpora.stdlib_paths`, empty files
left out: the files corpus refuses them). Timing metrics (perf/*, tokens_per_sec) are skipped.
`--result NAME` also writes the figures to benchmarks/results/<NAME>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result

SKIP = ("perf/", "tokens_per_sec")


def rows(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def rel(a: float, b: float) -> float:
  return abs(a - b) / max(abs(a), abs(b), 1e-30)


def step_diffs(a: list[dict], b: list[dict]) -> list[tuple[int, float, str, float]]:
  """(step, largest relative difference over the row's metrics, its metric, loss's)."""
  out = []
  for ra, rb in zip(a, b):
    if ra["step"] != rb["step"]:
      raise SystemExit(f"error: the runs log different steps ({ra['step']} vs {rb['step']})")
    keys = [k for k, v in ra.items() if isinstance(v, float) and not k.startswith(SKIP)]
    worst = max(keys, key=lambda k: rel(ra[k], rb[k]))
    out.append((ra["step"], rel(ra[worst], rb[worst]), worst, rel(ra["loss"], rb["loss"])))
  return out


def grid_diff(run_a: str, run_b: str) -> float | None:
  """The largest absolute difference between the two k-grids' numbers, if both have one."""
  paths = [os.path.join(r, "eval", "k_grid.jsonl") for r in (run_a, run_b)]
  if not all(os.path.exists(p) for p in paths):
    return None
  worst = 0.0
  for x, y in zip(*(rows(p) for p in paths)):
    for k, v in x.items():
      if isinstance(v, float) and isinstance(y.get(k), float):
        worst = max(worst, abs(v - y[k]))
  return worst


def smallest_k1_delta(run: str) -> float | None:
  """Δ loss of the grid's smallest k1 at its native k2 (the small-k1 penalty), if gridded."""
  path = os.path.join(run, "eval", "k_grid.jsonl")
  if not os.path.exists(path):
    return None
  native = [r for r in rows(path) if r.get("k2") == "native"]
  return min(native, key=lambda r: r["k1"])["delta"] if native else None


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("run_a")
  p.add_argument("run_b")
  p.add_argument("--result", default="", help="also write benchmarks/results/<NAME>.json")
  args = p.parse_args()
  runs = [rows(os.path.join(r, "metrics.jsonl")) for r in (args.run_a, args.run_b)]
  diffs = step_diffs(*runs)
  same = [d for d in diffs if d[1] == 0.0]
  first = next((d for d in diffs if d[1] > 0.0), None)
  apart = next((d for d in diffs if d[1] > 1e-6), None)
  print(f"{len(diffs)} logged steps; {len(same)} with every metric bitwise equal")
  if first:
    print(f"first difference at step {first[0]}: {first[1]:.2e} relative ({first[2]})")
    if apart:
      print(f"within 1e-6 relative (float32 rounding) until step {apart[0]}: "
            f"{apart[1]:.2e} ({apart[2]})")  # fmt: skip
  print(f"largest loss difference: {max(d[3] for d in diffs):.2e} relative")
  print(f"final loss difference: {diffs[-1][3]:.2e} relative (step {diffs[-1][0]})")
  g = grid_diff(args.run_a, args.run_b)
  if g is not None:
    print(f"k-grid: largest absolute difference {g:.4f}")
  if args.result:
    write_result(
      args.result,
      {
        "logged_steps": len(diffs),
        "bitwise_equal_steps": len(same),
        "first_difference_step": first[0] if first else None,
        "first_difference_metric": first[2] if first else None,
        "apart_beyond_1e-6_at_step": apart[0] if apart else None,
        "largest_loss_difference_rel": max(d[3] for d in diffs),
        "final_step": diffs[-1][0],
        "final_loss_a": runs[0][len(diffs) - 1]["loss"],
        "final_loss_b": runs[1][len(diffs) - 1]["loss"],
        "final_loss_difference_rel": diffs[-1][3],
        "k_grid_largest_abs_difference": g,
        "smallest_k1_delta_a": smallest_k1_delta(args.run_a),
        "smallest_k1_delta_b": smallest_k1_delta(args.run_b),
      },
    )


if __name__ == "__main__":
  main()
