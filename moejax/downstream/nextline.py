"""`nextline`: a held-out multiple-choice task made from a run's corpus (lm-eval YAML + JSONL).

Each item's context is the end of a held-out document up to a line break (whole lines, at
most `context_chars` characters); the gold choice is the document's next line; each
distractor is a line of another held-out document cut to the gold's length (same number of
characters, no line break). Items are drawn in a seeded order and deduplicated on (context,
gold); the gold's position among the choices is drawn too. Only held-out documents
(`data.holdout_fraction`, `data.split_seed`: the trainer's own split) are read, so no item
was seen in training.
"""

from __future__ import annotations

import json
import os
import random
from typing import NamedTuple

from moejax import runio
from moejax.data.config import DataConfig
from moejax.data.corpora import load_corpus
from moejax.data.pipeline import heldout_mask
from moejax.errors import UserError

TASK = "nextline"
MAX_DRAWS = 200  # distractor draws per item before it is skipped


class Spec(NamedTuple):
  items: int = 500
  choices: int = 4
  context_chars: int = 256
  seed: int = 0


def check(spec: Spec) -> None:
  for name, low in (("items", 1), ("choices", 2), ("context_chars", 1)):
    if getattr(spec, name) < low:
      raise UserError(f"--{name}={getattr(spec, name)} is not allowed; use an int >= {low}")


def _context(lines: list[str], j: int, context_chars: int) -> str:
  """Whole lines before line j (at least one), at most context_chars characters if possible."""
  start = j - 1
  while start > 0 and len("\n".join(lines[start - 1 : j])) + 1 <= context_chars:
    start -= 1
  return "\n".join(lines[start:j]) + "\n"


def build_items(docs: list[str], spec: Spec) -> list[dict]:
  """The task's items from the held-out `docs` (see the module docstring)."""
  check(spec)
  rng = random.Random(f"moejax-nextline-{spec.seed}")
  lines_D = [d.split("\n") for d in docs]
  all_lines = [(d, line) for d, lines in enumerate(lines_D) for line in lines if line.strip()]
  points = [
    (d, j) for d, lines in enumerate(lines_D) for j in range(1, len(lines)) if lines[j].strip()
  ]
  rng.shuffle(points)
  items, seen = [], set()
  for d, j in points:
    if len(items) == spec.items:
      break
    gold = lines_D[d][j]
    context = _context(lines_D[d], j, spec.context_chars)
    if (context, gold) in seen:
      continue
    picked: list[str] = []
    for _ in range(MAX_DRAWS):
      d2, line = all_lines[rng.randrange(len(all_lines))]
      cand = line[: len(gold)]
      if d2 != d and len(line) >= len(gold) and cand != gold and cand not in picked:
        picked.append(cand)
        if len(picked) == spec.choices - 1:
          break
    if len(picked) < spec.choices - 1:
      continue
    seen.add((context, gold))
    at = rng.randrange(spec.choices)
    choices = picked[:at] + [gold] + picked[at:]
    items.append({"id": len(items), "context": context, "choices": choices, "gold": at})
  if len(items) < spec.items:
    raise UserError(
      f"--items={spec.items}: the held-out documents give only {len(items)} distinct items; "
      "ask for fewer, or raise data.holdout_fraction"
    )
  return items


def task_yaml(jsonl: str) -> str:
  """An lm-eval task reading `jsonl` (`dataset_path: json`, `data_files`)."""
  return "\n".join([
    f"task: {TASK}",
    "dataset_path: json",
    "dataset_kwargs:",
    "  data_files:",
    f"    test: {json.dumps(os.path.abspath(jsonl))}",
    "test_split: test",
    "output_type: multiple_choice",
    "doc_to_text: context",
    "doc_to_choice: choices",
    "doc_to_target: gold",
    'target_delimiter: ""',
    "metric_list:",
    "  - metric: acc",
    "    aggregation: mean",
    "    higher_is_better: true",
    "",
  ])  # fmt: skip


def heldout_docs(data_cfg: DataConfig) -> list[str]:
  """The held-out documents of the trainer's split, in corpus order."""
  if data_cfg.prepared:
    raise UserError("data.prepared: nextline reads the documents; give the unprepared config")
  docs, _ = load_corpus(data_cfg)
  held_N = heldout_mask(docs, data_cfg.holdout_fraction, data_cfg.split_seed)
  return [d for d, h in zip(docs, held_N) if h]


def write_task(data_cfg: DataConfig, out_dir: str, spec: Spec) -> tuple[str, int]:
  """Writes out_dir/nextline.{jsonl,yaml}; returns (the YAML's path, items)."""
  items = build_items(heldout_docs(data_cfg), spec)
  jsonl = os.path.join(out_dir, f"{TASK}.jsonl")
  runio.write_text(jsonl, "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
  yaml = os.path.join(out_dir, f"{TASK}.yaml")
  runio.write_text(yaml, task_yaml(jsonl))
  return yaml, len(items)
