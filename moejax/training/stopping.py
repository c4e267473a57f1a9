"""Graceful stop on SIGTERM (preemption notice) and SIGINT (Ctrl-C).

While training, the signal only sets a flag; the loop sees it after the step in flight,
saves a checkpoint at that step and returns normally (exit 0). On multi-host runs orbax's
preemption sync point (`CheckpointManager.reached_preemption`) makes every host agree on
the step to save.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
  """A flag set by SIGTERM/SIGINT while `installed()` is active."""

  def __init__(self):
    self.signal_name: str | None = None

  def _handler(self, signum, frame):  # pylint: disable=unused-argument
    self.signal_name = signal.Signals(signum).name

  @contextlib.contextmanager
  def installed(self):
    """Catches the signals in this block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    old = {s: signal.signal(s, self._handler) for s in SIGNALS}
    try:
      yield self
    finally:
      for s, h in old.items():
        signal.signal(s, h)

  def requested(self, mngr, step: int) -> bool:
    """A signal arrived here, or (multi-host) orbax reached a preemption sync point."""
    return self.signal_name is not None or bool(mngr.reached_preemption(step))
