"""Loads the calibration study's committed results and forms seed-level estimates.

A run's results live in `runs/<run>/`: `config.json`, `metrics.jsonl`, `eval/k_grid.jsonl`
(final checkpoint) and `eval/step<N>/k_grid.jsonl` (earlier checkpoints). Grid rows carry
`loss_per_sequence`, so any two cells of one run can be compared paired per sequence, and
runs of different seeds can be combined with a hierarchical bootstrap (seeds, then
sequences: `moejax.stats.seed_level`).
"""

from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

import numpy as np

from moejax import stats

NATIVE = "native"
RESAMPLES = 2000


class Estimate(NamedTuple):
  """A mean Δ (nats/token) with its 95% CI and the number of seeds behind it."""

  mean: float
  lo: float
  hi: float
  n_seeds: int

  def excludes_zero(self) -> bool:
    return self.lo > 0 or self.hi < 0

  def fmt(self, digits: int = 3) -> str:
    f = f"+.{digits}f"
    return f"{self.mean:{f}} [{self.lo:{f}}, {self.hi:{f}}]"


class RunResult(NamedTuple):
  name: str
  factors: dict
  config: dict
  metrics: list[dict]
  grids: dict[int, dict[tuple, dict]]  # checkpoint step -> (k1, k2) -> grid row
  final_step: int

  @property
  def top_k(self) -> int:
    return int(self.config["model"]["moe"]["top_k"])

  @property
  def final_grid(self) -> dict[tuple, dict]:
    return self.grids[self.final_step]

  @property
  def eval_loss(self) -> float:
    """Held-out loss at native K on the grid's sequences (the same ones for every run)."""
    return float(self.final_grid[(self.top_k, NATIVE)]["loss"])

  @property
  def train_seconds(self) -> float:
    """Wall time of training, summed over logged intervals (tokens / tokens_per_sec)."""
    data = self.config["data"]
    tokens = data["batch_size"] * data["seq_len"]
    seconds, last = 0.0, 0
    for r in self.metrics:
      seconds += (r["step"] - last) * tokens / r["tokens_per_sec"]
      last = r["step"]
    return seconds


def _cell_key(row: dict) -> tuple:
  k2 = row["k2"]
  return int(row["k1"]), (int(k2) if isinstance(k2, (int, float)) else str(k2))


def read_grid(path: pathlib.Path) -> dict[tuple, dict]:
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return {_cell_key(r): r for r in rows}


def load_run(run_dir: pathlib.Path, factors: dict) -> RunResult:
  config = json.loads((run_dir / "config.json").read_text())
  metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  final = read_grid(run_dir / "eval" / "k_grid.jsonl")
  final_step = int(next(iter(final.values()))["step"])
  grids = {final_step: final}
  for sub in sorted((run_dir / "eval").glob("step*/k_grid.jsonl")):
    grids[int(sub.parent.name[len("step") :])] = read_grid(sub)
  return RunResult(run_dir.name, factors, config, metrics, grids, final_step)


def load_all(results_dir: pathlib.Path, runs) -> dict[str, RunResult]:
  """The finished runs among `runs` (RunSpecs), by name; unfinished ones are left out."""
  out = {}
  for spec in runs:
    d = results_dir / spec.name
    if (d / "eval" / "k_grid.jsonl").exists():
      out[spec.name] = load_run(d, spec.factors)
  return out


def paired_diffs(grid: dict, cell: tuple, against: tuple) -> np.ndarray | None:
  """Per-sequence loss of `cell` minus `against`; None when either cell is absent."""
  if cell not in grid or against not in grid:
    return None
  a = np.asarray(grid[cell]["loss_per_sequence"], np.float64)
  return a - np.asarray(grid[against]["loss_per_sequence"], np.float64)


def estimate(
  runs: list[RunResult], cell: tuple, *, against: tuple | None = None, step: int | None = None
) -> Estimate | None:
  """Seed-level Δ of `cell` (vs native K, or vs `against`) over the given seed runs."""
  diffs = []
  for run in runs:
    grid = run.grids.get(run.final_step if step is None else step)
    d = None if grid is None else paired_diffs(grid, cell, against or (run.top_k, NATIVE))
    if d is not None:
      diffs.append(d)
  if not diffs:
    return None
  mean, (lo, hi) = stats.seed_level(diffs, n_resamples=RESAMPLES, seed=0)
  return Estimate(float(mean), float(lo), float(hi), len(diffs))


def k2_choices(grid: dict, k1: int) -> list:
  """The k2 labels present at this k1, in grid order."""
  return [k2 for (a, k2) in grid if a == k1]
