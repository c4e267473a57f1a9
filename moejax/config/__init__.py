"""The run configuration: every section a typed, frozen dataclass (`sections`, and the
builders' own: ModelConfig, MoEConfig, LossConfig, DataConfig), `base_config()` written from
them (`defaults`), `reader.resolve` (the one reader of a ConfigDict: it checks every key and builds
the typed `RunConfig`), the cross-section checks (`checks`) and the keys' table (`table`,
docs/config.md)."""

from moejax.config.checks import warnings
from moejax.config.defaults import SECTIONS, base_config, preset_base, section_defaults
from moejax.config.reader import from_values, merge_rule, resolve, resolve_data, typed
from moejax.config.run import RunConfig

__all__ = [
  "SECTIONS",
  "RunConfig",
  "base_config",
  "from_values",
  "merge_rule",
  "preset_base",
  "resolve",
  "resolve_data",
  "section_defaults",
  "typed",
  "warnings",
]
