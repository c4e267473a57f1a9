"""A `jax.profiler` trace of a few train steps (`train.profile_steps`, "A:B": steps A..B-1)
on process 0, written to `WORKDIR/profile/` (local or gs://): TensorBoard's profile plugin
(`tensorboard --logdir WORKDIR/profile`) and Perfetto (the `.trace.json.gz`) read it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

from moejax.config.sections import step_range


def directory(workdir: str) -> str:
  return os.path.join(workdir, "profile")  # os.path.join keeps gs:// as it is


class Profiler:
  """Starts the trace before step A is dispatched, stops it once step B-1 has finished."""

  def __init__(self, steps: str, workdir: str, log: Callable[[str], None]):
    window = step_range(steps) if jax.process_index() == 0 else None
    self.first, self.last = (window[0], window[1] - 1) if window else (0, -1)
    self.dir, self.log, self.active = directory(workdir), log, False

  def before(self, step: int) -> None:
    """Called before step `step` (1-based, as in metrics.jsonl) is dispatched."""
    if step == self.first:
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, state: Any) -> None:
    """Called once step `step` is dispatched; `state`: its output, waited for at the end."""
    if self.active and step == self.last:
      self.stop(state)

  def stop(self, state: Any = None) -> None:
    """Ends the trace (the window's last step, or a run that left before it)."""
    if not self.active:
      return
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    self.active = False
    self.log(f"profile of steps {self.first}..{self.last}: {self.dir} (docs/performance.md)")
