"""What a sweep is: named runs (config + overrides + factors), loaded from `sweep.py` files.

A sweep file `experiments/<name>/sweep.py` defines `get_sweep() -> Sweep`; `product` forms
the cartesian product of factor axes (rules × seeds × ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re

from moejax import cli
from moejax.errors import UserError

NAME_RE = re.compile(r"^[a-z0-9_-]+$")


@dataclasses.dataclass(frozen=True)
class RunSpec:
  name: str  # stable, unique within the sweep, [a-z0-9_-]
  config: str  # config file path (may include ':arg')
  overrides: dict[str, object]  # {"model.moe.rule": "olmoe", "train.seed": 1}
  factors: dict[str, object]  # wandb tags / grouping
  grid_steps: tuple[int, ...] = ()  # extra checkpoints to grid besides the final one
  compute: str | None = None  # name of a compute preset (sky backend)


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str
  runs: list[RunSpec]
  results: str | None = None  # repo folder where finished runs' results are copied
  compute: dict[str, dict] = dataclasses.field(default_factory=dict)  # sky presets


def product(**axes) -> list[dict]:
  """The cartesian product of axis values, as dicts in axis order: product(a=[1, 2], b="xy")
  -> [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]."""
  names = list(axes)
  return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def validate(sweep: Sweep, source: str = "sweep") -> Sweep:
  """Raises a one-line UserError for a bad sweep name, run name, duplicate or preset."""
  if not isinstance(sweep, Sweep):
    raise UserError(f"{source}: get_sweep() returned {type(sweep).__name__}; return a Sweep")
  if not NAME_RE.match(sweep.name):
    raise UserError(f"{source}: sweep name {sweep.name!r} is not allowed; use [a-z0-9_-]+")
  if not sweep.runs:
    raise UserError(f"{source}: sweep {sweep.name!r} has no runs")
  seen = set()
  for run in sweep.runs:
    if not NAME_RE.match(run.name):
      raise UserError(f"{source}: run name {run.name!r} is not allowed; use [a-z0-9_-]+")
    if run.name in seen:
      raise UserError(f"{source}: run name {run.name!r} appears twice; names must be unique")
    seen.add(run.name)
    if run.compute is not None and run.compute not in sweep.compute:
      raise UserError(
        f"{source}: run {run.name!r} uses compute preset {run.compute!r}; "
        f"defined presets: {', '.join(sweep.compute) or 'none'}"
      )
    if any(s < 1 for s in run.grid_steps):
      raise UserError(f"{source}: run {run.name!r} grid_steps {run.grid_steps} must be >= 1")
  return sweep


def load(path: str) -> Sweep:
  """Imports a sweep file and returns its validated `get_sweep()`."""
  if not os.path.isfile(path):
    raise UserError(
      f"sweep file {path}: {cli.not_a_file(path)}; pass a file defining get_sweep(), e.g. "
      "experiments/<name>/sweep.py"
    )
  module = cli.exec_file(path, "sweep file", "_moejax_sweep")
  if not callable(getattr(module, "get_sweep", None)):
    raise UserError(f"{path} defines no get_sweep(); it must return a launch.spec.Sweep")
  return validate(cli.call_file(path, "sweep file", module.get_sweep), path)


def select(sweep: Sweep, only: str) -> list[RunSpec]:
  """The runs named in the comma-separated `only` (all runs when empty)."""
  if not only:
    return list(sweep.runs)
  names = [n for n in only.split(",") if n]
  known = {r.name for r in sweep.runs}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise UserError(f"--only {','.join(unknown)}: no such run; runs: {', '.join(sorted(known))}")
  return [r for r in sweep.runs if r.name in names]
