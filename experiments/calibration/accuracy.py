"""H10: the kept fraction in top-1 accuracy, beside the loss-based one (factors A and F).

The blog behind seed 003 reports MMLU points (at k1 = 3 of K = 16, k2 = 16 loses 1.2 where
k2 = 3 loses 12: k2 = K keeps about 10% of the k2 = k1 loss); H1 and H9 measure that fraction
in nats. Here it is also formed from each grid cell's top-1 accuracy (row key `accuracy`: the
share of held-out tokens whose argmax is the next token), for the renormalized rule:

  kept_loss = Δ(k2=K) / Δ(k2=k1)   (scale.kept_arrays, Δ against native k1 = K)
  kept_acc  = (acc(native K) − acc(k2=K)) / (acc(native K) − acc(k2=k1))

each a ratio of the means over seeds (scale.ratio). Both CIs are scale.kept_interval's
percentile bootstrap, which draws the held-out sequences, then the seeds, with replacement. A
grid row keeps one accuracy per cell, not one per sequence, so the accuracy CI draws the seeds
only (each seed a one-element array, which the sequence draw leaves as it is): it lacks the
sequence term, so it can be narrower than the loss CI where the seeds agree; with two seeds it
is the range of the two seeds' fractions; with one seed there is none.

Toward the blog: the distance |kept_acc − 10%| − |kept_loss − 10%| from one set of draws (the
same seeds for both, the sequences drawn for the loss term as in kept_interval); a CI under 0
says the accuracy view is closer to 10%, over 0 farther, else these seeds cannot tell.

`best k2` is tables.best_k2's cell, the integer-or-native k2 with the lowest seed-level mean
loss, so that nothing is chosen on the accuracy being reported.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import results as res
import scale
import tables

NATIVE = res.NATIVE
BLOG = scale.BLOG_KEPT


class Group(NamedTuple):
  """The runs of one model (one per seed) and how the report names them."""

  label: str
  runs: list


class Kept(NamedTuple):
  """The fractions at one k1 over the seeds that have every cell they need."""

  n_seeds: int
  loss: float
  loss_ci: tuple  # (lo, hi); sequences and seeds drawn
  acc: float
  acc_ci: tuple  # (lo, hi); seeds drawn only, (nan, nan) with one seed
  distance: float  # |acc − BLOG| − |loss − BLOG|
  distance_ci: tuple


def groups(runs: dict) -> list[Group]:
  """Factor A's renormalized seeds, then factor F's widths (seeds 0 and 1), then the long run."""
  out = []
  a = [r for name, r in sorted(runs.items()) if name.startswith(f"a-{scale.RENORMALIZED}-s")]
  if a:
    out.append(Group("A (d128, 600 steps)", a))
  for size in scale.widths(runs, scale.RENORMALIZED):
    out.append(Group(f"F {size.label} (600 steps)", size.runs))
  long = runs.get(f"f-long-{scale.RENORMALIZED}-s0")
  if long is not None:
    out.append(Group("F long (d128, 2,400 steps)", [long]))
  return out


def acc_drop(run: res.RunResult, cell: tuple) -> float | None:
  """acc(native K) − acc(cell) of one run's final grid; None without the cell or accuracy."""
  grid = run.final_grid
  ref, row = grid.get((run.top_k, NATIVE)), grid.get(cell)
  if ref is None or row is None or "accuracy" not in ref or "accuracy" not in row:
    return None
  return float(ref["accuracy"]) - float(row["accuracy"])


def _usable(runs: list, cells: list) -> list:
  """The runs whose final grid has every cell, with accuracy, and the native reference."""
  return [r for r in runs if all(acc_drop(r, c) is not None for c in cells)]


def _ratio(num: float, den: float) -> float:
  return num / den if den else float("nan")


def kept(runs: list, k1: int, k2=None, seed: int = 0) -> Kept | None:
  """kept_loss and kept_acc of cell (k1, k2) (default k2 = K) against (k1, k1), with CIs."""
  if not runs:
    return None
  K = runs[0].top_k
  cell, full = (k1, K if k2 is None else k2), (k1, k1)
  runs = _usable(runs, [cell, full])
  if not runs:
    return None
  native = (K, NATIVE)
  num_l = [res.paired_diffs(r.final_grid, cell, native) for r in runs]
  den_l = [res.paired_diffs(r.final_grid, full, native) for r in runs]
  num_a = np.array([acc_drop(r, cell) for r in runs])
  den_a = np.array([acc_drop(r, full) for r in runs])
  loss, acc = scale.ratio(num_l, den_l), _ratio(num_a.mean(), den_a.mean())
  rng = np.random.default_rng(seed)  # the draws of scale.kept_interval, in its order
  n_seq, n_seeds = num_l[0].size, len(runs)
  boot = np.empty((scale.RESAMPLES, 2))
  for b in range(scale.RESAMPLES):
    seq, seeds = rng.integers(0, n_seq, n_seq), rng.integers(0, n_seeds, n_seeds)
    boot[b, 0] = _ratio(scale._resample(num_l, seeds, seq), scale._resample(den_l, seeds, seq))
    boot[b, 1] = _ratio(num_a[seeds].mean(), den_a[seeds].mean())
  dist = np.abs(boot[:, 1] - BLOG) - np.abs(boot[:, 0] - BLOG)
  nan2 = (float("nan"), float("nan"))
  return Kept(
    n_seeds,
    loss,
    scale._percentiles(boot[:, 0]),
    acc,
    scale._percentiles(boot[:, 1]) if n_seeds > 1 else nan2,
    abs(acc - BLOG) - abs(loss - BLOG),
    scale._percentiles(dist) if n_seeds > 1 else nan2,
  )


def toward(k: Kept | None) -> str:
  """Read off the distance's CI (module docstring)."""
  if k is None:
    return "not measured"
  if k.n_seeds < 2:
    return "one seed: no seed-level CI"
  lo, hi = k.distance_ci
  if hi < 0:
    return "closer to 10%"
  if lo > 0:
    return "farther from 10%"
  return "cannot tell"


def _pct(v: float, ci: tuple) -> str:
  if not np.isfinite(v):
    return "—"
  if not all(np.isfinite(ci)):
    return f"{v:.0%}"
  return f"{v:.0%} [{ci[0]:.0%}, {ci[1]:.0%}]"


def _pp(v: float, ci: tuple) -> str:
  if not all(np.isfinite(ci)):
    return f"{v * 100:+.0f} pp"
  return f"{v * 100:+.0f} pp [{ci[0] * 100:+.0f}, {ci[1] * 100:+.0f}]"


def _points(runs: list, cell: tuple) -> str:
  """The mean accuracy drop in points (100 × fraction of tokens), with a seed-level t CI."""
  drops = [acc_drop(r, cell) for r in runs]
  drops = [100 * d for d in drops if d is not None]
  if not drops:
    return "—"
  if len(drops) == 1:
    return f"{drops[0]:.1f}"
  e = res.seed_interval([np.array([d]) for d in drops])
  return f"{e.mean:.1f} [{e.lo:.1f}, {e.hi:.1f}]"


def table(gs: list[Group]) -> list[str]:
  out = [
    "| model | n | k1 | acc. at native K | acc. lost, k2 = k1 (pts) | acc. lost, k2 = K (pts) | "
    "kept by k2 = K, loss | kept by k2 = K, accuracy | accuracy − loss distance to 10% | "
    "best k2 (on loss) | kept by best k2, accuracy |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
  ]
  for g in gs:
    K = g.runs[0].top_k
    acc_native = [r.final_grid[(K, NATIVE)].get("accuracy") for r in g.runs]
    acc_native = [a for a in acc_native if a is not None]
    best = tables.best_k2(g.runs)
    for k1 in scale.SCALE_K1:
      k = kept(g.runs, k1)
      if k is None:
        continue
      b = best.get(k1)
      kb = kept(g.runs, k1, b[1]) if b and b[1] != NATIVE else None
      b_text = "—" if b is None else str(b[1])
      kb_text = "—" if kb is None else _pct(kb.acc, kb.acc_ci)
      if b and b[1] == K:
        kb_text = "as k2 = K"
      out.append(
        f"| {g.label} | {k.n_seeds} | {k1} | {np.mean(acc_native):.4f} | "
        f"{_points(g.runs, (k1, k1))} | {_points(g.runs, (k1, K))} | {_pct(k.loss, k.loss_ci)} | "
        f"{_pct(k.acc, k.acc_ci)} | {_pp(k.distance, k.distance_ci)}: {toward(k)} | "
        f"{b_text} | {kb_text} |"
      )
  return out


def summary(gs: list[Group]) -> list[str]:
  """Per model with at least two seeds, where the accuracy view is closer to or farther from
  the blog's 10% than the loss view (read off the distance CIs), then the count over rows."""
  out, count = [], {}
  for g in gs:
    if len(g.runs) < 2:
      continue
    said = {k1: toward(kept(g.runs, k1)) for k1 in scale.SCALE_K1}
    said = {k1: v for k1, v in said.items() if v != "not measured"}
    if not said:
      continue
    for v in said.values():
      count[v] = count.get(v, 0) + 1
    parts = "; ".join(f"k1 = {k1}: {v}" for k1, v in said.items())
    out.append(f"- {g.label}, n = {len(g.runs)}: {parts}.")
  if not out:
    return out
  total = sum(count.values())
  closer, farther = count.get("closer to 10%", 0), count.get("farther from 10%", 0)
  end = (
    f": the accuracy view does not move the study toward the blog's {BLOG:.0%}."
    if closer == 0
    else "."
  )
  out.append(
    f"- Of {total} (model, k1) rows with n ≥ 2, the accuracy view is closer to the blog's "
    f"{BLOG:.0%} than the loss view in {closer}, farther in {farther}, and the CI cannot "
    f"tell in {total - closer - farther}{end}"
  )
  return out


def grid_tokens(gs: list[Group]) -> int:
  """Held-out tokens behind each accuracy: eval.sequences × data.seq_len (0 without runs)."""
  if not gs:
    return 0
  c = gs[0].runs[0].config
  return int(c["eval"]["sequences"]) * int(c["data"]["seq_len"])


def statements(runs: dict) -> str:
  gs = groups(runs)
  head = (
    "**H10** (the kept fraction in top-1 accuracy beside the loss-based one: the share of the "
    "k2 = k1 loss that k2 = K keeps, (acc(native K) − acc(k2=K)) / (acc(native K) − "
    f"acc(k2=k1)) against Δ(k2=K) / Δ(k2=k1); the blog's figure is about {BLOG:.0%}, in MMLU "
    "points). `qwen3_moe` (renormalized). Each fraction is a ratio of means over the n seeds; "
    "CIs are percentile bootstraps drawing sequences and seeds for the loss, seeds only for "
    "the accuracy (the grid keeps one accuracy per cell, not per sequence, so that CI lacks "
    "the sequence term; with n = 2 it is the range of the two seeds' fractions, with n = 1 "
    "there is none). Accuracy points: the mean over seeds with a seed-level t CI. The "
    "distance column is |accuracy − 10%| − |loss − 10%| from the same draws (under 0: the "
    "accuracy view is closer to the blog). The best k2 is picked on loss (as in H1), never "
    "on accuracy. Factor F's d128 is factor A's seeds 0 and 1. Where under a point of "
    "accuracy is lost, a fraction is a ratio of differences of tens to hundreds of the "
    f"grid's {grid_tokens(gs):,} predicted tokens, and the accuracy CI's "
    "missing sequence term matters most."
  )
  if not gs:
    return head + "\n\n- not run yet.\n"
  return "\n".join([head, ""] + table(gs) + [""] + summary(gs)) + "\n"
