"""Loads the calibration study's committed results and forms seed-level estimates.

A run's results live in `runs/<run>/`: `config.json`, `metrics.jsonl`, `eval/k_grid.jsonl`
(final checkpoint) and `eval/step<N>/k_grid.jsonl` (earlier checkpoints). Grid rows carry
`loss_per_sequence`, so any two cells of one run can be compared paired per sequence; every
run is gridded on the same held-out sequences, so two models are compared paired by seed
(same init and data order) and by sequence.

Seed-level intervals (`seed_interval`): with n >= 2 seeds, a Student-t interval on the n
per-seed means with n - 1 degrees of freedom. Its standard error adds, to the between-seed
s²/n, the within-seed variance of a seed's mean (var over sequences / N, averaged over seeds):
the t interval alone treats the held-out sequences as fixed, and the added term can only widen
it. A prediction interval for one new seed's mean on these same sequences (which a new seed
shares, so no sequence term) is
mean ± t_{n-1} · s · sqrt(1 + 1/n) (the normal-theory prediction interval for one future
observation; Hahn & Meeker, *Statistical Intervals*, Wiley 1991).
With one seed there is no t interval: the paired bootstrap over sequences is used instead and
labelled as such (`moejax.stats.seed_level`, which is that bootstrap for one seed).
"""

from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

import numpy as np
from scipy import stats as sps

from moejax import stats

NATIVE = "native"
RESAMPLES = 2000
CONFIDENCE = 0.95
T, BOOTSTRAP = "t", "bootstrap"  # Estimate.method


class Estimate(NamedTuple):
  """A mean (nats/token) with its 95% CI, the seeds behind it and how the CI was formed;
  `pi_lo`/`pi_hi` bound one new seed's mean (NaN without a t interval)."""

  mean: float
  lo: float
  hi: float
  n_seeds: int
  method: str = T
  pi_lo: float = float("nan")
  pi_hi: float = float("nan")

  def excludes_zero(self) -> bool:
    return self.lo > 0 or self.hi < 0

  def fmt(self, digits: int = 3) -> str:
    f = f"+.{digits}f"
    return f"{self.mean:{f}} [{self.lo:{f}}, {self.hi:{f}}]"

  def full(self, digits: int = 3) -> str:
    """`fmt` plus the new-seed prediction interval, or the label of a one-seed bootstrap."""
    if self.method == BOOTSTRAP:
      return f"{self.fmt(digits)} (1 seed: bootstrap over sequences)"
    f = f"+.{digits}f"
    return f"{self.fmt(digits)} (n={self.n_seeds}; new seed [{self.pi_lo:{f}}, {self.pi_hi:{f}}])"


def seed_interval(per_seed: list) -> Estimate:
  """The mean over seeds of each seed's per-sequence values, with its seed-level 95% CI and
  one-new-seed prediction interval (module docstring); one seed: the sequence bootstrap."""
  arrays = [np.asarray(a, np.float64) for a in per_seed]
  n = len(arrays)
  if n == 1:
    mean, (lo, hi) = stats.seed_level(arrays, n_resamples=RESAMPLES, seed=0)
    return Estimate(mean, lo, hi, 1, BOOTSTRAP)
  means_S = np.array([a.mean() for a in arrays])
  mean, s = float(means_S.mean()), float(means_S.std(ddof=1))
  within = float(np.mean([a.var(ddof=1) / a.size if a.size > 1 else 0.0 for a in arrays]))
  q = float(sps.t.ppf(0.5 + CONFIDENCE / 2, n - 1))
  half = q * np.sqrt(s**2 / n + within)
  pi = q * s * np.sqrt(1 + 1 / n)
  return Estimate(mean, mean - half, mean + half, n, T, mean - pi, mean + pi)


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
  return seed_interval(diffs) if diffs else None


def cell_losses(run: RunResult, cell: tuple) -> np.ndarray | None:
  row = run.final_grid.get(cell)
  return None if row is None else np.asarray(row["loss_per_sequence"], np.float64)


def pair_by_seed(runs_a: list[RunResult], runs_b: list[RunResult]) -> tuple[list, list]:
  """The runs of two models at the seeds both have, in matching order."""
  by_seed = {r.factors.get("seed"): r for r in runs_b}
  pairs = [(a, by_seed[a.factors.get("seed")]) for a in runs_a if a.factors.get("seed") in by_seed]
  return [a for a, _ in pairs], [b for _, b in pairs]


def between(runs_a: list[RunResult], cell_a: tuple, runs_b: list[RunResult], cell_b: tuple):
  """Seed-level loss of model a at `cell_a` minus model b at `cell_b`, paired by seed (the
  seeds both have) and by sequence; None when no seed has both cells."""
  diffs = []
  for ra, rb in zip(*pair_by_seed(runs_a, runs_b)):
    a, b = cell_losses(ra, cell_a), cell_losses(rb, cell_b)
    if a is not None and b is not None:
      diffs.append(a - b)
  return seed_interval(diffs) if diffs else None


def k2_choices(grid: dict, k1: int) -> list:
  """The k2 labels present at this k1, in grid order."""
  return [k2 for (a, k2) in grid if a == k1]
