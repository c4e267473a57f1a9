"""lm-eval tasks by name or YAML path, checked before any model is loaded or file written."""

from __future__ import annotations

import os

from lm_eval.tasks import TaskManager

from moejax.downstream import task_files
from moejax.errors import UserError

# tasks whose items have an `acc` (scored) or an `exact_match` (generated)
SCORED_TYPES = ("multiple_choice", "loglikelihood", "generate_until")


def parse_names(spec: str) -> list[str]:
  names = [t.strip() for t in (spec or "").split(",") if t.strip()]
  if not names:
    raise UserError("--tasks: give one or more task names or YAML files, comma-separated")
  return names


def load_tasks(spec: str, include_path: str | None = None) -> dict:
  """{task name: lm-eval Task} of `--tasks` (names lm-eval knows, or YAML files)."""
  if include_path and not os.path.isdir(include_path):
    raise UserError(f"--include_path {include_path}: not a directory")
  managers: dict[bool, TaskManager] = {}

  def manager(defaults: bool) -> TaskManager:  # lm-eval's own ~14k YAMLs take a while to index
    if defaults not in managers:
      managers[defaults] = TaskManager(include_path=include_path or None, include_defaults=defaults)
    return managers[defaults]

  tasks: dict = {}
  for name in parse_names(spec):
    is_file = name.endswith((".yaml", ".yml"))
    if is_file and not os.path.isfile(name):
      raise UserError(f"--tasks {name}: no such file")
    if is_file:
      task_files.check_data_files(name, name)
    try:
      local = is_file or (include_path and name in manager(False).all_tasks)
      loaded = manager(not local).load(name)["tasks"]
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001  lm-eval raises many kinds (yaml, KeyError, ...)
      raise UserError(_load_error(e, name, is_file, include_path)) from None
    for task_name, task in loaded.items():
      kind = task.OUTPUT_TYPE
      if kind == "loglikelihood_rolling":
        raise UserError(
          f"--tasks {name}: task {task_name} is a perplexity (loglikelihood_rolling) task; the "
          "task grid pairs per-item right/wrong outcomes, which it has none of: its k1:k2 view "
          "is the loss grid (python -m moejax.evaluate --workdir DIR, without --tasks)"
        )
      if kind not in SCORED_TYPES:
        raise UserError(
          f"--tasks {name}: task {task_name} is a {kind} task; moejax's grid scores "
          f"{', '.join(SCORED_TYPES)} tasks"
        )
      tasks[task_name] = task
  return tasks


def _load_error(e: Exception, name: str, is_file: bool, include_path: str | None) -> str:
  """One line for a task lm-eval could not load: the Hub offline, a YAML under
  --include_path that does not parse, or the root cause of what lm-eval wrapped."""
  offline = task_files.offline_hint(e, name)
  if offline:
    return offline
  cause = task_files.root_cause(e)
  if is_file:
    return f"--tasks {name}: task file does not parse or its dataset cannot be built: {cause}"
  broken = task_files.broken_yamls(include_path) if include_path else []
  if broken:
    path, why = broken[0]
    return f"--tasks {name}: unknown task; --include_path YAML {path} does not parse: {why}"
  hint = " (a name lm-eval knows, a YAML file, or --include_path DIR)"
  return f"--tasks {name}: unknown task{hint}: {cause}"
