"""The run configuration: every key with its default, and the typed configs built from it.

Config files under `configs/` start from `base_config()` and change what they need, so
every run has every key (DESIGN.md §5.1) and `--config.a.b=v` can override any of them.
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from moejax import data as data_lib
from moejax import routing
from moejax.errors import UserError
from moejax.model import ModelConfig
from moejax.moe import MoEConfig

GRANULARITIES = ("micro_batch", "sequence", "global_batch")
WANDB_MODES = ("auto", "online", "offline", "disabled")


def base_config() -> ml_collections.ConfigDict:
  """All keys with defaults: a small byte-level MoE on the stdlib corpus."""
  c = ml_collections.ConfigDict()
  c.model = dict(
    vocab_size=0,  # 0: the tokenizer's
    d_model=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=0,
    d_ff=512,
    qk_norm=False,
    tie_embeddings=True,
    rope_theta=10000.0,
    norm_eps=1e-6,
    dtype="float32",
    init_std=0.02,
    moe_every=1,
    first_dense=0,
    moe=dict(
      rule="mixtral",
      n_experts=8,
      top_k=2,
      d_expert=128,
      d_shared=0,
      dispatch="dropless",
      capacity_factor=1.25,
      eval_capacity_factor=2.0,
      min_capacity=4,
      drop_policy="position",
      group_size=0,
      second_expert="all",
      impl="auto",
      block_size=32,
      jitter_eps=0.0,
      n_groups=0,
      topk_groups=0,
    ),  # 0: the rule's own grouping
  )
  c.loss = dict(
    balance_weight=0.01,
    balance_granularity="global_batch",
    z_loss_weight=0.001,
    bias_update_rate=0.0,
  )
  c.data = data_lib.default_config().to_dict()
  c.data.update(batch_size=16, seq_len=128)
  c.train = dict(
    steps=1000,
    seed=0,
    log_every=10,
    eval_every=200,
    eval_sequences=64,
    ckpt_every=200,
    keep_checkpoints=3,
    grad_accum=1,
    progress=True,
    stop_at=0,
  )  # stop_at: leave early at this step (0: train.steps)
  c.optim = dict(
    lr=3e-3,
    warmup_steps=100,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    clip_norm=1.0,
  )
  c.eval = dict(
    k1="", k2="", sequences=256, batch_size=32, bootstrap_resamples=2000, after_train=False
  )
  c.wandb = dict(mode="auto", project="moejax", entity="", name="", tags="")
  c.mesh = dict(data=-1, fsdp=1, expert=1)
  return c


def preset_base() -> ml_collections.ConfigDict:
  """`base_config()` at the scale every architecture preset shares: byte-level stdlib,
  16 × 128 tokens per step, 300 steps. Presets then set the architecture and losses."""
  c = base_config()
  c.data.update(corpus="stdlib", tokenizer="byte", batch_size=16, seq_len=128)
  c.train.update(steps=300, eval_every=100, ckpt_every=100)
  c.optim.update(warmup_steps=30)
  return c


def _build(cls, node: ml_collections.ConfigDict, **overrides):
  """A config dataclass from the section's keys of the same names, plus `overrides`."""
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in node.items() if k in names and k not in overrides}, **overrides)


def moe_config(c: ml_collections.ConfigDict) -> MoEConfig:
  """Builds the MoEConfig, applying group overrides to the named rule."""
  m = c.model.moe
  rule = routing.get_rule(m.rule)
  if m.n_groups or m.topk_groups:
    rule = dataclasses.replace(
      rule, n_groups=m.n_groups or rule.n_groups, topk_groups=m.topk_groups or rule.topk_groups
    )
  return _build(
    MoEConfig,
    m,
    d_model=c.model.d_model,
    rule=rule,
    group_size=m.group_size or None,
    dtype=c.model.dtype,
    init_std=c.model.init_std,
  )


def model_config(c: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  """Builds the ModelConfig; `model.vocab_size=0` takes the tokenizer's vocabulary."""
  m = c.model
  moe = moe_config(c) if m.moe_every > 0 else None
  return _build(ModelConfig, m, vocab_size=m.vocab_size or vocab_size, moe=moe)


def _positive(c, path: str, minimum: float = 1) -> None:
  node = c
  for part in path.split("."):
    node = node[part]
  if not node >= minimum:
    raise UserError(f"{path}={node} is not allowed; use a value >= {minimum}")


def validate(c: ml_collections.ConfigDict) -> None:
  """Checks the keys that no typed config owns; raises a one-line UserError naming one."""
  for path in (
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.ckpt_every",
    "train.keep_checkpoints",
    "train.grad_accum",
    "train.eval_sequences",
    "eval.sequences",
    "eval.batch_size",
    "data.batch_size",
  ):
    _positive(c, path)
  for path in (
    "optim.lr",
    "loss.balance_weight",
    "loss.z_loss_weight",
    "loss.bias_update_rate",
    "optim.warmup_steps",
    "optim.weight_decay",
    "optim.clip_norm",
  ):
    _positive(c, path, 0)
  if c.loss.balance_granularity not in GRANULARITIES:
    raise UserError(
      f"loss.balance_granularity={c.loss.balance_granularity!r} is not allowed; "
      f"use one of {', '.join(GRANULARITIES)}"
    )
  if c.wandb.mode not in WANDB_MODES:
    raise UserError(
      f"wandb.mode={c.wandb.mode!r} is not allowed; use one of {', '.join(WANDB_MODES)}"
    )
  if c.data.batch_size % c.train.grad_accum:
    raise UserError(
      f"train.grad_accum={c.train.grad_accum} must divide data.batch_size={c.data.batch_size}"
    )
  if not 0 <= c.train.stop_at <= c.train.steps:
    raise UserError(
      f"train.stop_at={c.train.stop_at} is not allowed; use 0 (no early stop) "
      f"to train.steps={c.train.steps}"
    )
  if not 0 <= c.optim.min_lr_ratio <= 1:
    raise UserError(f"optim.min_lr_ratio={c.optim.min_lr_ratio} is not allowed; use [0, 1]")
  model_config(c, vocab_size=max(c.model.vocab_size, 2))


def read_saved(workdir: str) -> dict | None:
  """The raw `DIR/config.json` of an earlier run, or None when there is none."""
  from moejax import runio  # pylint: disable=import-outside-toplevel

  path = runio.path(workdir, "config.json")
  if not path.exists():
    return None
  try:
    return json.loads(runio.read_text(path))
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"{path} is unreadable ({e}); fix or remove it") from None


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """A config saved by an earlier run (config.json), with defaults for keys added since."""
  c = base_config()

  def merge(node: ml_collections.ConfigDict, values: dict) -> None:
    for key, value in values.items():
      if key in node and isinstance(node[key], ml_collections.ConfigDict):
        merge(node[key], value)
      elif key in node:
        node[key] = value

  merge(c, saved)
  return c
