"""The task grid's files: k_grid.{jsonl,md,png} and each cell's per-item outcomes."""

from __future__ import annotations

import json
import os
import re

from moejax import runio
from moejax.kgrid import report as grid_report

COLUMNS = (  # markdown: (header, row key, format)
  ("accuracy", "accuracy", ".4f"),
  ("Δ points", "delta_points", "+.2f"),
  ("flips → wrong", "flips_to_wrong", "d"),
  ("flips → right", "flips_to_right", "d"),
  ("McNemar p", "mcnemar_p", ".3g"),
  ("Holm p", "p_holm", ".3g"),
  ("n", "n_items", "d"),
)


def task_dir(workdir: str, task: str) -> str:
  """DIR/eval/tasks/<task>/ (the task name made safe for a folder name)."""
  return os.path.join(workdir, "eval", "tasks", re.sub(r"[^A-Za-z0-9_.-]", "_", task))


def items_name(k1: int, k2) -> str:
  return f"items_k1_{k1}_k2_{k2}.jsonl"


def markdown(rows: list[dict], title: str, *, n_experts: int, score: str) -> str:
  """One table per (metric, filter), a line per cell: the columns above and Δ's paired-
  bootstrap CI; `*`: Holm p < 0.05."""
  lines = [
    f"# {title}",
    "",
    "Δ points = 100 · (score − score at k1=K native), on the same items and prompts; flips",
    "count the items right at native k1=K and wrong here (→ wrong) and the reverse (→ right);",
    "McNemar p is the exact test on those; the CI is a paired bootstrap over items; Holm",
    "adjusts p across the grid's cells. `*`: Holm p < 0.05.",
  ]
  for metric, filt in dict.fromkeys((r["metric"], r["filter"]) for r in rows):
    part = [r for r in rows if (r["metric"], r["filter"]) == (metric, filt)]
    lines += ["", f"## {metric}, filter {filt}", ""] + _table(part, n_experts, score)
  return "\n".join(lines) + "\n"


def _table(rows: list[dict], n_experts: int, score: str) -> list[str]:
  lines = [
    "| k1 | k2 | " + " | ".join(h for h, _, _ in COLUMNS) + " | Δ 95% CI |",
    "|---:|---|" + "---:|" * len(COLUMNS) + "---|",
  ]
  for r in rows:
    label = grid_report.k2_label(r["k2"], n_experts=n_experts, score=score)
    vals = [format(r[key], spec) for _, key, spec in COLUMNS]
    vals[1] += "*" if r["p_holm"] < grid_report.SIG_P else ""
    lo, hi = r["delta_ci95"]
    lines.append(f"| {r['k1']} | {label} | " + " | ".join(vals) + f" | [{lo:+.2f}, {hi:+.2f}] |")
  return lines


def write(out_dir: str, rows: list[dict], items: dict, *, title: str, n_experts: int, score: str):
  """Writes the grid of one task into `out_dir` (local or gs://); `items`: {cell: [dict]}."""
  with runio.local_dir(out_dir) as out:
    runio.write_text(os.path.join(out, "k_grid.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    md = markdown(rows, title, n_experts=n_experts, score=score)
    runio.write_text(os.path.join(out, "k_grid.md"), md)
    for (k1, k2), outcomes in items.items():
      body = "".join(json.dumps(o) + "\n" for o in outcomes)
      runio.write_text(os.path.join(out, items_name(k1, k2)), body)
    first = (rows[0]["metric"], rows[0]["filter"])  # the heatmap: the first (metric, filter)
    heat = [dict(r, delta=r["delta_points"], p_value=r["p_holm"]) for r in rows
            if (r["metric"], r["filter"]) == first]  # fmt: skip
    label = f"Δ {first[0]} (points, filter {first[1]})"
    kw = {"title": title, "n_experts": n_experts, "score": score, "label": label}
    grid_report.write_heatmap(heat, os.path.join(out, "k_grid.png"), **kw)
