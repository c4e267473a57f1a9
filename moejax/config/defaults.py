"""`base_config()`: every key with its default, written from the sections' dataclasses.

Config files under `configs/` start from `base_config()` (or `preset_base()`) and change
what they need, so every run has every key and `--config.a.b=v` can override any of them.
No default is written here: each is its dataclass field's (docs/config.md lists them).
"""

from __future__ import annotations

from typing import NamedTuple

import ml_collections
from ml_collections import config_dict

from moejax import schema
from moejax.config import sections
from moejax.config.run import LOSS_FROM_RUN, MOE_FROM_MODEL, RULE_COUNTS, RULE_OVERRIDES
from moejax.data.config import DataConfig
from moejax.nn.losses import LossConfig
from moejax.nn.gated_deltanet import GatedDeltaNetConfig
from moejax.nn.mla import MLAConfig
from moejax.nn.model import ModelConfig
from moejax.nn.moe import MoEConfig


class Section(NamedTuple):
  """A config section: its dataclass, and its fields that are not keys of the section."""

  cls: type
  skip: tuple[str, ...] = ()


# Every section, in docs/config.md's order. The rule-field keys of `model.moe` are the merge
# rule's (moejax.nn.routing.MergeRule), unset: they replace the named rule's when set.
SECTIONS: dict[str, Section] = {
  "model": Section(ModelConfig, ("moe", "mla", "gated_deltanet")),
  "model.moe": Section(MoEConfig, MOE_FROM_MODEL),
  "model.mla": Section(MLAConfig),
  "model.gated_deltanet": Section(GatedDeltaNetConfig),
  "loss": Section(LossConfig, LOSS_FROM_RUN),
  "data": Section(DataConfig),
  "train": Section(sections.TrainConfig),
  "optim": Section(sections.OptimConfig),
  "eval": Section(sections.EvalConfig),
  "wandb": Section(sections.WandbConfig),
  "mesh": Section(sections.MeshConfig),
}


# `model.<name>` sections beside `model.moe`: the mixers' shapes, read whatever the mixers.
MODEL_SUBSECTIONS = ("mla", "gated_deltanet")


def section_defaults(name: str) -> dict:
  """{key: default} of one section; an unset optional field (None) is 0, since a ConfigDict
  key keeps its default's type (`model.moe.group_size=0`: all tokens)."""
  s = SECTIONS[name]
  return {k: 0 if v is None else v for k, v in schema.defaults(s.cls, s.skip).items()}


def _moe_defaults() -> dict:
  out = section_defaults("model.moe")
  out.update(dict.fromkeys(RULE_COUNTS, 0))
  out.update({f: config_dict.placeholder(object) for f in RULE_OVERRIDES})
  return out


def base_config() -> ml_collections.ConfigDict:
  """All keys with their defaults: a small byte-level MoE on the stdlib corpus."""
  c = ml_collections.ConfigDict()
  c.model = {**section_defaults("model"), "moe": _moe_defaults(),
             **{k: section_defaults(f"model.{k}") for k in MODEL_SUBSECTIONS}}  # fmt: skip
  for name in SECTIONS:
    if "." not in name and name != "model":
      c[name] = section_defaults(name)
  return c


def preset_base() -> ml_collections.ConfigDict:
  """`base_config()` at the scale every architecture preset shares: byte-level stdlib,
  16 × 128 tokens per step, 300 steps. Presets then set the architecture and losses."""
  c = base_config()
  c.data.update(corpus="stdlib", tokenizer="byte", batch_size=16, seq_len=128)
  c.train.update(steps=300, eval_every=100, ckpt_every=100)
  c.optim.update(warmup_steps=30)
  return c
