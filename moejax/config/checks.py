"""A config checked before anything is built: every key of the ConfigDict known and of its
default's type (`check_keys`, on the user-facing form), then, on the typed RunConfig, the
checks that span sections (`check_run`; the k-grid's `eval.k1`/`eval.k2` among them). Each
key's own choices and bounds are checked once, by its section's dataclass from the key's
metadata; nothing here repeats them."""

from __future__ import annotations

import ml_collections

from moejax.config import grid_labels, renames
from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.kernels import dispatch
from moejax.schema import type_ok


def check_keys(c: ml_collections.ConfigDict, base: ml_collections.ConfigDict, prefix="") -> None:
  """Every key of `c` exists in `base_config()` with the same type (a typo set inside a
  config file, `c.train.stepz = 5`, or a string where a number goes)."""
  for key in c.keys():
    path = f"{prefix}{key}"
    if key not in base:
      raise UserError(renames.unknown_key(path, base.keys()))
    value, default = c[key], base[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise UserError(f"{path} must be a section (keys {', '.join(default.keys())})")
      check_keys(value, default, f"{path}.")
    elif default is not None and not type_ok(value, type(default)):
      raise UserError(
        f"{path}={value!r} is not allowed; use a {type(default).__name__} (like {default!r})"
      )


def _check_shared(rc: RunConfig) -> None:
  """The shared expert and the rule's shared gate must come together."""
  moe = rc.model.moe
  shared, d_shared, name = moe.merge_rule.shared, moe.d_shared, rc.tree["model"]["moe"]["rule"]
  if d_shared > 0 and shared == "none":
    raise UserError(
      f"model.moe.d_shared={d_shared} is not allowed with model.moe.rule={name!r}, "
      f"which has no shared expert (its parameters would be dead); use d_shared=0"
    )
  if d_shared == 0 and shared == "sigmoid":
    raise UserError(
      f"model.moe.rule={name!r} gates a shared expert with a sigmoid; set "
      f"model.moe.d_shared >= 1 (now 0, so the gate would be dropped)"
    )


def _check_batch(rc: RunConfig) -> None:
  """train, data and optim keys that bound each other."""
  if rc.data.batch_size % rc.train.grad_accum:
    raise UserError(
      f"train.grad_accum={rc.train.grad_accum} must divide data.batch_size={rc.data.batch_size}"
    )
  if rc.train.stop_at > rc.train.steps:
    raise UserError(
      f"train.stop_at={rc.train.stop_at} is not allowed; use 0 (no early stop) "
      f"to train.steps={rc.train.steps}"
    )


def _check_moe_run(rc: RunConfig) -> None:
  """What `model.moe` needs of this host and of the batch shape, checked before anything is
  written: an explicitly named kernel that cannot run here, and capacity routing groups that
  do not tile a training micro-batch or an eval batch (the step would refuse them)."""
  moe = rc.model.moe
  dispatch.check_runnable(moe.impl)
  if moe.dispatch != "capacity" or not moe.group_size:
    return
  L = rc.data.seq_len
  for tokens, of in (
    (
      rc.data.batch_size // rc.train.grad_accum * L,
      "a training micro-batch (data.batch_size / train.grad_accum x data.seq_len)",
    ),
    (rc.eval.batch_size * L, "an eval batch (eval.batch_size x data.seq_len)"),
  ):
    dispatch.check_group_size(moe.group_size, tokens, of)


def check_run(rc: RunConfig) -> None:
  """The checks that span sections; each section has checked its own keys."""
  _check_batch(rc)
  moe = rc.model.moe
  if moe is not None:
    _check_moe_run(rc)
    _check_shared(rc)
    # the k-grid's cells, against the MoE shape: now, not after training
    grid_labels.check_eval(rc.eval.k1, rc.eval.k2, moe.top_k, moe.n_experts)


def warnings(rc: RunConfig) -> list[str]:
  """Valid but probably unintended settings, printed when training starts."""
  out = []
  if rc.optim.warmup_steps >= rc.train.steps:
    out.append(
      f"warning: optim.warmup_steps={rc.optim.warmup_steps} >= train.steps={rc.train.steps}; "
      f"the warmup is clamped to {max(rc.train.steps - 1, 0)} steps"
    )
  return out
