"""The device study's first steps, measured: the first arm's train step built, compiled and
run as the trainer runs it, before any arm, so that the plan (device_plan.py) stands on this
device's tokens/s and compile seconds at the preset's own shape, which no committed figure
measures.

The program is the trainer's (`trainer.build`, `trainer.compile_steps`: the guarded step,
the state donated), fed by the trainer's data iterator; each step's non-finite flag is
fetched once the next step is queued, as the trainer's loop does. `setup_s` is the build
(data and initial state), `compile_s` the first step (trace, lower, compile, run), and
`tokens_per_s` the rate over `steps` steps after WARMUP more. The compile cache
(`train.compile_cache`) keeps the program, so the first arm, at the same steps, reads its
train step back.
"""

from __future__ import annotations

import gc
import time
from typing import NamedTuple

from moejax.config import RunConfig

WARMUP = 3


class Probe(NamedTuple):
  setup_s: float
  compile_s: float
  tokens_per_s: float
  steps: int


def probe(rc: RunConfig, steps: int) -> Probe:
  """Builds the run of `rc`, compiles its train step and times `steps` steps of it."""
  # pylint: disable=import-outside-toplevel
  import jax

  from moejax import distributed, sharding
  from moejax.training import compile_cache, trainer

  compile_cache.enable(rc.train.compile_cache)
  t0 = time.perf_counter()
  run = trainer.build(rc, None, trainer.check_config(rc))
  d = run.config.data
  batch_sharding = sharding.batch_sharding(run.mesh)
  it = run.data.train_iterator(distributed.process_shard(batch_sharding, d.batch_size))

  def batch():
    return distributed.global_batch(next(it)["tokens"], batch_sharding, d.batch_size)

  train_step, _ = trainer.compile_steps(run)
  key, state = jax.random.key(rc.train.seed), run.state
  setup_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  state, metrics = train_step(state, batch(), jax.random.fold_in(key, 0))
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  for i in range(1, WARMUP + 1):
    state, metrics = train_step(state, batch(), jax.random.fold_in(key, i))
  jax.block_until_ready(metrics)
  t0, previous = time.perf_counter(), None
  for i in range(WARMUP + 1, WARMUP + 1 + steps):
    state, metrics = train_step(state, batch(), jax.random.fold_in(key, i))
    if previous is not None:
      jax.device_get(previous["nonfinite"])
    previous = metrics
  jax.block_until_ready(metrics)
  seconds = time.perf_counter() - t0
  del run, state, metrics, previous
  gc.collect()
  return Probe(setup_s, compile_s, steps * d.batch_size * d.seq_len / seconds, steps)
