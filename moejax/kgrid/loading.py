"""A run, as evaluation needs it: config, held-out windows and parameters — nothing else.

No optimizer state is built or restored, and the training documents are never tokenized
(a BPE tokenizer is read from the run's cache; only without one is it retrained).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
from flax import nnx

from moejax.build import abstract_transformer
from moejax.config.run import RunConfig
from moejax.data import pipeline as data_lib
from moejax.errors import UserError
from moejax.nn.model import moe_layers
from moejax.nn.moe import RouterBias
from moejax.training import checkpoint
from moejax.training import workdir as workdir_lib


class EvalRun(NamedTuple):
  """A restored checkpoint: `nnx.merge(graphdef, params, router)` is the model."""

  step: int
  graphdef: Any
  params: Any
  router: Any
  heldout_NxL1: np.ndarray  # int32 held-out windows [N, seq_len + 1], in split order
  n_moe_layers: int


def load_config(workdir: str) -> RunConfig:
  """The run's saved config, with defaults for keys added since (workdir.from_saved)."""
  saved = workdir_lib.read_saved(workdir)
  if saved is None:
    raise UserError(
      f"{os.path.join(workdir, 'config.json')} not found; --workdir must be a moejax training run"
    )
  return workdir_lib.from_saved(saved)


def heldout_windows(rc: RunConfig, workdir: str) -> tuple[np.ndarray, int]:
  """(held-out windows [N, seq_len+1], vocab size): the trainer's own (`data.split_corpus`,
  or `data.prepared`'s held-out shards), so the same windows in the same order as its
  `Data.eval_batches`; the training documents are not encoded."""
  return data_lib.heldout_windows(rc.data, workdir)


def load_run(workdir: str, rc: RunConfig, step: int | None) -> EvalRun:
  """Restores only `params` and `router` of checkpoint `step` (None: the latest)."""
  mngr = checkpoint.manager(workdir, rc.train.keep_checkpoints)
  if mngr.latest_step() is None:
    raise UserError(f"no checkpoint in {workdir}/checkpoints; train first")
  windows_NxL1, vocab_size = heldout_windows(rc, workdir)
  model = abstract_transformer(rc.with_vocab(vocab_size).model)
  n_moe = len(moe_layers(model.cfg))
  graphdef, params, router = nnx.split(model, nnx.Param, RouterBias)
  try:
    step, restored = checkpoint.restore_params(mngr, {"params": params, "router": router}, step)
  finally:
    mngr.close()
  return EvalRun(step, graphdef, restored["params"], restored["router"], windows_NxL1, n_moe)
