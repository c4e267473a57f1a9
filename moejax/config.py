"""The run configuration's schema: every key with its default, and the checks of a config
against it (keys, types, ranges) before anything is built.

Config files under `configs/` start from `base_config()` and change what they need, so
every run has every key (docs/design.md §5.1) and `--config.a.b=v` can override any of them.
The `model.moe` and `loss` defaults are the dataclasses' own (`moe.MoEConfig`,
`losses.LossConfig`); `moejax.build` turns a config into those dataclasses and the model,
`moejax.cli.load_file` loads a config file, `moejax.training.workdir` reads a saved one.
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from moejax import build
from moejax.data import pipeline as data_lib
from moejax.errors import UserError, check_choice
from moejax.nn.losses import LossConfig
from moejax.nn.moe import MoEConfig

GRANULARITIES = ("micro_batch", "sequence", "global_batch")
WANDB_MODES = ("auto", "online", "offline", "disabled")


def _config_default(field: dataclasses.Field):
  """A dataclass field's default as a config value: None (unset) is 0, since a ConfigDict
  key keeps its default's type (`model.moe.group_size=0`: all tokens)."""
  if field.default is dataclasses.MISSING:
    raise TypeError(f"{field.name} has no default to write into base_config()")
  return 0 if field.default is None else field.default


def moe_defaults() -> dict:
  """`model.moe`: MoEConfig's fields and defaults (moejax/nn/moe.py says what each means),
  less those copied from `model.*`, and the merge rule's keys, unset (`routing.compose_rule`):
  `n_groups`/`topk_groups` 0, the others None."""
  fields = dataclasses.fields(MoEConfig)
  out = {f.name: _config_default(f) for f in fields if f.name not in build.MOE_FROM_MODEL}
  out.update(dict.fromkeys(build.RULE_COUNTS, 0))
  out.update({f: config_dict.placeholder(object) for f in build.RULE_OVERRIDES})
  return out


def loss_defaults() -> dict:
  """`loss`: LossConfig's defaults, less its fields that come from the run (`n_shards`,
  `grad_accum`). `balance_convention`: losses.BALANCE_CONVENTIONS, `balance_choices`:
  losses.BALANCE_CHOICES."""
  fields = dataclasses.fields(LossConfig)
  return {f.name: _config_default(f) for f in fields if f.name not in build.LOSS_FROM_RUN}


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
    qk_norm_scope="head",  # "head": per head (Qwen3); "proj": whole projection (OLMoE)
    qkv_bias=False,  # q/k/v projection biases (Qwen2)
    tie_embeddings=True,
    rope_theta=10000.0,
    norm_eps=1e-6,
    dtype="float32",  # compute dtype; parameters, optimizer, router, losses stay float32
    remat="none",  # moejax.nn.remat.REMAT_POLICIES: none | full | minimal | dots_saveable
    attention="xla",  # moejax.nn.attention.ATTENTION_IMPLS: xla | dot_product | splash | tokamax
    scan_layers=True,  # the layer stack as lax.scans over stacked parameters (moejax.nn.stack)
    init_std=0.02,
    moe_every=1,
    first_dense=0,
    not_modelled="",  # what the source architecture has that this model lacks (worksheet)
    moe=moe_defaults(),
  )
  c.loss = loss_defaults()
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
    on_nonfinite="stop",
    max_skips=10,
  )  # stop_at: leave early at this step (0: train.steps); on_nonfinite: stop | skip
  # max_skips: with on_nonfinite=skip, stop after more than this many skipped steps in a row
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
  c.eval.gain_sequences = 64  # held-out windows after the evaluated ones: the `gain` fit
  c.wandb = dict(mode="auto", project="moejax", entity="", name="", tags="", group="")
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


def _get(c, path: str):
  node = c
  for part in path.split("."):
    node = node[part]
  return node


def _at_least(c, path: str, minimum: float = 1) -> None:
  value = _get(c, path)
  if not value >= minimum:
    raise UserError(f"{path}={value} is not allowed; use a value >= {minimum}")


def _in_range(c, path: str, lo: float, hi: float, hi_open: bool = False) -> None:
  value = _get(c, path)
  if not (lo <= value < hi if hi_open else lo <= value <= hi):
    raise UserError(f"{path}={value} is not allowed; use [{lo}, {hi}{')' if hi_open else ']'}")


POSITIVE = (  # >= 1
  "train.steps",
  "train.log_every",
  "train.eval_every",
  "train.ckpt_every",
  "train.keep_checkpoints",
  "train.grad_accum",
  "train.eval_sequences",
  "eval.sequences",
  "eval.batch_size",
  "eval.bootstrap_resamples",
  "eval.gain_sequences",
  "data.batch_size",
)
NON_NEGATIVE = (  # >= 0
  "optim.lr",
  "loss.balance_weight",
  "loss.z_loss_weight",
  "loss.bias_update_rate",
  "optim.warmup_steps",
  "optim.weight_decay",
  "optim.clip_norm",
  "model.d_ff",
  "model.vocab_size",
  "train.max_skips",
)


def _types_match(value, default) -> bool:
  """Whether a config value has its default's type (ints pass for floats)."""
  if default is None:
    return True
  if isinstance(default, bool) or isinstance(value, bool):
    return type(value) is type(default)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  return isinstance(value, type(default))


def check_keys(c: ml_collections.ConfigDict, base: ml_collections.ConfigDict, prefix="") -> None:
  """Every key of `c` exists in `base_config()` with the same type (a typo set inside a
  config file, `c.train.stepz = 5`, or a string where a number goes)."""
  for key in c.keys():
    path = f"{prefix}{key}"
    if key not in base:
      raise UserError(f"unknown config key {path}; see the keys in moejax/config.py")
    value, default = c[key], base[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise UserError(f"{path} must be a section (keys {', '.join(default.keys())})")
      check_keys(value, default, f"{path}.")
    elif not _types_match(value, default):
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


def validate(c: ml_collections.ConfigDict) -> None:
  """Checks a whole config before anything is built; raises a one-line UserError naming
  the key. Typed configs (ModelConfig, MoEConfig, data) check their own fields here too."""
  check_keys(c, base_config())
  for path in POSITIVE:
    _at_least(c, path)
  for path in NON_NEGATIVE:
    _at_least(c, path, 0)
  check_choice("loss.balance_granularity", c.loss.balance_granularity, GRANULARITIES)
  check_choice("wandb.mode", c.wandb.mode, WANDB_MODES)
  check_choice("train.on_nonfinite", c.train.on_nonfinite, ("stop", "skip"))
  if c.data.batch_size % c.train.grad_accum:
    raise UserError(
      f"train.grad_accum={c.train.grad_accum} must divide data.batch_size={c.data.batch_size}"
    )
  if not 0 <= c.train.stop_at <= c.train.steps:
    raise UserError(
      f"train.stop_at={c.train.stop_at} is not allowed; use 0 (no early stop) "
      f"to train.steps={c.train.steps}"
    )
  _in_range(c, "optim.min_lr_ratio", 0, 1)
  _in_range(c, "optim.b1", 0, 1, hi_open=True)
  _in_range(c, "optim.b2", 0, 1, hi_open=True)
  if not c.optim.eps > 0:
    raise UserError(f"optim.eps={c.optim.eps} is not allowed; use a value > 0")
  data_lib.validate_config(c.data)
  build.model_config(c, vocab_size=max(c.model.vocab_size, 2))  # MoEConfig's own checks too
  build.loss_config(c, n_shards=1)  # checks loss.balance_convention/choices
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
