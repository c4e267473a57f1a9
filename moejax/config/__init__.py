"""The run configuration: every key's metadata (`moejax.schema`, below this package), every section a typed, frozen
dataclass (`sections`, and the builders' own: ModelConfig, MoEConfig, LossConfig, DataConfig),
`base_config()` written from them (`defaults`), `reader.resolve` (the one reader of a
ConfigDict: it checks every key and builds the typed `RunConfig`), the checks that span
sections (`checks`, the k-grid's `eval.k1`/`eval.k2` labels among them, parsed by
`grid_labels`) and the keys' table (`table`, docs/config.md).

This file imports nothing: the modules here import `moejax.nn` and `moejax.data`, which
import only `moejax.schema` (their dataclasses' key metadata, in the base layer).
The names below are for config files and scripts (`from moejax import config;
config.base_config()`), each imported from its module on first use; code in `moejax/`
imports the module itself (`from moejax.config.reader import resolve`), so that
tests/test_imports.py sees the edge.
"""

from __future__ import annotations

import importlib

# name -> the module of this package that defines it
EXPORTS = {
  "SECTIONS": "defaults",
  "base_config": "defaults",
  "preset_base": "defaults",
  "section_defaults": "defaults",
  "from_values": "reader",
  "merge_rule": "reader",
  "resolve": "reader",
  "resolve_data": "reader",
  "typed": "reader",
  "RunConfig": "run",
  "warnings": "checks",
}
__all__ = sorted(EXPORTS)


def __getattr__(name: str):
  module = EXPORTS.get(name)
  if module is None:  # also how `from moejax.config import reader` finds a submodule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{module}"), name)
