"""The train loop (nanodo's shape): log, eval and checkpoint each fire on their own cadence.

A step's metrics are fetched after the next step has been dispatched, so logging does not
stall the device; the non-finite flag (moejax.training.nonfinite) is checked for every step. Steps
that evaluate or checkpoint fetch at once: their state is needed before the next step
donates it. The last step does everything; a SIGTERM/SIGINT checkpoints the current step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from moejax.config.sections import TrainConfig
from moejax.sizing import flops
from moejax.training import checkpoint, nonfinite, profiling


class Diverged(RuntimeError):
  """A non-finite step under `train.on_nonfinite=stop` (or too many skips in a row)."""


class SaveFailed(RuntimeError):
  """Writing a checkpoint failed (e.g. a full disk); earlier checkpoints are intact."""


@dataclasses.dataclass(frozen=True)
class Cadence:
  """Fires every `every` steps and at the `last` step."""

  every: int
  last: int

  def due(self, step: int) -> bool:
    return step % self.every == 0 or step == self.last


@dataclasses.dataclass
class LoopSetup:
  """What the loop runs: built once by the trainer."""

  config: TrainConfig  # the cadences and the non-finite policy
  step_fn: Callable  # jitted guarded train step (state, tokens, rng) -> (state, metrics)
  evaluate: Callable[[Any], float]  # state -> held-out loss (train.eval_sequences)
  next_tokens: Callable[[], jax.Array]  # the next sharded batch
  data_state: Callable[[], dict]  # the iterator position, checkpointed with the state
  mngr: Any  # orbax CheckpointManager
  write_row: Callable[[dict], None]  # metrics.jsonl + wandb
  rng: jax.Array
  moe_layers: list[int]
  tokens_per_step: int
  log: Callable[[str], None]
  progress: Any  # tqdm bar
  perf: flops.Perf | None = None  # model FLOPs and device peak: the perf/ metrics of each row
  synced: Callable[[], None] = lambda: None  # after each checkpoint: store buffered rows
  profiler: profiling.Profiler = dataclasses.field(  # train.profile_steps ('': none)
    default_factory=lambda: profiling.Profiler("", "", print)
  )


@dataclasses.dataclass
class LoopResult:
  state: Any
  step: int  # the last completed step
  eval_loss: float | None
  stopped_by: str | None  # the signal that stopped the run early
  skipped: int


class Loop:
  """State that lives across steps: timers, skip counters, the last saved step."""

  def __init__(self, s: LoopSetup, start: int, end: int):
    self.s, self.start, self.end = s, start, end
    self.log_c = Cadence(s.config.log_every, end)
    self.eval_c = Cadence(s.config.eval_every, end)
    self.ckpt_c = Cadence(s.config.ckpt_every, end)
    self.last_saved = start if start > 0 else None  # the newest save (maybe still writing)
    self.written = self.last_saved  # the newest save known to be written
    self.skips_in_row = self.skipped = 0
    self.t_last, self.step_last = time.time(), start
    self.eval_loss = None

  def run(self, state, stop) -> LoopResult:
    """Steps start+1..end. After each dispatch, the previous step's outputs if they were
    deferred; then this step's cadences in order: the divergence check (every step), eval,
    log, checkpoint, and the stop request. A step that neither evaluates nor checkpoints
    is deferred: fetched once the next step is queued, so the device never waits."""
    s, deferred = self.s, None
    for i in range(self.start, self.end):
      s.profiler.before(i + 1)
      state, metrics = s.step_fn(state, s.next_tokens(), jax.random.fold_in(s.rng, i))
      step = i + 1
      s.profiler.after(step, state)
      if deferred is not None:  # the previous step's outputs, now that this one is queued
        self.check_and_log(*deferred)
      deferred = None
      s.progress.update(1)
      stopping = stop.requested(s.mngr, step)
      evaluating, saving = self.eval_c.due(step), self.ckpt_c.due(step) or stopping
      if not (evaluating or saving):
        deferred = (step, metrics)
        continue
      logging = self.log_c.due(step) or evaluating
      host = self.fetch(metrics, logging)
      self.check(step, host)
      if evaluating:
        self.eval_loss = host["eval_loss"] = float(s.evaluate(state))
      if logging:
        self.emit(step, host)
      if saving:
        self.save(state, step)
      if stopping:
        self.wait_saves()
        s.log(f"stopped by {stop.signal_name or 'preemption'} at step {step}; checkpoint saved")
        return LoopResult(
          state, step, self.eval_loss, stop.signal_name or "preemption", self.skipped
        )
    self.wait_saves()
    return LoopResult(state, self.end, self.eval_loss, None, self.skipped)

  def check_and_log(self, step: int, metrics: dict) -> None:
    """A deferred step's cadences: the divergence check, then its row if the log is due."""
    logging = self.log_c.due(step)
    host = self.fetch(metrics, logging)
    self.check(step, host)
    if logging:
      self.emit(step, host)

  def fetch(self, metrics: dict, logging: bool) -> dict:
    """Host copy of a step's outputs: every metric (as floats) on a logged step, else just
    the non-finite flag."""
    keys = metrics if logging else ("nonfinite",)
    host = jax.device_get({k: metrics[k] for k in keys})
    return {k: float(v) for k, v in host.items()} if logging else host

  def good_checkpoint(self) -> str:
    if self.last_saved is None:
      return "no checkpoint was saved before it"
    return f"the last good checkpoint is {self.s.mngr.directory}/{self.last_saved}"

  def check(self, step: int, host: dict) -> None:
    """Raises Diverged per the policy when the step's flag is set."""
    flag = int(host["nonfinite"])
    if not flag:
      self.skips_in_row = 0
      return
    what = nonfinite.describe(flag, self.s.moe_layers)
    if self.s.config.on_nonfinite == "stop":
      raise Diverged(
        f"non-finite {what} at step {step} (train.on_nonfinite=stop); stopped, "
        f"{self.good_checkpoint()}"
      )
    self.skips_in_row += 1
    self.skipped += 1
    if self.skips_in_row > self.s.config.max_skips:
      raise Diverged(
        f"non-finite {what} at step {step}: {self.skips_in_row} steps in a row skipped, > "
        f"train.max_skips={self.s.config.max_skips}; stopped, {self.good_checkpoint()}"
      )

  def row(self, step: int, host: dict) -> dict:
    now = time.time()
    host["tokens_per_sec"] = (
      (step - self.step_last) * self.s.tokens_per_step / max(now - self.t_last, 1e-9)
    )
    self.t_last, self.step_last = now, step
    if self.s.perf is not None:
      mean_k = host.get(flops.MEAN_K_METRIC)
      host.update(flops.perf_metrics(self.s.perf, host["tokens_per_sec"], mean_k))
    host.pop("nonfinite")
    host["skipped_steps"] = float(self.skipped)
    host.pop("skipped", None)
    return {"step": step, **host}

  def emit(self, step: int, host: dict) -> None:
    row = self.row(step, host)
    self.s.write_row(row)
    self.s.progress.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_sec']:.0f}")

  def save(self, state, step: int) -> None:
    """Saves `step` once the save before it is written (async: the write goes on behind)."""
    self.wait_saves()
    try:
      checkpoint.save(self.s.mngr, step, state, self.s.data_state())
    except Exception as e:  # noqa: BLE001  (orbax may wrap the OSError of a full disk)
      raise SaveFailed(
        f"saving checkpoint {self.s.mngr.directory}/{step} failed ({e}); {self.good_checkpoint()}"
      ) from None
    self.last_saved = step
    self.s.synced()

  def wait_saves(self) -> None:
    """Until the last save is written: before the next save, at a stop and at the end."""
    try:
      checkpoint.wait(self.s.mngr)
    except Exception as e:  # noqa: BLE001  (as in save)
      failed, self.last_saved = self.last_saved, self.written
      raise SaveFailed(
        f"saving checkpoint {self.s.mngr.directory}/{failed} failed ({e}); {self.good_checkpoint()}"
      ) from None
    self.written = self.last_saved


def mean_loss(loss_N: np.ndarray) -> float:
  return float(np.mean(loss_N, dtype=np.float64))
