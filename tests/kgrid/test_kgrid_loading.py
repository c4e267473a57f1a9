"""Evaluation loading and compiles (moejax.kgrid.loading, forward): one compile per k1 and
k2 family, the params-only restore and held-out windows, and a deterministic grid."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.kgrid.run import run_grid
from moejax.training import checkpoint, trainer

from .helpers import BATCH, GRID, QUIET, E, K, cells_of, read
from runconfig import as_run, saved_eval


def test_one_compile_serves_every_k2_and_scale(restored):
  """k2 and the routed scale are traced: cells (K, 4), (K, 8) share one compiled forward, and
  native, sqrt and gain scales another (k1 stays static)."""
  _, ev, fwd = restored
  batches = [ev.heldout_NxL1[:BATCH]]
  fwd.run(batches, K)
  a = fwd.run(batches, K, k2=K)
  b = fwd.run(batches, K, k2=E)
  fwd.run(batches, K, scale_M=np.array([0.5, 2.0], np.float32))
  assert fwd.compiled(K, True)._cache_size() == 1
  assert fwd.compiled(K, False)._cache_size() == 1
  assert a.layers["mass_k2"] == pytest.approx(a.layers["mass_k1"], rel=1e-6)  # k2 = k1 = K
  assert b.layers["mass_k2"] == pytest.approx([1.0, 1.0], rel=1e-5)  # softmax over all E


def test_params_only_restore_and_heldout_match_trainer(restored, trained):
  """The evaluator's params-only restore and held-out windows equal the trainer's."""
  c, ev, _ = restored
  run = trainer.build(as_run(c), trained)
  _, state, _ = checkpoint.restore(checkpoint.manager(trained), run.state)
  for name, tree in (("params", ev.params), ("router", ev.router)):
    want = jax.tree.leaves(nnx.to_pure_dict(state[name]))
    got = jax.tree.leaves(nnx.to_pure_dict(tree))
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want)), name
  windows = np.concatenate(run.data.eval_batches(10**6, BATCH))
  assert np.array_equal(ev.heldout_NxL1, windows)
  assert ev.step == 30 and ev.n_moe_layers == 2


# ---------------------------------------------------------------- 7: determinism


def test_run_grid_deterministic(mixtral_grid):
  workdir, rows = mixtral_grid
  first = read(os.path.join(workdir, "eval", "k_grid.jsonl"))
  again = run_grid(
    workdir, saved_eval(workdir, k1="4,2", k2="native,k1,E,sqrt,gain", **GRID), **QUIET
  )
  assert again == rows
  assert read(os.path.join(workdir, "eval", "k_grid.jsonl")) == first
  # a cell's row does not depend on which other cells run
  subset = cells_of(run_grid(workdir, saved_eval(workdir, k1="2", k2="8", **GRID), **QUIET))
  assert set(subset) == {(K, "native"), (2, 8)}
  for cell, row in subset.items():
    assert row == cells_of(rows)[cell], cell
