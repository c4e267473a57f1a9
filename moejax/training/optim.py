"""AdamW with a learning-rate schedule (moejax.training.schedules) and global-norm clipping
(config `optim.*`)."""

from __future__ import annotations

import jax
import optax

from moejax import sharding
from moejax.config.sections import OptimConfig
from moejax.training import schedules


def schedule(o: OptimConfig, steps: int) -> optax.Schedule:
  """`optim.schedule` over `steps` (`train.steps`; moejax.training.schedules)."""
  return schedules.make(o, steps)


def decay_mask(params):
  """Weight decay on matrices only; norms' scales and other vectors are not decayed. A
  scanned stack's leaf is judged by one layer's slice (its [L, D] norm scales are vectors)."""
  return jax.tree_util.tree_map_with_path(lambda path, p: sharding.layer_ndim(path, p) >= 2, params)


def optimizer(o: OptimConfig, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax transformation and its learning-rate schedule over `steps` (`train.steps`)."""
  lr = schedule(o, steps)
  tx = optax.chain(
    optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity(),
    optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask),
  )
  return tx, lr
