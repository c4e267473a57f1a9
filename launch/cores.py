"""CPU pinning for local sweeps (`--cores-per-run N`): each running child gets its own N
cores, as a CPU affinity mask set before it starts. XLA:CPU sizes its intra-op thread pool
from the affinity mask (measured: a pinned jax process starts 13 threads on 1 core, 17 on
2), so the mask also sets XLA's threads to the run's cores.
"""

from __future__ import annotations

import os

from moejax.errors import UserError

AUTO = -1  # --cores-per-run's default: `default_per_run(parallel)`


def default_per_run(parallel: int, available: set[int] | None = None) -> int:
  """One run at a time: no pinning (XLA uses every core). Several: the cores split evenly.
  Measured on this repo's 2-core machine with the study's own runs (`python
  benchmarks/sweep_throughput.py`): two runs pinned one core each train 1.53x the aggregate
  tokens/s of one run at a time on both cores, and finish the pair 1.51x sooner."""
  cpus = os.sched_getaffinity(0) if available is None else available
  return len(cpus) // parallel if parallel > 1 else 0


def groups(cores_per_run: int, parallel: int, available: set[int] | None = None) -> list[tuple]:
  """`parallel` disjoint groups of `cores_per_run` cores from this process's affinity mask;
  [] when pinning is off (0)."""
  if cores_per_run == 0:
    return []
  cpus = sorted(os.sched_getaffinity(0) if available is None else available)
  if cores_per_run < 0 or cores_per_run * parallel > len(cpus):
    raise UserError(
      f"--cores-per-run {cores_per_run} is not allowed with --parallel {parallel}: "
      f"use 0 (no pinning) or 1..{len(cpus) // parallel} ({len(cpus)} cores here)"
    )
  n = cores_per_run
  return [tuple(cpus[i * n : (i + 1) * n]) for i in range(parallel)]


class Pool:
  """Core groups handed to running jobs and taken back when they finish."""

  def __init__(self, core_groups: list[tuple]):
    self.free = list(core_groups)

  def take(self) -> tuple | None:
    return self.free.pop(0) if self.free else None

  def give(self, cores: tuple | None) -> None:
    if cores:
      self.free.append(cores)
      self.free.sort()


def preexec(cores: tuple | None):
  """A Popen `preexec_fn` pinning the child to `cores` (None: no pinning)."""
  if not cores:
    return None
  return lambda: os.sched_setaffinity(0, cores)
