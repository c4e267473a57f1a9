"""Tests build configs as ConfigDicts (the user-facing form); the code takes the typed
RunConfig (`moejax.config.resolve`) and DataConfig. These turn one into the other."""

from __future__ import annotations

import dataclasses

from moejax import config
from moejax.config import RunConfig
from moejax.data.config import DataConfig
from moejax.config.sections import EvalConfig
from moejax.errors import UserError
from moejax.kgrid.loading import load_config


def as_run(c) -> RunConfig:
  """`c` resolved (a RunConfig passes through)."""
  return c if isinstance(c, RunConfig) else config.resolve(c)


def as_data(d) -> DataConfig:
  """A `data` section (ConfigDict or dict, all keys or some, the rest their defaults) as its
  DataConfig; an unknown key is the UserError `config.resolve` gives it."""
  if isinstance(d, DataConfig):
    return d
  names = {f.name for f in dataclasses.fields(DataConfig)}
  for key in dict(d):
    if key not in names:
      raise UserError(f"unknown config key data.{key}; see docs/config.md for the keys")
  return DataConfig(**dict(d))


def saved_eval(workdir: str, **keys) -> EvalConfig:
  """A trained run's saved `eval.*` with `keys` set over it (as `moejax.evaluate`'s flags
  are), for `run_grid`."""
  return dataclasses.replace(load_config(workdir).eval, **keys)
