"""Imported runs are for evaluation and export: training on one is refused in one line.

An imported run's checkpoint holds step, params and router biases but no optimizer state
(`runstate.py`), and its config is a transformers architecture, not a training recipe. Its
config.json carries `resolved.hf_import`; the trainer calls `refuse_training` on the saved
config before it resumes.
"""

from __future__ import annotations

from moejax.errors import UserError


def imported_from(saved: dict | None) -> str | None:
  """The transformers checkpoint a run was imported from, or None for a trained run."""
  info = (saved or {}).get("resolved", {}).get("hf_import")
  return info.get("source", "?") if isinstance(info, dict) else None


def refuse_training(saved: dict | None, path: str) -> None:
  """A UserError when the run at `path` (its config.json) was imported, not trained."""
  source = imported_from(saved)
  if source is not None:
    raise UserError(
      f"{path} is a run imported from {source}: imported runs are for evaluation "
      "(python -m moejax.evaluate) and export (python -m moejax.hf export), not training; "
      "use a new --workdir"
    )
