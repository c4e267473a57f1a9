"""Compiles and wall time of a k1:k2 grid: one compiled step per cell (static k2, the former
evaluator) vs moejax.kgrid's traced k2 and routed scale (one per k1).

    python benchmarks/kgrid_compiles.py --workdir DIR [--k1 4,2,1] [--k2 native,k1,K,2K,E]

DIR is a trained run (e.g. tests' tiny config). Both variants run in this process on the
same restored parameters and held-out batches; the printed ratio is per-cell over shared.
Writes benchmarks/results/kgrid_compiles.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from moejax.config import grid_labels
from moejax.kgrid import cells as cells_lib
from moejax.kgrid import loading
from moejax.kgrid.forward import CellForward
from moejax.nn.overrides import Overrides
from moejax.training import step as step_lib

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

_COMPILES: list[float] = []


def _listen(event: str, duration: float, **_) -> None:
  if event.endswith("backend_compile_duration"):
    _COMPILES.append(duration)


def _measure(fn) -> tuple[int, float, float]:
  """(compiles, seconds compiling, wall seconds) of fn()."""
  start, t0 = len(_COMPILES), time.perf_counter()
  fn()
  return len(_COMPILES) - start, sum(_COMPILES[start:]), time.perf_counter() - t0


def report(results: dict) -> dict:
  """Prints each variant's compiles and seconds and the ratios per-cell/shared; returns them."""
  rows = []
  for name, (n, secs, wall) in results.items():
    print(f"{name:9s}: {n:3d} compiles, {secs:6.2f} s compiling, {wall:6.2f} s wall")
    rows.append({"variant": name, "compiles": n, "compiling_s": secs, "wall_s": wall})
  (n0, _, w0), (n1, _, w1) = results["per-cell"], results["shared"]
  print(f"ratio per-cell/shared: compiles {n0 / max(n1, 1):.2f}x, wall {w0 / w1:.2f}x")
  assert np.isfinite(w0 + w1)
  ratios = {"compiles_per_cell_over_shared": n0 / max(n1, 1), "wall_per_cell_over_shared": w0 / w1}
  return {"rows": rows, **ratios}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--k1", default="")
  ap.add_argument("--k2", default="native,k1,K,2K,E")
  ap.add_argument("--sequences", type=int, default=16)
  ap.add_argument("--batch_size", type=int, default=8)
  ap.add_argument("--result", default="kgrid_compiles", help="benchmarks/results/<NAME>.json")
  args = ap.parse_args()
  jax.monitoring.register_event_duration_secs_listener(_listen)
  rc = loading.load_config(args.workdir)
  K, E = rc.moe.top_k, rc.moe.n_experts
  k1s = grid_labels.parse_k1(args.k1, K, E)
  norm = rc.rule.norm != "none"
  cells, _ = cells_lib.cells(k1s, grid_labels.parse_k2(args.k2, K, E, k1s), K, E, normalizes=norm)
  ev = loading.load_run(args.workdir, rc, None)
  w = ev.heldout_NxL1[: args.sequences]
  batches = [w[i : i + args.batch_size] for i in range(0, len(w), args.batch_size)]
  state = {"params": ev.params, "router": ev.router}

  def per_cell():
    for k1, k2 in cells:
      ov = Overrides(k=k1, k2=None if k2 == "native" else k2)
      fn = step_lib.make_eval_step(ev.graphdef, ov)
      step_lib.evaluate_batches(jax.jit(fn), state, batches)

  def shared():
    fwd = CellForward(ev.graphdef, ev.params, ev.router, ev.n_moe_layers)
    for k1, k2 in cells:
      fwd.run(batches, k1, k2=k2 if isinstance(k2, int) else None)

  shapes = len({b.shape for b in batches})
  print(f"{len(cells)} cells, k1 {k1s}, {len(batches)} batches ({shapes} shape(s))")
  results = {name: _measure(fn) for name, fn in (("per-cell", per_cell), ("shared", shared))}
  grid = {"cells": len(cells), "k1": ",".join(map(str, k1s)), "batches": len(batches)}
  write_result(args.result, {**report(results), **grid})


if __name__ == "__main__":
  main()
