"""Multi-controller JAX: one process per host, each feeding its own rows of the global batch.

`initialize()` starts `jax.distributed` when this process is one of several:
* `JAX_NUM_PROCESSES` > 1 in the environment, with `JAX_COORDINATOR_ADDRESS` (host:port of
  process 0) and `JAX_PROCESS_ID` (0..N-1): any machines, e.g. several processes on one;
* otherwise a cluster JAX detects itself (Cloud TPU pod slice, SLURM, Kubernetes, Open MPI)
  reporting more than one process.
On CPU, cross-process collectives go through gloo (`jax_cpu_collectives_implementation`).
Everything else here is a no-op on a single process.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from moejax.errors import UserError

log = logging.getLogger(__name__)

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
CPU_COLLECTIVES = "gloo"
_started = False


@dataclasses.dataclass(frozen=True)
class Shard:
  """Which rows of every global batch a process loads: block `index` of `count` equal blocks."""

  index: int = 0
  count: int = 1


def _env_int(name: str, lo: int, hi: int | None = None) -> int:
  raw = os.environ.get(name, "")
  try:
    value = int(raw)
  except ValueError:
    value = None
  if value is None or value < lo or (hi is not None and value > hi):
    allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
    raise UserError(f"environment {name}={raw!r}: must be {allowed}")
  return value


def env_processes() -> tuple[str, int, int] | None:
  """(coordinator address, process count, process id) from JAX_* variables, or None."""
  if ENV_COUNT not in os.environ:
    return None
  count = _env_int(ENV_COUNT, 1)
  if count == 1:
    return None
  address = os.environ.get(ENV_ADDRESS, "")
  if ":" not in address:
    raise UserError(f"environment {ENV_ADDRESS}={address!r}: must be host:port of process 0")
  if ENV_ID not in os.environ:
    raise UserError(f"environment {ENV_ID} is required with {ENV_COUNT}={count}")
  return address, count, _env_int(ENV_ID, 0, count - 1)


def _detected_cluster() -> bool:
  """True in a cluster JAX's own detection recognizes with more than one process."""
  try:
    from jax._src import clusters  # pylint: disable=import-outside-toplevel

    for env in clusters.ClusterEnv._cluster_types:  # JAX's own registry
      if not env.opt_in_only_method and env.is_env_present():
        return env.get_process_count() > 1
  except Exception as e:  # noqa: BLE001  detection is best effort: a single process is always safe
    log.warning("cluster detection failed (%s); running as a single process", e)
  return False


def initialize() -> None:
  """Starts multi-process JAX when this process is one of several; idempotent."""
  global _started
  if _started:
    return
  spec = env_processes()
  if spec is None and not _detected_cluster():
    return
  jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
  if spec is None:
    jax.distributed.initialize()
  else:
    address, count, pid = spec
    jax.distributed.initialize(address, num_processes=count, process_id=pid)
  _started = True
  log.info("process %d of %d", jax.process_index(), jax.process_count())


def is_main() -> bool:
  """Process 0: the one that writes config.json, metrics, wandb and the grid."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """All processes wait here (no-op on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def process_rows(batch_sharding: jax.sharding.Sharding, global_rows: int) -> tuple[int, int]:
  """(shard_index, shard_count): this process holds rows [i·b, (i+1)·b), b = rows/count,
  of every global batch under `batch_sharding` (leading axis = sequences)."""
  shape = (global_rows,)
  starts = set()
  for idx in batch_sharding.addressable_devices_indices_map(shape).values():
    sl = idx[0] if idx else slice(None)
    starts.add(sl.indices(global_rows)[:2])
  lo, hi = min(s for s, _ in starts), max(e for _, e in starts)
  covered = np.zeros(global_rows, bool)
  for s, e in starts:
    covered[s:e] = True
  size = hi - lo
  if not covered[lo:hi].all() or global_rows % size or lo % size:
    raise UserError(
      f"this process's devices hold rows {sorted(starts)} of the {global_rows}-sequence batch; "
      "mesh.data × mesh.fsdp must split the batch into equal contiguous blocks per process"
    )
  return lo // size, global_rows // size


def process_shard(batch_sharding: jax.sharding.Sharding, global_rows: int) -> Shard:
  """The data shard this process loads: `process_rows` as a `Shard`."""
  return Shard(*process_rows(batch_sharding, global_rows))


def global_batch(
  local_NxL: np.ndarray, batch_sharding: jax.sharding.Sharding, global_rows: int
) -> jax.Array:
  """The global [global_rows, ...] array from this process's rows (`process_rows`)."""
  return jax.make_array_from_process_local_data(
    batch_sharding, local_NxL, (global_rows, *local_NxL.shape[1:])
  )
