"""A run config → the objects it describes: the merge rule, the typed configs, the model and
its parameter count. The one place that does this (docs/design.md §5.1): training,
evaluation, the worksheet, ahead-of-time compiles and the HF converters all call it.

The builders read the sections of `config.base_config()` by key; this module does not
import `moejax.config` (whose `validate` builds through it). Each builder names every
section key it reads besides its dataclass's same-named fields, and refuses any other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import ml_collections
from flax import nnx

from moejax.errors import UserError
from moejax.nn import routing
from moejax.nn.losses import LossConfig
from moejax.nn.model import ModelConfig, Transformer
from moejax.nn.moe import MoEConfig

# `model.moe` keys that replace a field of the named rule (routing.compose_rule) when set:
# the group counts when > 0, every other rule field when not None.
RULE_COUNTS = ("n_groups", "topk_groups")
RULE_OVERRIDES = tuple(f for f in routing.RULE_FIELDS if f not in RULE_COUNTS)
# MoEConfig fields copied from `model.*` (not keys of `model.moe`).
MOE_FROM_MODEL = ("d_model", "dtype", "init_std")
# `model` keys that are not ModelConfig fields: the `moe` section (moe_config).
MODEL_READ_ELSEWHERE = ("moe",)
# LossConfig fields that come from the run, not from `loss.*` (loss_config).
LOSS_FROM_RUN = ("n_shards", "grad_accum")


def _refuse_unread(node: ml_collections.ConfigDict, section: str, read: set[str]) -> None:
  """A section key no builder reads would be silently dropped: refuse it, naming it."""
  unread = sorted(set(node.keys()) - read)
  if unread:
    raise UserError(
      f"{section}.{unread[0]} is read by no builder in moejax/build.py; add it to the "
      f"dataclass of {section}, or to the keys its builder reads"
    )


def _build(cls, node: ml_collections.ConfigDict, section: str, read_elsewhere=(), **overrides):
  """A config dataclass from the section's keys of the same names, plus `overrides`; any
  other key of the section must be in `read_elsewhere`."""
  names = {f.name for f in dataclasses.fields(cls)}
  _refuse_unread(node, section, names | set(read_elsewhere))
  return cls(**{k: v for k, v in node.items() if k in names and k not in overrides}, **overrides)


def merge_rule(c: ml_collections.ConfigDict) -> routing.MergeRule:
  """The resolved rule: `model.moe.rule` with every set `model.moe.<field>` applied."""
  m = c.model.moe
  overrides = {f: m[f] for f in RULE_OVERRIDES if m.get(f) is not None}
  overrides.update({f: m[f] for f in RULE_COUNTS if m[f]})
  rule = routing.compose_rule(m.rule, overrides)
  unbuilt = rule.shared in ("unit", "sigmoid") and m.d_shared == 0  # no shared expert
  if unbuilt and m.get("shared") is not None and rule.shared != routing.get_rule(m.rule).shared:
    raise UserError(
      f"model.moe.shared={rule.shared!r} has no effect with model.moe.d_shared=0; "
      "set model.moe.d_shared > 0"
    )
  return rule


def resolved_rule(c: ml_collections.ConfigDict) -> dict:
  """config.json `resolved.rule`: every field of the rule the run trains with."""
  return routing.rule_dict(merge_rule(c))


def moe_config(c: ml_collections.ConfigDict) -> MoEConfig:
  """The MoEConfig of `model.moe`, with the resolved merge rule (`merge_rule`) and
  `group_size=0` (all tokens) as None."""
  m = c.model.moe
  return _build(
    MoEConfig,
    m,
    "model.moe",
    RULE_OVERRIDES + RULE_COUNTS,
    rule=merge_rule(c),
    group_size=m.group_size or None,
    **{k: c.model[k] for k in MOE_FROM_MODEL},
  )


def model_config(c: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  """The ModelConfig; `model.vocab_size=0` takes the tokenizer's vocabulary `vocab_size`."""
  m = c.model
  moe = moe_config(c) if m.moe_every > 0 else None
  return _build(
    ModelConfig, m, "model", MODEL_READ_ELSEWHERE, vocab_size=m.vocab_size or vocab_size, moe=moe
  )


def loss_config(c: ml_collections.ConfigDict, n_shards: int) -> LossConfig:
  """The LossConfig of `loss.*` and `train.grad_accum`; `n_shards`: data-parallel shards."""
  return _build(LossConfig, c.loss, "loss", n_shards=n_shards, grad_accum=c.train.grad_accum)


class _ShapeRngs:
  """Stands in for `nnx.Rngs` under eval_shape: a constant key and no counter state.

  `nnx.Rngs` updates a counter per draw, and on a tracer that update searches the whole
  trace, so tracing a 61-layer model takes minutes; values are never computed here anyway.
  The model draws only `rngs.params()`, so its structure is the concrete model's.
  """

  def params(self) -> jax.Array:
    return jax.random.key(0)


def transformer(mc: ModelConfig, seed: int) -> Transformer:
  """The Transformer of `mc`, its parameters initialized from `seed`."""
  return Transformer(mc, rngs=nnx.Rngs(seed))


def abstract_transformer(mc: ModelConfig) -> Transformer:
  """The Transformer of `mc` with `jax.ShapeDtypeStruct` leaves: nothing is allocated, so a
  671B model takes seconds; what a restore fills, or what the parameters are counted on."""
  return nnx.eval_shape(lambda: Transformer(mc, rngs=_ShapeRngs()))


def build_model(c: ml_collections.ConfigDict, vocab_size: int) -> Transformer:
  """The Transformer of config `c`, initialized from `train.seed`."""
  return transformer(model_config(c, vocab_size), c.train.seed)


def abstract_model(c: ml_collections.ConfigDict, vocab_size: int) -> Transformer:
  """The same model with `jax.ShapeDtypeStruct` leaves: shapes for a restore, no memory."""
  return abstract_transformer(model_config(c, vocab_size))


def abstract_params(mc: ModelConfig) -> nnx.State:
  """The Transformer's `nnx.Param` leaves as ShapeDtypeStructs."""
  return nnx.state(abstract_transformer(mc), nnx.Param)


class ParamCount(NamedTuple):
  """Parameters, and those one token reads at k1 = K (routed experts count K/E)."""

  total: int
  active: int


def param_names(keypath) -> tuple[str, ...]:
  """A parameter's key path inside an `nnx.State` as names, e.g. ('layers', '3', 'mlp',
  'experts', 'w_down'), or scanned ('stacks', '1', 'blocks', '0', 'mlp', ...), without nnx's
  trailing 'value'."""
  names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in keypath)
  return names[:-1] if names and names[-1] == "value" else names


def param_count(names: tuple[str, ...], shape: tuple[int, ...], moe: MoEConfig | None):
  """The ParamCount of one parameter: whole, or K/E of it for a routed expert's weights
  (E is one of their axes, after the layer axis of a scanned stack, so the count is exact)."""
  size = math.prod(shape)
  active = size * moe.top_k // moe.n_experts if moe is not None and "experts" in names else size
  return ParamCount(size, active)


def count_params(params, moe: MoEConfig | None) -> ParamCount:
  """The ParamCount of a parameter tree (arrays or ShapeDtypeStructs); `moe`: the
  ModelConfig's (None for a dense model)."""
  total = active = 0
  for keypath, leaf in jax.tree_util.tree_leaves_with_path(params):
    n = param_count(param_names(keypath), leaf.shape, moe)
    total, active = total + n.total, active + n.active
  return ParamCount(total, active)
