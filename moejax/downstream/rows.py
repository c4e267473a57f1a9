"""The task grid's rows: per-item outcomes from lm-eval's samples, and one row per cell
against the reference cell (exact McNemar, paired bootstrap, Holm: `moejax.stats`)."""

from __future__ import annotations

import numpy as np

from moejax import stats
from moejax.errors import UserError

ROW_KEYS = (
  "k1", "k2", "accuracy", "delta_points", "flips_to_wrong", "flips_to_right", "mcnemar_p",
  "delta_ci95", "p_holm", "n_items",
)  # fmt: skip


def outcomes(samples: list[dict]) -> list[dict]:
  """Per item, in doc order: doc_id, correct (lm-eval's `acc`), loglik of the gold choice."""
  out = []
  for s in sorted(samples, key=lambda s: s["doc_id"]):
    if "acc" not in s:
      raise UserError(f"task item {s['doc_id']}: lm-eval reports no per-item `acc` for it")
    gold, resps = s["target"], s["filtered_resps"]
    ll = float(resps[gold][0]) if isinstance(gold, int) and gold < len(resps) else float("nan")
    out.append({"doc_id": int(s["doc_id"]), "correct": int(bool(s["acc"])), "loglik_gold": ll})
  return out


def task_rows(cells, items: dict, *, resamples: int, seed: int) -> list[dict]:
  """One row per cell from {cell: outcomes}; the first cell is the reference."""
  ref = np.array([o["correct"] for o in items[cells[0]]])
  rows = []
  for cell in cells:
    d = stats.accuracy_delta(
      [o["correct"] for o in items[cell]], ref, n_resamples=resamples, seed=seed
    )
    rows.append(dict(zip(("k1", "k2"), cell), **(d._asdict() | {"delta_ci95": list(d.delta_ci95)})))
  adjusted = stats.holm([r["mcnemar_p"] for r in rows[1:]]) if len(rows) > 1 else []
  for r, p in zip(rows, [1.0, *adjusted]):
    r["p_holm"] = float(p)
  return [
    {k: r[k] for k in ROW_KEYS} | {"loglik_gold": _mean_ll(items[c])} for r, c in zip(rows, cells)
  ]


def _mean_ll(items: list[dict]) -> float:
  return float(np.mean([o["loglik_gold"] for o in items]))
