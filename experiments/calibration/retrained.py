"""Factor A retrained at 10 seeds (sweep_tasks.py, one commit): the loss view's H1 again, as a
reproduction check of the committed 5-seed runs, and H1 and H10 in downstream accuracy on the
nextline task (tasks_grid.py), as found.

Accuracy is read from each run's per-item outcomes (`eval/tasks/nextline/items_k1_*_k2_*.jsonl`):
a cell's values are 100 · correct per item (points), in doc_id order, so `results.estimate`
forms Δ points against native k1 = K paired by item within a seed, and its seed-level interval
(Student t over seeds, plus the within-seed item variance; results.py) over the seeds. Every
run is scored on the same items (one held-out split), so seeds are paired too. The kept
fraction in accuracy is Δacc(k2=K) / Δacc(k2=k1), with scale.kept_interval's bootstrap (items,
then seeds, drawn), beside the same fraction in loss on the same runs.

Intervals are given at every finished seed and, for comparison with the committed report, at
seeds 0-4. A table lists the cells every run has (seed 0 of each rule was gridded at more).
"""

from __future__ import annotations

import json
import pathlib

import hypotheses
import numpy as np
import results as res
import scale
import sweep_tasks

TASK = "nextline"
RENORM, PLAIN = "qwen3_moe", "olmoe"
FIRST = 5  # seeds 0-4: the committed report's seed count


def _items(path: pathlib.Path) -> np.ndarray:
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  rows.sort(key=lambda r: r["doc_id"])
  return 100.0 * np.array([float(r["correct"]) for r in rows])


def accuracy_run(run_dir: pathlib.Path, factors: dict) -> res.RunResult | None:
  """A run's task grid as a RunResult whose per-sequence values are per-item points."""
  task_dir = run_dir / "eval" / "tasks" / TASK
  if not (task_dir / "k_grid.jsonl").is_file():
    return None
  grid = {}
  for cell, row in res.read_grid(task_dir / "k_grid.jsonl").items():
    points = _items(task_dir / f"items_k1_{cell[0]}_k2_{row['k2']}.jsonl")
    grid[cell] = {**row, "loss": float(points.mean()), "loss_per_sequence": points}
  config = json.loads((run_dir / "config.json").read_text())
  return res.RunResult(run_dir.name, factors, config, [], {0: grid}, 0)


class Retrained:
  """The retrained runs per rule, in the loss view and the accuracy view (seed order)."""

  def __init__(self, results_dir: pathlib.Path):
    specs = sweep_tasks.get_sweep().runs
    loss = res.load_all(results_dir, specs)
    acc = {s.name: accuracy_run(results_dir / s.name, s.factors) for s in specs}
    order = lambda rs: sorted(rs, key=lambda r: r.factors["seed"])
    self.loss = {
      rule: order([r for r in loss.values() if r.factors["rule"] == rule])
      for rule in (RENORM, PLAIN)
    }
    self.acc = {
      rule: order([r for r in acc.values() if r is not None and r.factors["rule"] == rule])
      for rule in (RENORM, PLAIN)
    }
    commits = {r.config.get("resolved", {}).get("git_commit", "?") for r in loss.values()}
    self.commits = sorted(commits)


def _seeds(n: int) -> str:
  return f"{n} seed{'s' if n != 1 else ''}"


def _first(runs: list) -> list:
  return [r for r in runs if r.factors["seed"] < FIRST]


def _fmt(e, digits: int) -> str:
  return "—" if e is None else e.full(digits)


def loss_h1(committed: list, new: list) -> list[str]:
  """The k2 = K saving in loss, Δ(k2=K) − Δ(k2=k1) (nats/token), committed vs retrained, and
  which retrained seeds fall outside the committed new-seed prediction interval."""
  if not committed or not new:
    return []
  K = new[0].top_k
  out = [
    f"| k1 | committed runs | retrained, seeds 0–4 | retrained, {_seeds(len(new))} | retrained seeds "
    "outside the committed new-seed interval |",
    "|---|---|---|---|---|",
  ]
  for k1 in (4, 2, 1):
    cell, against = (k1, K), (k1, k1)
    old = res.estimate(committed, cell, against=against)
    outside = []
    for r in new:
      one = res.paired_diffs(r.final_grid, cell, against)
      if old is not None and one is not None and not old.pi_lo <= one.mean() <= old.pi_hi:
        outside.append(f"s{r.factors['seed']} ({one.mean():+.3f})")
    out.append(
      f"| {k1} | {_fmt(old, 3)} | {_fmt(res.estimate(_first(new), cell, against=against), 3)} "
      f"| {_fmt(res.estimate(new, cell, against=against), 3)} | {', '.join(outside) or 'none'} |"
    )
  return out


def accuracy_table(runs: list) -> list[str]:
  """Per cell: mean accuracy, Δ points against native K with both seed counts' intervals, the
  flips summed over seeds, and the seeds whose own Holm-adjusted McNemar p is below 0.05."""
  K = runs[0].top_k
  grid = [c for c in runs[0].final_grid if all(c in r.final_grid for r in runs)]
  out = [
    f"| k1 | k2 | accuracy | Δ points, {_seeds(len(runs))} (new seed) | Δ points, seeds 0–4 | "
    "flips to wrong / right (Σ seeds) | seeds with p_holm < 0.05 |",
    "|---|---|---|---|---|---|---|",
  ]
  for cell in grid:
    rows = [r.final_grid[cell] for r in runs if cell in r.final_grid]
    acc = np.mean([row["accuracy"] for row in rows])
    if cell == (K, res.NATIVE):
      out.append(f"| {cell[0]} | {cell[1]} | {acc:.3f} | reference | | | |")
      continue
    wrong = sum(int(row["flips_to_wrong"]) for row in rows)
    right = sum(int(row["flips_to_right"]) for row in rows)
    sig = sum(1 for row in rows if row["p_holm"] < 0.05)
    out.append(
      f"| {cell[0]} | {cell[1]} | {acc:.3f} | {_fmt(res.estimate(runs, cell), 1)} | "
      f"{_fmt(res.estimate(_first(runs), cell), 1)} | {wrong} / {right} | {sig} of {len(rows)} |"
    )
  return out


def _kept(runs: list, k1: int) -> str:
  num, den = scale.kept_arrays(runs, k1)
  if not num or not den:
    return "—"
  lo, hi = scale.kept_interval(num, den)
  return f"{scale.ratio(num, den):.0%} [{lo:.0%}, {hi:.0%}]"


def h1_h10(acc: list, loss: list) -> list[str]:
  """H1 in accuracy (the k2 = K saving in points) and H10 (the kept fraction, accuracy and
  loss) for the renormalized-trained rule, per k1 < K."""
  K, out = acc[0].top_k, []
  for k1 in (4, 2, 1):
    c = res.estimate(acc, (k1, K), against=(k1, k1))
    c5 = res.estimate(_first(acc), (k1, K), against=(k1, k1))
    if c is None:
      continue
    out.append(
      f"- k1 = {k1}: Δ(k2=k1) {_fmt(res.estimate(acc, (k1, k1)), 1)} points, Δ(k2=K) "
      f"{_fmt(res.estimate(acc, (k1, K)), 1)}; k2 = K − k2 = k1 {_fmt(c, 1)} (seeds 0–4: "
      f"{c5.fmt(1) if c5 else '—'}): "
      f"{hypotheses.verdict(c, 'k2 = K loses more', 'k2 = K loses less')}. "
      f"**H10** kept fraction Δ(k2=K)/Δ(k2=k1): accuracy {_kept(acc, k1)}, loss {_kept(loss, k1)} "
      f"(the write-up: about {scale.BLOG_KEPT:.0%})."
    )
  return out


def plain_lines(acc: list) -> list[str]:
  """For the rule trained unnormalized: renormalizing at k1 (k2 = k1) against its native cell."""
  out = []
  for k1 in (4, 2, 1):
    c = res.estimate(acc, (k1, k1), against=(k1, res.NATIVE))
    if c is None:
      continue
    out.append(
      f"- k1 = {k1}: Δ(native) {_fmt(res.estimate(acc, (k1, res.NATIVE)), 1)} points, "
      f"Δ(renormalized, k2=k1) {_fmt(res.estimate(acc, (k1, k1)), 1)}; renormalized − native "
      f"{_fmt(c, 1)}: {hypotheses.verdict(c, 'renormalizing hurts', 'renormalizing helps')}."
    )
  return out


def statements(committed: dict, results_dir: pathlib.Path) -> str:
  """The README section; `committed` maps each rule to the committed factor-A runs."""
  rt = Retrained(results_dir)
  n = {rule: len(rs) for rule, rs in rt.acc.items()}
  head = "## Factor A retrained (seeds 0–9): the loss view again, and downstream accuracy\n"
  if not any(rt.loss.values()):
    return head + "\nNot run yet (`experiments/calibration/sweep_tasks.py`).\n"
  parts = [
    head,
    f"The factor-A runs trained again, seeds 0–9 per rule planned, at commit(s) "
    f"{', '.join(c[:12] for c in rt.commits)} (`runs_tasks/`; sweep_tasks.py), each gridded in "
    f"loss as before and on `{TASK}`, a 4-choice task of held-out lines (tasks_grid.py: "
    f"`runs_tasks/tasks/{TASK}.jsonl`, the same items for every run). Loss runs: "
    f"{len(rt.loss[RENORM])} {RENORM}, {len(rt.loss[PLAIN])} {PLAIN}; task grids: "
    f"{n[RENORM]} {RENORM}, {n[PLAIN]} {PLAIN}.\n",
    "**Reproduction of the loss view's H1** (the k2 = K saving Δ(k2=K) − Δ(k2=k1), nats/token, "
    f"`{RENORM}`; negative: k2 = K loses less; seed-level 95% CI, new-seed prediction "
    "interval in parentheses):\n",
    *loss_h1(committed.get(RENORM, []), rt.loss[RENORM]),
    "",
  ]
  if rt.acc[RENORM]:
    parts += [
      f"**H1 and H10 in accuracy** (`{RENORM}`, {_seeds(n[RENORM])}; Δ in accuracy points "
      "against native k1 = K, paired by item and seed; a positive k2 = K − k2 = k1 means "
      "k2 = K loses fewer points):\n",
      *h1_h10(rt.acc[RENORM], rt.loss[RENORM]),
      "",
      *accuracy_table(rt.acc[RENORM]),
      "",
    ]
  if rt.acc[PLAIN]:
    parts += [
      f"**Trained unnormalized** (`{PLAIN}`, {_seeds(n[PLAIN])}; Δ in accuracy points):\n",
      *plain_lines(rt.acc[PLAIN]),
      "",
      *accuracy_table(rt.acc[PLAIN]),
      "",
    ]
  return "\n".join(parts)
