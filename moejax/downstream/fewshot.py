"""Few-shot prompts that pair: every cell of a task grid sees the same shots.

lm-eval draws a task's few-shot examples from the task's `Random`, which only
`simple_evaluate` seeds (`task.set_fewshot_seed(1234)`); the grid calls `evaluate` once per
cell on the same Task objects, so an unseeded sampler would carry on from cell to cell and
each cell would score different prompts. `seed` resets it before every cell, to lm-eval's
default unless `--fewshot_seed` says otherwise; `set_num_fewshot` is `--num_fewshot` (as
`simple_evaluate(num_fewshot=)`), refused when the few-shot split is too small.
"""

from __future__ import annotations

from moejax.errors import UserError

FEWSHOT_SEED = 1234  # lm-eval's `simple_evaluate(fewshot_random_seed=1234)`


def _split_size(task) -> int | None:
  """Documents of the split the task draws shots from (None: it has none)."""
  try:
    docs = task.fewshot_docs()
  except Exception:  # noqa: BLE001  lm-eval raises for a task without the split
    return None
  return None if docs is None else len(docs)


def set_num_fewshot(tasks: dict, n: int | None) -> None:
  """Each task's `num_fewshot`: `n` when given, else the task's own (0 when it names none)."""
  if n is not None and n < 0:
    raise UserError(f"--num_fewshot={n} is not allowed; use an int >= 0")
  for name, task in tasks.items():
    if n is None:
      if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
      continue
    if n > 0:
      size = _split_size(task)
      if size is None or size < n:
        split = task.get_config("fewshot_split") or task.get_config("training_split") or "none"
        have = "no few-shot split" if size is None else f"{size} documents in split {split!r}"
        raise UserError(
          f"--num_fewshot={n} is too many for task {name}: it has {have}; use at most "
          f"{size or 0} (or a task with a fewshot_split)"
        )
    task.set_config(key="num_fewshot", value=n)


def seed(tasks: dict, fewshot_seed: int) -> None:
  """Resets every task's few-shot sampler, so the next `evaluate` draws the same shots."""
  for task in tasks.values():
    task.set_fewshot_seed(seed=fewshot_seed)
