"""Timing helpers: interleaved repeats, min-of-N, so shared-machine noise hits all arms alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def interleaved_min(fns: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
  """Seconds per call for each fn: warm up all, then run them round-robin and keep the min."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - t)
  return best
