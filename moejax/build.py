"""The model of a run config, concrete or abstract: shared by training, evaluation and imports."""

from __future__ import annotations

import ml_collections
from flax import nnx

from moejax import config as config_lib
from moejax.model import Transformer


def build_model(c: ml_collections.ConfigDict, vocab_size: int) -> Transformer:
  """The Transformer of config `c`, initialized from `train.seed`."""
  return Transformer(config_lib.model_config(c, vocab_size), rngs=nnx.Rngs(c.train.seed))


def abstract_model(c: ml_collections.ConfigDict, vocab_size: int) -> Transformer:
  """The same model with `jax.ShapeDtypeStruct` leaves: shapes for a restore, no memory."""
  return nnx.eval_shape(lambda: build_model(c, vocab_size))
