"""Tests build configs as ConfigDicts (the user-facing form); the code takes the typed
RunConfig (`moejax.config.resolve`) and DataConfig. These turn one into the other."""

from __future__ import annotations

from moejax import config
from moejax.config import RunConfig
from moejax.data.config import DataConfig


def as_run(c) -> RunConfig:
  """`c` resolved (a RunConfig passes through)."""
  return c if isinstance(c, RunConfig) else config.resolve(c)


def as_data(d) -> DataConfig:
  """A `data` section (ConfigDict or dict, all keys or some) as its DataConfig."""
  return d if isinstance(d, DataConfig) else DataConfig(**dict(d))
