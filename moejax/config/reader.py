"""The one place that reads a run's ConfigDict: `resolve` turns it into the typed RunConfig.

The ConfigDict is the user-facing form: config files, `--config.a.b=v` overrides and
config.json. `resolve` checks every key against the schema (`checks.check_keys`), builds
every section's frozen dataclass (each checks its own keys from their metadata), resolves the
merge rule, then runs the checks that span sections (`checks.check_run`). Everything below
the entry points takes the RunConfig or one of its sections, never the ConfigDict.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from moejax.config import checks, sections
from moejax.config.defaults import base_config
from moejax.config.run import (
  MODEL_READ_ELSEWHERE,
  MOE_FROM_MODEL,
  RULE_COUNTS,
  RULE_OVERRIDES,
  RunConfig,
)
from moejax.data.config import DataConfig
from moejax.errors import UserError
from moejax.nn import routing
from moejax.nn.losses import LossConfig
from moejax.nn.model import ModelConfig
from moejax.nn.gated_deltanet import GatedDeltaNetConfig
from moejax.nn.mla import MLAConfig
from moejax.nn.moe import MoEConfig


def _section(cls, node: ml_collections.ConfigDict, name: str, read_elsewhere=(), **overrides):
  """A section's dataclass from its keys of the same names, plus `overrides`; any other key
  of the section must be in `read_elsewhere` (a key no field takes would be dropped)."""
  names = {f.name for f in dataclasses.fields(cls)}
  unread = sorted(set(node.keys()) - names - set(read_elsewhere))
  if unread:
    raise UserError(
      f"{name}.{unread[0]} is read by no builder in moejax/config/reader.py; add it to the "
      f"dataclass of {name} ({cls.__name__}), or to the keys its section reads elsewhere"
    )
  return cls(**{k: v for k, v in node.items() if k in names and k not in overrides}, **overrides)


def merge_rule(moe: ml_collections.ConfigDict) -> routing.MergeRule:
  """The resolved rule: `model.moe.rule` with every set `model.moe.<field>` applied."""
  overrides = {f: moe[f] for f in RULE_OVERRIDES if moe.get(f) is not None}
  overrides.update({f: moe[f] for f in RULE_COUNTS if moe[f]})
  rule = routing.compose_rule(moe.rule, overrides)
  unbuilt = rule.shared in ("unit", "sigmoid") and moe.d_shared == 0  # no shared expert
  if unbuilt and moe.get("shared") is not None and rule.shared != routing.get_rule(moe.rule).shared:
    raise UserError(
      f"model.moe.shared={rule.shared!r} has no effect with model.moe.d_shared=0; "
      "set model.moe.d_shared > 0"
    )
  return rule


def _moe(model: ml_collections.ConfigDict) -> MoEConfig:
  """`model.moe` with its resolved rule and `group_size=0` (all tokens) as None."""
  m = model.moe
  return _section(
    MoEConfig,
    m,
    "model.moe",
    RULE_OVERRIDES + RULE_COUNTS,
    rule=merge_rule(m),
    group_size=m.group_size or None,
    **{k: model[k] for k in MOE_FROM_MODEL},
  )


def _model(model: ml_collections.ConfigDict) -> ModelConfig:
  moe = _moe(model) if model.moe_every > 0 else None
  subs = {"mla": MLAConfig, "gated_deltanet": GatedDeltaNetConfig}
  built = {k: _section(cls, model[k], f"model.{k}") for k, cls in subs.items()}
  return _section(ModelConfig, model, "model", MODEL_READ_ELSEWHERE, moe=moe, **built)


def typed(c: ml_collections.ConfigDict) -> RunConfig:
  """Every key checked and every section built, without the checks that span sections (a
  study's base file that its sweep completes)."""
  checks.check_keys(c, base_config())
  s = {name: _section(cls, c[name], name) for name, cls in sections.RUN_SECTIONS.items()}
  return RunConfig(
    model=_model(c.model),
    loss=_section(LossConfig, c.loss, "loss", grad_accum=c.train.grad_accum),
    data=_section(DataConfig, c.data, "data"),
    tree=c.to_dict(),
    **s,
  )


def resolve_data(c: ml_collections.ConfigDict) -> DataConfig:
  """The `data` section alone, its keys checked (`moejax.prepare` reads only it: a config
  file for it may hold nothing else)."""
  if "data" not in c:
    raise UserError("the config has no data section; see docs/data.md for its keys")
  checks.check_keys(c.data, base_config().data, "data.")
  return _section(DataConfig, c.data, "data")


def resolve(c: ml_collections.ConfigDict) -> RunConfig:
  """The RunConfig of a config, or a one-line UserError naming the first bad key."""
  rc = typed(c)
  checks.check_run(rc)
  return rc


def from_values(values: dict[str, Any]) -> ml_collections.ConfigDict:
  """`base_config()` with the nested `values` set over it (config.json's, or an import's);
  keys unknown to the schema are left out (a key a newer moejax removed)."""
  c = base_config()

  def merge(node: ml_collections.ConfigDict, vals: dict) -> None:
    for key, value in vals.items():
      if key in node and isinstance(node[key], ml_collections.ConfigDict):
        merge(node[key], value)
      elif key in node:
        node[key] = value

  merge(c, values)
  return c
