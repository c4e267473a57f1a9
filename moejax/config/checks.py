"""A config checked against the schema before anything is built: every key known and of its
default's type, every section's dataclass built (each checks its own keys), then the checks
that span sections. `moejax.validate.validate` runs this and the k-grid's cells, once."""

from __future__ import annotations

import ml_collections

from moejax import build
from moejax.config.defaults import SECTIONS, base_config
from moejax.errors import UserError
from moejax.kernels import dispatch
from moejax.nn.moe import MoEConfig
from moejax.schema import type_ok


def check_keys(c: ml_collections.ConfigDict, base: ml_collections.ConfigDict, prefix="") -> None:
  """Every key of `c` exists in `base_config()` with the same type (a typo set inside a
  config file, `c.train.stepz = 5`, or a string where a number goes)."""
  for key in c.keys():
    path = f"{prefix}{key}"
    if key not in base:
      raise UserError(f"unknown config key {path}; see docs/config.md for the keys")
    value, default = c[key], base[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise UserError(f"{path} must be a section (keys {', '.join(default.keys())})")
      check_keys(value, default, f"{path}.")
    elif default is not None and not type_ok(value, type(default)):
      raise UserError(
        f"{path}={value!r} is not allowed; use a {type(default).__name__} (like {default!r})"
      )


def _check_shared(c: ml_collections.ConfigDict) -> None:
  """The shared expert and the rule's shared gate must come together."""
  shared = build.merge_rule(c).shared
  d_shared = c.model.moe.d_shared
  if d_shared > 0 and shared == "none":
    raise UserError(
      f"model.moe.d_shared={d_shared} is not allowed with model.moe.rule={c.model.moe.rule!r}, "
      f"which has no shared expert (its parameters would be dead); use d_shared=0"
    )
  if d_shared == 0 and shared == "sigmoid":
    raise UserError(
      f"model.moe.rule={c.model.moe.rule!r} gates a shared expert with a sigmoid; set "
      f"model.moe.d_shared >= 1 (now 0, so the gate would be dropped)"
    )


def _check_run(c: ml_collections.ConfigDict) -> None:
  """train, data and optim keys that bound each other."""
  if c.data.batch_size % c.train.grad_accum:
    raise UserError(
      f"train.grad_accum={c.train.grad_accum} must divide data.batch_size={c.data.batch_size}"
    )
  if c.train.stop_at > c.train.steps:
    raise UserError(
      f"train.stop_at={c.train.stop_at} is not allowed; use 0 (no early stop) "
      f"to train.steps={c.train.steps}"
    )


def _check_moe_run(c: ml_collections.ConfigDict, moe: MoEConfig) -> None:
  """What `model.moe` needs of this host and of the batch shape, checked before anything is
  written: an explicitly named kernel that cannot run here, and capacity routing groups that
  do not tile a training micro-batch or an eval batch (the step would refuse them)."""
  dispatch.check_runnable(moe.impl)
  if moe.dispatch != "capacity" or not moe.group_size:
    return
  L = c.data.seq_len
  for tokens, of in (
    (
      c.data.batch_size // c.train.grad_accum * L,
      "a training micro-batch (data.batch_size / train.grad_accum x data.seq_len)",
    ),
    (c.eval.batch_size * L, "an eval batch (eval.batch_size x data.seq_len)"),
  ):
    dispatch.check_group_size(moe.group_size, tokens, of)


def check(c: ml_collections.ConfigDict) -> None:
  """The whole config but the grid's cells; raises a one-line UserError naming the key."""
  check_keys(c, base_config())
  for name in ("loss", "data", "train", "optim", "eval", "wandb", "mesh"):
    SECTIONS[name].cls(**{k: v for k, v in c[name].items()})
  mc = build.model_config(c, vocab_size=max(c.model.vocab_size, 2))  # model and model.moe
  build.loss_config(c, n_shards=1)
  _check_run(c)
  if mc.moe is not None:
    _check_moe_run(c, mc.moe)
  if c.model.moe_every > 0:
    _check_shared(c)


def warnings(c: ml_collections.ConfigDict) -> list[str]:
  """Valid but probably unintended settings, printed when training starts."""
  out = []
  if c.optim.warmup_steps >= c.train.steps:
    out.append(
      f"warning: optim.warmup_steps={c.optim.warmup_steps} >= train.steps={c.train.steps}; "
      f"the warmup is clamped to {max(c.train.steps - 1, 0)} steps"
    )
  return out
