"""A ModelConfig → the model and its parameter count: the concrete Transformer, its
abstract (shape-only) twin, and counts of total and active parameters. Training,
evaluation, the worksheet, ahead-of-time compiles and the HF converters all build through it,
from the RunConfig's `model` (moejax.config.resolve builds that from the ConfigDict)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx

from moejax.nn.model import ModelConfig, Transformer
from moejax.nn.moe import MoEConfig


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
