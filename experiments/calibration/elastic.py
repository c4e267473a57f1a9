"""H6–H8: factor E (elastic-k training, `model.moe.train_k*`), each verdict read mechanically
off a seed-level 95% CI (`results.seed_interval`), models paired by seed and sequence.

The recipes are `sweep.py`'s RECIPES: `uniform` (k drawn per layer from {1..K}, the rule's own
normalization over the k used), `uniform_k2topk` (the same, divided by the top-K score mass),
`token` (a draw per token) and `fixed_k2` (trained at K = 2, the Matryoshka MoE reference:
Wang et al., arXiv 2509.26520). The fixed-K models are factor A's.
"""

from __future__ import annotations

from typing import NamedTuple

import hypotheses
import numpy as np
import results as res

NATIVE = res.NATIVE
ELASTIC = ("uniform", "uniform_k2topk", "token")  # the recipes trained at many k
H6_RECIPES = ("uniform", "token")  # elastic with the rule's own renormalization
RENORMALIZED = "qwen3_moe"
REFERENCE = "fixed_k2"
COST_NATS = 0.01  # H7: the most an elastic model may lose at k1 = K
BENEFIT_K1 = (4, 2, 1)  # H8
REFERENCE_K1 = 2  # fixed_k2's K


class Study(NamedTuple):
  fixed: dict[str, list]  # rule -> factor-A runs (trained at fixed K)
  elastic: dict[tuple, list]  # (recipe, rule) -> factor-E runs, [] where none finished


def _fmt(e: res.Estimate | None, full: bool = False) -> str:
  if e is None:
    return "—"
  return e.full() if full else e.fmt()


def _loss(runs: list, cell: tuple) -> str:
  """Mean held-out loss over the runs and how many seeds it stands on (the verdicts use the
  paired differences' CIs)."""
  p = point(runs, cell)
  return "—" if p is None else f"{p.mean:.4f} (n={p.n_seeds})"


def _with_n(e: res.Estimate | None) -> str:
  """`fmt` and the seeds behind it."""
  if e is None:
    return "—"
  return f"{e.fmt()} ({'1 seed' if e.n_seeds == 1 else f'n={e.n_seeds}'})"


def _contrast_did(elastic: list, fixed: list, cell: tuple, against: tuple):
  """Per seed: (cell − against) of the elastic model minus the same of the fixed-K model."""
  diffs = []
  for e, f in zip(*res.pair_by_seed(elastic, fixed)):
    de = res.paired_diffs(e.final_grid, cell, against)
    df = res.paired_diffs(f.final_grid, cell, against)
    if de is not None and df is not None:
      diffs.append(de - df)
  return res.seed_interval(diffs) if diffs else None


def h6_verdict(c: res.Estimate | None) -> str:
  said = hypotheses.verdict(c, "k2 = K still beats k2 = k1", "reversed: k2 = k1 beats k2 = K")
  if c is None:
    return said
  return f"{said} (H6 {'fails' if c.hi < 0 else 'holds'})"


def h6(study: Study) -> list[str]:
  out = [
    (
      "**H6** (the causal test: with elastic renormalized training, k2 = K no longer beats "
      "k2 = k1 at k1 < K; Δ(k2=K) − Δ(k2=k1), against fixed-K training's value and the "
      "difference of the two, paired by seed):"
    )
  ]
  fixed = study.fixed.get(RENORMALIZED, [])
  for recipe in H6_RECIPES:
    runs = study.elastic.get((recipe, RENORMALIZED))
    if not runs:
      out.append(f"- {recipe} {RENORMALIZED}: not run yet.")
      continue
    K = runs[0].top_k
    for k1 in sorted({a for (a, _) in runs[0].final_grid if a < K}, reverse=True):
      cell, against = (k1, K), (k1, k1)
      c = res.estimate(runs, cell, against=against)
      ref = res.estimate(fixed, cell, against=against) if fixed else None
      did = _contrast_did(runs, fixed, cell, against)
      out.append(
        f"- {recipe} {RENORMALIZED}, k1 = {k1}: {_fmt(c, True)}: {h6_verdict(c)}. Fixed K "
        f"(factor A): {_with_n(ref) if ref else 'not run yet'}; elastic − fixed {_fmt(did, True)}."
      )
  return out


def h7_verdict(c: res.Estimate | None) -> str:
  if c is None:
    return "not measured"
  if c.hi < COST_NATS:
    return f"costs under {COST_NATS} nats (H7 holds)"
  if c.lo >= COST_NATS:
    return f"costs {COST_NATS} nats or more (H7 fails)"
  return f"CI includes {COST_NATS}: undecided"


def h7(study: Study) -> list[str]:
  out = [
    (
      f"**H7** (the cost: an elastic model loses less than {COST_NATS} nats at k1 = K against "
      "the fixed-K model of the same rule; held-out loss at native k1 = K, paired by seed):"
    )
  ]
  for (recipe, rule), runs in study.elastic.items():
    if recipe not in ELASTIC:
      continue
    fixed = study.fixed.get(rule, [])
    if not runs or not fixed:
      out.append(f"- {recipe} {rule}: not run yet.")
      continue
    e, f = res.pair_by_seed(runs, fixed)
    cell = (runs[0].top_k, NATIVE)
    c = res.between(e, cell, f, cell)
    out.append(
      f"- {recipe} {rule}: elastic {_loss(e, cell)}, fixed K {_loss(f, cell)}; "
      f"elastic − fixed {_fmt(c, True)}: {h7_verdict(c)}."
    )
  return out


def best_fix(runs: list, k1: int) -> tuple | None:
  """The fixed-K model's cell at k1 with the lowest seed-level mean loss over every k2
  (native, integers, sqrt, gain); chosen on the same held-out data, so optimistic."""
  cells = [(k1, k2) for k2 in res.k2_choices(runs[0].final_grid, k1)]
  losses = {c: point(runs, c) for c in cells}
  losses = {c: p.mean for c, p in losses.items() if p is not None}
  return min(losses, key=losses.get) if losses else None


def benefit_verdict(c: res.Estimate | None, other: str) -> str:
  return hypotheses.verdict(c, "the elastic model is lower", f"{other} is lower")


def h8_lines(recipe: str, rule: str, runs: list, study: Study) -> list[str]:
  fixed = study.fixed.get(rule, [])
  out = []
  for k1 in BENEFIT_K1:
    cell = (k1, NATIVE)
    if cell not in runs[0].final_grid:
      continue
    e, f = res.pair_by_seed(runs, fixed)
    fix = best_fix(f, k1) if f else None
    if fix is None:
      out.append(f"- {recipe} {rule}, k1 = {k1}: fixed K not run yet.")
      continue
    c = res.between(e, cell, f, fix)
    line = (
      f"- {recipe} {rule}, k1 = {k1}: elastic {_loss(e, cell)}; fixed K with its best fix "
      f"(k2 = {fix[1]}) {_loss(f, fix)}; elastic − fixed "
      f"{_fmt(c, True)}: {benefit_verdict(c, 'fixed K + best fix')}."
    )
    if k1 == REFERENCE_K1:
      line += " " + reference_text(runs, study.elastic.get((REFERENCE, rule), []))
    out.append(line)
  return out


def reference_text(runs: list, reference: list) -> str:
  """At k1 = 2: the elastic model against the model trained at K = 2 (its native cell)."""
  e, r = res.pair_by_seed(runs, reference)
  if not r:
    return "Trained at K = 2: not run yet."
  cell = (REFERENCE_K1, NATIVE)
  c = res.between(e, cell, r, cell)
  return (
    f"Trained at K = 2 {_loss(r, cell)}; elastic − K = 2 {_fmt(c, True)}: "
    f"{benefit_verdict(c, 'the K = 2 model')}."
  )


def h8(study: Study) -> list[str]:
  out = [
    (
      f"**H8** (the benefit: held-out loss at k1 = {', '.join(map(str, BENEFIT_K1))} of each "
      "elastic model at its native cell, against the fixed-K model with its best post-hoc fix, "
      f"and at k1 = {REFERENCE_K1} against the model trained at K = {REFERENCE_K1}; paired by "
      "seed):"
    )
  ]
  for (recipe, rule), runs in study.elastic.items():
    if recipe in ELASTIC:
      out += h8_lines(recipe, rule, runs, study) if runs else [f"- {recipe} {rule}: not run yet."]
  return out


def statements(study: Study) -> str:
  return "\n".join(h6(study) + [""] + h7(study) + [""] + h8(study) + [""])


class Point(NamedTuple):
  """One point of loss_vs_active.png: the mean over seeds and the range of the seed means."""

  k1: int
  mean: float
  lo: float
  hi: float
  n_seeds: int


def point(runs: list, cell: tuple | None) -> Point | None:
  means = [x.mean() for x in (res.cell_losses(r, cell) for r in runs) if x is not None]
  if cell is None or not means:
    return None
  return Point(cell[0], float(np.mean(means)), min(means), max(means), len(means))


def curves(study: Study, rule: str) -> dict[str, list[Point]]:
  """Held-out loss against k1 for each training recipe of `rule` (loss_vs_active.png)."""
  out = {}
  fixed = study.fixed.get(rule)
  if fixed:
    K, k1s = fixed[0].top_k, sorted({a for (a, _) in fixed[0].final_grid})
    out[f"fixed K={K}"] = [point(fixed, (k1, NATIVE)) for k1 in k1s]
    out[f"fixed K={K} + best fix"] = [point(fixed, best_fix(fixed, k1)) for k1 in k1s]
  for (recipe, r), runs in study.elastic.items():
    if r == rule and runs:
      k1s = sorted({a for (a, _) in runs[0].final_grid})
      label = f"fixed K={runs[0].top_k}" if recipe == REFERENCE else f"elastic {recipe}"
      out[label] = [point(runs, (k1, NATIVE)) for k1 in k1s]
  return {name: [p for p in pts if p is not None] for name, pts in out.items()}
