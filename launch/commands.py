"""The command lines of one run, shared by every backend (INTERFACES.md, Sweeps).

Train: `python -m moejax.train --config CONFIG --workdir DIR --config.k=v ...` with the
sweep's wandb group, the run's factors as tags and its name as the wandb name; then
`python -m moejax.evaluate --workdir DIR` (final grid) and `... --step N` per grid step.
"""

from __future__ import annotations

import posixpath

from launch.spec import RunSpec, Sweep


def run_dir(root: str, sweep: Sweep, run: RunSpec) -> str:
  """`<root>/<sweep>/<run>`; posix joins so `gs://bucket/x` roots stay URLs."""
  return posixpath.join(root.rstrip("/"), sweep.name, run.name)


def tags(run: RunSpec) -> str:
  """The factors as comma-separated `key:value` wandb tags."""
  return ",".join(f"{k}:{v}" for k, v in run.factors.items())


def format_value(value: object) -> str:
  """A config override value as ml_collections parses it from the command line."""
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def overrides(sweep: Sweep, run: RunSpec) -> dict[str, object]:
  """The launcher's keys, then the run's own overrides (which win). The grids are separate
  commands, so training does not also run one (`eval.after_train`)."""
  launcher = {
    "wandb.group": sweep.name,
    "wandb.tags": tags(run),
    "wandb.name": run.name,
    "eval.after_train": False,
  }
  return launcher | dict(run.overrides)


def compile_cache(workdir: str) -> str:
  """`<root>/<sweep>/xla_cache`: one persistent compilation cache for a sweep's runs."""
  return posixpath.join(posixpath.dirname(workdir.rstrip("/")), "xla_cache")


def train_argv(sweep: Sweep, run: RunSpec, workdir: str, python: str = "python") -> list[str]:
  """The train command; every run of a sweep shares its compile cache (a run may set its own)."""
  values = {"train.compile_cache": compile_cache(workdir)} | overrides(sweep, run)
  flags = [f"--config.{k}={format_value(v)}" for k, v in values.items()]
  return [python, "-m", "moejax.train", "--config", run.config, "--workdir", workdir, *flags]


def eval_argvs(run: RunSpec, workdir: str, python: str = "python") -> list[list[str]]:
  """The final grid first, then one grid per extra step."""
  base = [python, "-m", "moejax.evaluate", "--workdir", workdir]
  return [base] + [base + ["--step", str(step)] for step in run.grid_steps]


def grid_files(run: RunSpec) -> list[str]:
  """The grid outputs (relative to a run dir) whose presence makes a run complete."""
  return ["eval/k_grid.jsonl"] + [f"eval/step{s}/k_grid.jsonl" for s in run.grid_steps]
