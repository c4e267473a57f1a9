"""The run configuration's schema: every section a typed, frozen dataclass (`sections`, and
the builders' own: ModelConfig, MoEConfig, LossConfig, DataConfig), `base_config()` written
from them (`defaults`), the checks of a config (`checks`) and the keys' table (`table`,
docs/config.md). `moejax.build` turns a config into the dataclasses and the model."""

from moejax.config.checks import check, check_keys, warnings
from moejax.config.defaults import SECTIONS, base_config, preset_base, section_defaults

__all__ = [
  "SECTIONS",
  "base_config",
  "check",
  "check_keys",
  "preset_base",
  "section_defaults",
  "warnings",
]
