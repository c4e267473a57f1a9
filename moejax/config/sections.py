"""The run's own sections, `train`, `optim`, `eval`, `wandb` and `mesh`, as typed, frozen
dataclasses: each key's default, what it allows and its meaning (moejax.schema), checked by
the section itself. The other sections are the dataclasses of what they build:
`model` (nn.model.ModelConfig), `model.moe` (nn.moe.MoEConfig), `loss` (nn.losses.LossConfig),
`data` (data.config.DataConfig).
"""

from __future__ import annotations

import dataclasses

from moejax.errors import UserError
from moejax.schema import check_fields, key

NONFINITE = ("stop", "skip")
WANDB_MODES = ("auto", "online", "offline", "disabled")
SCHEDULES = ("cosine", "linear", "constant", "wsd")  # moejax.training.schedules.SCHEDULES
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # moejax.training.schedules.DECAY_SHAPES


def step_range(text: str, name: str = "train.profile_steps") -> tuple[int, int] | None:
  """`"A:B"` as (A, B): the steps A..B-1 (a slice of metrics.jsonl's step numbers); '': None."""
  if not text:
    return None
  a, sep, b = text.partition(":")
  if sep and a.strip().isdigit() and b.strip().isdigit() and 1 <= int(a) < int(b):
    return int(a), int(b)
  raise UserError(
    f"{name}={text!r} is not allowed; use 'A:B' with 1 <= A < B (steps A..B-1) or '' (off)"
  )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """`train.*`: the loop: length, seed, logging, evaluation and checkpoint cadence."""

  steps: int = key(1000, "optimizer steps of the run", ge=1)
  seed: int = key(0, "seed of the initialization, the data order and the routers' draws")
  log_every: int = key(10, "steps between metric lines (metrics.jsonl, wandb)", ge=1)
  eval_every: int = key(200, "steps between held-out evaluations", ge=1)
  eval_sequences: int = key(64, "held-out windows of each evaluation during training", ge=1)
  ckpt_every: int = key(200, "steps between checkpoints", ge=1)
  keep_checkpoints: int = key(3, "checkpoints kept in WORKDIR/checkpoints (the newest)", ge=1)
  async_checkpoints: bool = key(
    True, "write checkpoints in the background; wait only at the next save, a stop, the end"
  )
  grad_accum: int = key(1, "micro-batches per step; must divide data.batch_size", ge=1)
  progress: bool = key(True, "a tqdm progress bar on the terminal")
  stop_at: int = key(0, "leave early at this step, resumable (0: train.steps)", ge=0)
  on_nonfinite: str = key(
    "stop", "a non-finite loss or gradient: stop, or skip the step", NONFINITE
  )
  max_skips: int = key(10, "with on_nonfinite=skip: stop after more skipped steps in a row", ge=0)
  compile_cache: str = key(
    "auto",
    "JAX's persistent compilation cache: a folder or gs://; auto: JAX_COMPILATION_CACHE_DIR, "
    "else ~/.cache/moejax/xla; '': off",
  )
  tensorboard: bool = key(True, "TensorBoard events in WORKDIR/tensorboard (tensorboardX)")
  profile_steps: str = key(
    "", "A:B: a jax.profiler trace of steps A..B-1 in WORKDIR/profile ('': none)"
  )

  def __post_init__(self):
    check_fields(self, "train")
    window = step_range(self.profile_steps)
    if window and window[1] - 1 > self.steps:  # steps that never run: no trace, or a short one
      a, b = window
      raise UserError(
        f"train.profile_steps={self.profile_steps!r} profiles steps {a}..{b - 1}, past "
        f"train.steps={self.steps}; use 'A:B' with 1 <= A < B <= {self.steps + 1} "
        "(steps A..B-1), or '' (off)"
      )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """`optim.*`: AdamW with a warmup and a learning-rate schedule, and global-norm clipping."""

  lr: float = key(3e-3, "peak learning rate", ge=0)
  warmup_steps: int = key(100, "linear warmup steps (clamped below train.steps)", ge=0)
  schedule: str = key(
    "cosine",
    "after the warmup: cosine, linear or constant to train.steps, or wsd (warmup-stable-decay)",
    SCHEDULES,
  )
  min_lr_ratio: float = key(
    0.1, "the final learning rate (cosine, linear, wsd), as a fraction of lr", ge=0, le=1
  )
  decay_fraction: float = key(
    0.2, "wsd: the decay's share of train.steps (the last round(fraction * steps))", gt=0, le=1
  )
  decay_shape: str = key("1-sqrt", "wsd: the decay's shape", DECAY_SHAPES)
  weight_decay: float = key(0.1, "AdamW's decoupled weight decay (matrices only)", ge=0)
  b1: float = key(0.9, "AdamW's first-moment decay", ge=0, lt=1)
  b2: float = key(0.95, "AdamW's second-moment decay", ge=0, lt=1)
  eps: float = key(1e-8, "AdamW's epsilon", gt=0)
  clip_norm: float = key(1.0, "global gradient-norm clip (0: off)", ge=0)

  def __post_init__(self):
    check_fields(self, "optim")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """`eval.*`: the k1:k2 grid of the final checkpoint (moejax.kgrid, docs/kgrid.md)."""

  k1: str = key("", "k1 values, comma-separated ('': K, K/2, ..., 1)")
  k2: str = key("", "k2 labels or integers, comma-separated ('': native,k1,K,2K,E)")
  sequences: int = key(256, "held-out windows the grid evaluates", ge=1)
  batch_size: int = key(32, "windows per grid forward", ge=1)
  bootstrap_resamples: int = key(2000, "resamples of the paired bootstrap CIs", ge=1000)
  after_train: bool = key(False, "run the grid when training ends")
  gain_sequences: int = key(64, "held-out windows after the evaluated ones: the gain fit", ge=1)

  def __post_init__(self):
    check_fields(self, "eval")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """`wandb.*`: the run's wandb logging (moejax.training.tracking)."""

  mode: str = key("auto", "auto: online with an API key, else offline", WANDB_MODES)
  project: str = key("moejax", "wandb project")
  entity: str = key("", "wandb entity ('': the API key's default)")
  name: str = key("", "run name ('': wandb's own)")
  tags: str = key("", "comma-separated tags")
  group: str = key("", "run group (a sweep sets it)")

  def __post_init__(self):
    check_fields(self, "wandb")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`mesh.*`: the device mesh (data, fsdp, expert); their product is the device count."""

  data: int = key(-1, "data-parallel axis (-1: the devices the other axes leave)")
  fsdp: int = key(1, "parameter- and optimizer-sharded data axis", ge=1)
  expert: int = key(1, "expert-parallel axis (experts sharded over it)", ge=1)

  def __post_init__(self):
    check_fields(self, "mesh")
    if self.data != -1 and self.data < 1:
      raise UserError(f"mesh.data={self.data} is not allowed; use -1 (fill in) or an int >= 1")


# The run's own sections, by config name (the others are the builders' dataclasses).
RUN_SECTIONS = {
  "train": TrainConfig,
  "optim": OptimConfig,
  "eval": EvalConfig,
  "wandb": WandbConfig,
  "mesh": MeshConfig,
}
