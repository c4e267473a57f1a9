"""The task grid's rows: per-item outcomes from lm-eval's samples, and one row per cell and
(metric, filter) against the reference cell (exact McNemar, paired bootstrap, Holm:
`moejax.stats`).

A multiple-choice or log-likelihood task's items are scored by `acc` under lm-eval's filter
`none`, and carry the gold choice's log-likelihood; a generation task's (`generate_until`,
GSM8K) by `exact_match` under each of its filters (`strict-match`, `flexible-extract`), and
carry the filtered response. Every item carries lm-eval's `prompt_hash` of its context, and
cells pair only on identical prompts (`check_paired`).
"""

from __future__ import annotations

import numpy as np

from moejax import stats
from moejax.errors import UserError

ROW_KEYS = (
  "k1", "k2", "metric", "filter", "accuracy", "delta_points", "flips_to_wrong",
  "flips_to_right", "mcnemar_p", "delta_ci95", "p_holm", "n_items",
)  # fmt: skip
METRICS = ("acc", "exact_match")  # the per-item 0/1 metric a row scores, by task kind


def _metric(s: dict) -> str:
  for m in METRICS:
    if m in s:
      return m
  raise UserError(
    f"task item {s['doc_id']}: lm-eval reports none of {', '.join(METRICS)} for it per item"
  )


def _outcome(s: dict) -> dict:
  metric = _metric(s)
  o = {"doc_id": int(s["doc_id"]), "filter": str(s.get("filter", "none")), "metric": metric,
       "correct": int(float(s[metric]) >= 1.0), "prompt_hash": str(s.get("prompt_hash", ""))}  # fmt: skip
  resps = s["filtered_resps"]
  if metric == "acc":
    gold = s["target"]
    ok = isinstance(gold, int) and gold < len(resps)
    o["loglik_gold"] = float(resps[gold][0]) if ok else float("nan")
  else:
    o["response"] = str(resps[0]) if isinstance(resps, list | tuple) and resps else str(resps)
  return o


def outcomes(samples: list[dict]) -> list[dict]:
  """Per item and filter, in (filter, doc) order: doc_id, filter, metric, correct, the prompt
  hash, and loglik_gold (multiple choice) or response (generation)."""
  out = [_outcome(s) for s in samples]
  return sorted(out, key=lambda o: (o["filter"], o["doc_id"]))


def check_paired(cells, items: dict, task: str) -> None:
  """Every cell scored the reference cell's items on the same prompts (lm-eval's
  `prompt_hash` of each item's context), or a UserError: a paired test needs pairs."""
  key = lambda o: (o["filter"], o["doc_id"])
  ref = {key(o): o["prompt_hash"] for o in items[cells[0]]}
  for cell in cells[1:]:
    got = {key(o): o["prompt_hash"] for o in items[cell]}
    differ = sorted(d for d in ref if got.get(d) != ref[d])
    if differ or set(got) != set(ref):
      first = differ[0][1] if differ else "?"
      raise UserError(
        f"task {task}: cell {cell} scored {len(differ)} items on other prompts than the "
        f"reference cell {cells[0]} (first doc_id {first}); cells pair only on identical "
        "prompts (the few-shot draws are seeded: --fewshot_seed)"
      )


def groups(outs: list[dict]) -> list[tuple[str, str]]:
  """The (metric, filter) pairs of a cell's outcomes, in order of appearance."""
  return list(dict.fromkeys((o["metric"], o["filter"]) for o in outs))


def task_rows(cells, items: dict, *, resamples: int, seed: int) -> list[dict]:
  """One row per (metric, filter) and cell from {cell: outcomes}; the first cell is the
  reference; Holm runs over each (metric, filter)'s cells but the reference."""
  rows = []
  for metric, filt in groups(items[cells[0]]):
    part = {c: [o for o in items[c] if (o["metric"], o["filter"]) == (metric, filt)] for c in cells}
    rows += [dict(r, metric=metric, filter=filt) for r in _group_rows(cells, part, resamples, seed)]
  return [{k: r[k] for k in ROW_KEYS} | {"loglik_gold": r["loglik_gold"]} for r in rows]


def _group_rows(cells, items: dict, resamples: int, seed: int) -> list[dict]:
  ref = np.array([o["correct"] for o in items[cells[0]]])
  rows = []
  for cell in cells:
    d = stats.accuracy_delta(
      [o["correct"] for o in items[cell]], ref, n_resamples=resamples, seed=seed
    )
    rows.append(dict(zip(("k1", "k2"), cell), **(d._asdict() | {"delta_ci95": list(d.delta_ci95)})))
  adjusted = stats.holm([r["mcnemar_p"] for r in rows[1:]]) if len(rows) > 1 else []
  for r, p, c in zip(rows, [1.0, *adjusted], cells):
    r["p_holm"] = float(p)
    r["loglik_gold"] = _mean_ll(items[c])
  return rows


def _mean_ll(items: list[dict]) -> float:
  lls = [o["loglik_gold"] for o in items if "loglik_gold" in o]
  return float(np.mean(lls)) if lls else float("nan")
