"""`python -m moejax.evaluate --tasks ...`: checks that lm-eval is installed (the `eval` extra)
before anything imports it, then runs the task grid."""

from __future__ import annotations

import importlib.util

from moejax.errors import UserError

PIP = "pip install 'moejax[eval]'"


def lm_eval_installed() -> bool:
  try:
    return importlib.util.find_spec("lm_eval") is not None
  except (ImportError, ValueError):  # hidden by sys.modules["lm_eval"] = None
    return False


def run_tasks(workdir: str, tasks: str, **kw) -> None:
  """`moejax.downstream.grid.run_task_grid` (it prints each task's table)."""
  if not lm_eval_installed():
    raise UserError(f"--tasks needs lm-eval, the eval extra: {PIP}")
  from moejax.downstream.grid import run_task_grid  # pylint: disable=import-outside-toplevel

  run_task_grid(workdir, tasks, **kw)
