"""`RunConfig`: a run's whole config, typed; built once from the ConfigDict by
`moejax.config.reader.resolve` and passed from the entry points to every consumer."""

from __future__ import annotations

import dataclasses

from moejax.config import sections
from moejax.data.config import DataConfig
from moejax.errors import UserError
from moejax.nn import routing
from moejax.nn.losses import LossConfig
from moejax.nn.model import VOCAB_MULTIPLE, ModelConfig
from moejax.nn.moe import MoEConfig

# `model.moe` keys that replace a field of the named rule (routing.compose_rule) when set:
# the group counts when > 0, every other rule field when not None.
RULE_COUNTS = ("n_groups", "topk_groups")
RULE_OVERRIDES = tuple(f for f in routing.RULE_FIELDS if f not in RULE_COUNTS)
# MoEConfig fields copied from `model.*` (not keys of `model.moe`).
MOE_FROM_MODEL = ("d_model", "dtype", "init_std")
# `model` keys that are not ModelConfig fields: the `moe` section.
MODEL_READ_ELSEWHERE = ("moe",)
# LossConfig fields that come from the run, not from `loss.*`.
LOSS_FROM_RUN = ("n_shards", "grad_accum")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every section of a run, typed. `model.vocab_size` is 0 until the tokenizer is known
  (`with_vocab`), unless the config set it; `loss.n_shards` is 1 until the mesh is
  (`with_shards`). `tree` is the ConfigDict's values as plain dicts: config.json's keys.
  `vocab_multiple`: what `with_vocab` pads the embedding to (1 for a run saved before
  the padding, `moejax.training.workdir.from_saved`)."""

  model: ModelConfig
  loss: LossConfig
  data: DataConfig
  train: sections.TrainConfig
  optim: sections.OptimConfig
  eval: sections.EvalConfig
  wandb: sections.WandbConfig
  mesh: sections.MeshConfig
  tree: dict = dataclasses.field(repr=False, compare=False)
  vocab_multiple: int = VOCAB_MULTIPLE

  @property
  def moe(self) -> MoEConfig | None:
    return self.model.moe

  @property
  def rule(self) -> routing.MergeRule | None:
    return None if self.model.moe is None else self.model.moe.merge_rule

  def resolved_rule(self) -> dict:
    """config.json `resolved.rule`: every field of the rule the run trains with."""
    return routing.rule_dict(self.rule) if self.rule is not None else {}

  def with_vocab(self, tokenizer_vocab: int) -> RunConfig:
    """The model's vocabulary resolved: `model.vocab_size`, or the tokenizer's when 0; the
    embedding padded to a multiple of `vocab_multiple` rows (`ModelConfig.padded_vocab`),
    an explicit `model.vocab_size` too (its ids are the scored ones; the padding's are
    masked)."""
    set_vocab = self.tree["model"]["vocab_size"]
    if 0 < set_vocab < tokenizer_vocab:
      raise UserError(
        f"model.vocab_size={set_vocab} is below the tokenizer's {tokenizer_vocab}; "
        f"use 0 (the tokenizer's) or >= {tokenizer_vocab}"
      )
    model = dataclasses.replace(
      self.model, vocab_size=set_vocab or tokenizer_vocab, vocab_multiple=self.vocab_multiple
    )
    return dataclasses.replace(self, model=model)

  def with_shards(self, n_shards: int) -> RunConfig:
    """The loss's data-parallel shard count (`micro_batch` balance granularity)."""
    return dataclasses.replace(self, loss=dataclasses.replace(self.loss, n_shards=n_shards))
