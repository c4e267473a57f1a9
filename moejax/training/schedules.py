"""Learning-rate schedules by name (`optim.schedule`): a linear warmup from 0 to `optim.lr`,
then `cosine` (the default), `linear` or `constant` to `train.steps`, or warmup-stable-decay
(`wsd`): `lr` until the last `optim.decay_fraction` of the run, then a decay of shape
`optim.decay_shape` (`linear`, `cosine`, `1-sqrt`) to `lr · optim.min_lr_ratio`.

A WSD run's stable phase does not depend on `train.steps`, so a checkpoint taken in it
continues into any longer budget exactly (`trained_steps_match`: the resume check).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax

from moejax.config.sections import OptimConfig

# The decay's shape: t in [0, 1] of the decay -> the fraction of (lr - final lr) left.
DECAY_SHAPES: dict[str, Callable] = {
  "linear": lambda t: 1.0 - t,
  "cosine": lambda t: 0.5 * (1.0 + jnp.cos(jnp.pi * t)),
  "1-sqrt": lambda t: 1.0 - jnp.sqrt(t),
}


def warmup_steps(o: OptimConfig, steps: int) -> int:
  """`optim.warmup_steps`, clamped below `train.steps`."""
  return min(o.warmup_steps, max(steps - 1, 0))


def decay_steps(o: OptimConfig, steps: int) -> int:
  """WSD's decay length: `round(decay_fraction · steps)`, within [1, steps - warmup]."""
  return min(max(round(o.decay_fraction * steps), 1), max(steps - warmup_steps(o, steps), 1))


def _warmup(o: OptimConfig, steps: int) -> optax.Schedule:
  return optax.linear_schedule(0.0, o.lr, warmup_steps(o, steps))


def _after_warmup(o: OptimConfig, steps: int, after: optax.Schedule) -> optax.Schedule:
  """The warmup, then `after` counted from the warmup's end."""
  return optax.join_schedules([_warmup(o, steps), after], [warmup_steps(o, steps)])


def cosine(o: OptimConfig, steps: int) -> optax.Schedule:
  """Warmup, then a cosine to `lr · min_lr_ratio` at `steps` (optax's, as before issue 53)."""
  warmup = warmup_steps(o, steps)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=o.lr,
    warmup_steps=warmup,
    decay_steps=max(steps, warmup + 1),
    end_value=o.lr * o.min_lr_ratio,
  )


def linear(o: OptimConfig, steps: int) -> optax.Schedule:
  """Warmup, then a straight line to `lr · min_lr_ratio` at `steps`."""
  rest = max(steps - warmup_steps(o, steps), 1)
  return _after_warmup(o, steps, optax.linear_schedule(o.lr, o.lr * o.min_lr_ratio, rest))


def constant(o: OptimConfig, steps: int) -> optax.Schedule:
  """Warmup, then `lr` to the end."""
  return _after_warmup(o, steps, optax.constant_schedule(o.lr))


def wsd(o: OptimConfig, steps: int) -> optax.Schedule:
  """Warmup, `lr` (stable) until `steps - decay_steps`, then `decay_shape` to the final lr."""
  warmup, decay = warmup_steps(o, steps), decay_steps(o, steps)
  stable = steps - decay - warmup  # steps after the warmup at lr
  final, shape = o.lr * o.min_lr_ratio, DECAY_SHAPES[o.decay_shape]

  def after(count):
    t = jnp.clip((count - stable) / decay, 0.0, 1.0)
    return jnp.where(count < stable, o.lr, final + (o.lr - final) * shape(t))

  return _after_warmup(o, steps, after)


SCHEDULES: dict[str, Callable[[OptimConfig, int], optax.Schedule]] = {
  "cosine": cosine,
  "linear": linear,
  "constant": constant,
  "wsd": wsd,
}


def make(o: OptimConfig, steps: int) -> optax.Schedule:
  """The schedule `o.schedule` over a run of `steps` optimizer steps."""
  return SCHEDULES[o.schedule](o, steps)


def values(schedule: optax.Schedule, n: int) -> np.ndarray:
  """The learning rates of steps 0..n-1, as the train step computes them (int32 counts)."""
  return np.asarray(schedule(jnp.arange(n, dtype=jnp.int32)))


def trained_steps_match(old: optax.Schedule, new: optax.Schedule, trained: int) -> bool:
  """True when `new` gives every step already trained (0..trained-1) bitwise the learning
  rate `old` gave it: then a resume under `new` continues exactly as a run launched with it
  (the state at the checkpoint depends on the schedule only through those steps)."""
  return np.array_equal(values(old, trained), values(new, trained))
