"""The step loop's stall at a checkpoint save, sync vs async (`train.async_checkpoints`).

Run: python benchmarks/checkpoint_stall.py [--mib 64,256] [--repeats 3] [--root DIR] [--fake-gcs]
A state of float32 arrays (16 leaves) of each size in `--mib`, saved by
`moejax.training.checkpoint.save` into a fresh step of a manager under `--root` (default: a
temporary folder on local disk; `--fake-gcs`: a bucket of the in-memory fake GCS server the
tests use, tests/gcs_fixture.py, over loopback http). `stall_ms`: how long the save call holds the loop (sync:
the whole write; async: until the arrays are copied to host memory); `written_ms`: until the
step is committed (async: the save plus `checkpoint.wait`). Arms interleave, min of
`--repeats`. Writes benchmarks/results/checkpoint_stall.json (`--result NAME` for another).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

from moejax.training import checkpoint

LEAVES = 16


def state_of(mib: int) -> dict:
  n = mib * 2**20 // 4 // LEAVES
  keys = jax.random.split(jax.random.key(0), LEAVES)
  return {f"w{i}": jax.random.normal(k, (n,), jnp.float32) for i, k in enumerate(keys)}


def timed_save(root: str, state: dict, async_save: bool) -> tuple[float, float]:
  """(stall, written) seconds of one save into a fresh manager under `root`."""
  mngr = checkpoint.manager(f"{root}/{uuid.uuid4().hex}", async_save=async_save)
  t = time.perf_counter()
  checkpoint.save(mngr, 1, state, {"pos": 1})
  stall = time.perf_counter() - t
  checkpoint.wait(mngr)
  written = time.perf_counter() - t
  mngr.close()
  return stall, written


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mib", default="64,256")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--root", default="")
  p.add_argument("--fake-gcs", action="store_true")
  p.add_argument("--result", default="checkpoint_stall")
  args = p.parse_args()
  rows = []
  with storage(args) as (root, disk):
    for mib in map(int, args.mib.split(",")):
      state = jax.block_until_ready(state_of(mib))
      best = {arm: [float("inf")] * 2 for arm in ("sync", "async")}
      timed_save(root, state, True)  # warm-up: orbax's first save sets up its threads
      for _ in range(args.repeats):
        for arm, times in best.items():
          got = timed_save(root, state, arm == "async")
          best[arm] = [min(a, b) for a, b in zip(times, got)]
      sync, async_ = best["sync"], best["async"]
      rows.append({
        "state_mib": mib, "sync_stall_ms": 1e3 * sync[0], "async_stall_ms": 1e3 * async_[0],
        "async_written_ms": 1e3 * async_[1], "async_over_sync_stall": async_[0] / sync[0],
      })  # fmt: skip
      print(rows[-1], flush=True)
  write_result(args.result, {"rows": rows, "disk": disk})


@contextlib.contextmanager
def storage(args):
  """(root, what it is): the fake GCS server's bucket, or a temporary local folder."""
  if not args.fake_gcs:
    with tempfile.TemporaryDirectory(dir=args.root or None) as root:
      yield root, args.root or "local"
    return
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
  import gcs_fixture  # pylint: disable=import-outside-toplevel  (the tests' fake server)

  server = gcs_fixture.gcs.__wrapped__()
  gcs = next(server)
  try:
    yield gcs.uri("stall"), "fake GCS (tests/gcs_fixture.py, in memory, loopback http)"
  finally:
    server.close()


if __name__ == "__main__":
  main()
