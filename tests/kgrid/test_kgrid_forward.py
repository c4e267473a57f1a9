"""Grid cells against an independent NumPy forward pass (helpers.my_forward): every cell of a
mixtral run, k2 = k1 and k2 = E identities, a sigmoid group-limited rule (deepseek_v3)."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kgrid import report
from moejax.nn import routing

from .helpers import E, K, assert_row_matches, cells_of, expected_row, read, reference_cells

# ---------------------------------------------------------------- 1, 2: cells vs a NumPy forward


def test_cell_loss_matches_independent_forward(mixtral_grid):
  """Cell (k1=2, k2=8) of a mixtral run: r_i = s_i / Σ_{top-8} s over the top-2 experts."""
  workdir, rows = mixtral_grid
  got = cells_of(rows)
  ref = reference_cells(workdir, "mixtral", [(K, "native"), (2, 8)])
  exp = expected_row(ref[(2, 8)], ref[(K, "native")])
  assert_row_matches(got[(2, 8)], exp, "(2, 8)")
  assert_row_matches(
    got[(K, "native")], expected_row(ref[(K, "native")], ref[(K, "native")]), "(K, native)"
  )
  # the cell is not trivially equal to native: half the routed mass is gone
  assert exp["routed_mass"] < 0.9
  assert abs(got[(2, 8)]["loss"] - got[(2, "native")]["loss"]) > 1e-6


def test_every_mixtral_cell_matches_independent_forward(mixtral_grid):
  workdir, rows = mixtral_grid
  got = cells_of(rows)
  want = {(4, "native"), (4, 4), (4, 8), (2, "native"), (2, 2), (2, 8), (2, "sqrt"), (2, "gain")}
  assert set(got) == want
  assert got[(2, "sqrt")]["scale_per_layer"] == pytest.approx(
    {"layer0": 0.5**0.5, "layer1": 0.5**0.5}
  )
  scales = {c: list(got[c]["scale_per_layer"].values()) for c in [(2, "sqrt"), (2, "gain")]}
  ref = reference_cells(workdir, "mixtral", list(got), scales=scales)
  for cell, row in got.items():
    assert_row_matches(row, expected_row(ref[cell], ref[(K, "native")]), cell)


def test_k2_equal_k1_is_native_for_renormalized_rule(mixtral_grid):
  got = cells_of(mixtral_grid[1])
  native = got[(K, "native")]
  assert native["delta"] == 0.0 and native["gain"] == 1.0 and native["p_value"] == 1.0
  # p == 1 and a [0, 0] CI: every per-sequence difference is zero up to float rounding
  assert got[(K, K)]["delta"] == 0.0 and got[(K, K)]["delta_ci95"] == [0.0, 0.0]
  assert got[(K, K)]["p_value"] == 1.0
  assert got[(K, K)]["loss"] == pytest.approx(native["loss"], rel=1e-6)
  for key in ("loss", "accuracy", "delta", "delta_ci95", "p_value", "routed_mass", "gain"):
    assert got[(2, 2)][key] == pytest.approx(got[(2, "native")][key], rel=1e-5, abs=1e-6), key
  assert got[(2, "native")]["routed_mass"] == pytest.approx(1.0, abs=1e-5)


def test_k2_equal_E_is_native_for_olmoe(olmoe_grid):
  workdir, rows = olmoe_grid
  got = cells_of(rows)
  assert set(got) == {(4, "native"), (4, 8), (2, "native"), (2, 8)}
  for k1 in (4, 2):
    a, b = got[(k1, "native")], got[(k1, E)]
    assert abs(a["loss"] - b["loss"]) < 1e-5, k1
    assert abs(a["routed_mass"] - b["routed_mass"]) < 1e-5, k1
    assert abs(a["gain"] - b["gain"]) < 1e-4, k1
  # (K, E) is native up to float rounding (softmax ÷ Σ of all E = 1): Δ 0, p 1, no star
  assert got[(K, E)]["delta"] == 0.0 and got[(K, E)]["delta_ci95"] == [0.0, 0.0]
  assert got[(K, E)]["p_value"] == 1.0 and not report.is_significant(got[(K, E)])
  md = read(os.path.join(workdir, "eval", "k_grid.md"))
  assert "-0.0000" not in md and "+0.0000*" not in md
  assert "Note: sqrt: not defined" in md  # olmoe does not normalize: no sqrt cell
  assert "8 (= no renorm)" in md and "sigmoids" not in md
  # olmoe does not renormalize: the top-4 of 8 softmax scores carry less than all the mass
  assert got[(K, "native")]["routed_mass"] < 0.99
  ref = reference_cells(workdir, "olmoe", list(got))
  for cell, row in got.items():
    assert_row_matches(row, expected_row(ref[cell], ref[(K, "native")]), cell)


# ---------------------------------------------------------------- 3: sigmoid, group-limited rule


def test_sigmoid_rule_routed_mass_follows_top_k2_formula(v3_grid):
  workdir, rows = v3_grid
  got = cells_of(rows)
  assert set(got) == {(2, "native"), (2, 2), (2, 4), (2, 6), (2, 8)}
  ref = reference_cells(workdir, "deepseek_v3", [(2, "native"), (2, 2), (2, 4), (2, 8)], train_k=2)
  for cell in [(2, "native"), (2, 2), (2, 4), (2, 8)]:
    assert_row_matches(got[cell], expected_row(ref[cell], ref[(2, "native")]), cell)
  m = {k2: got[(2, k2)]["routed_mass"] for k2 in ("native", 2, 4, 8)}
  assert m["native"] == pytest.approx(2.5, abs=1e-5)  # renormalized, scaled by 2.5
  assert m[2] == pytest.approx(m["native"], abs=1e-6)  # k2 = k1 = K: the rule's own norm
  assert m[8] < m[4] < m[2]
  assert got[(2, 8)]["delta"] != 0.0
  md = read(os.path.join(workdir, "eval", "k_grid.md"))
  assert "8 (÷ all E sigmoids)" in md and "no renorm" not in md


def test_sigmoid_k2_beyond_kept_groups_uses_best_masked_experts(v3_grid):
  """k2 = 6 > the 4 experts of the kept groups: the denominator adds the 2 best-scoring
  experts of the dropped groups (the routed mass must not depend on expert numbering)."""
  workdir, rows = v3_grid
  row = cells_of(rows)[(2, 6)]
  ref = reference_cells(workdir, "deepseek_v3", [(2, "native"), (2, 6)], train_k=2)
  exp = expected_row(ref[(2, 6)], ref[(2, "native")])
  assert abs(row["routed_mass"] - exp["routed_mass"]) < 1e-4, (
    row["routed_mass"],
    exp["routed_mass"],
  )
  assert abs(row["loss"] - exp["loss"]) < 1e-4, (row["loss"], exp["loss"])


def test_k2_override_independent_of_expert_numbering():
  """The same failure at the routing level: relabeling experts (swapping two groups) must not
  change Σ r_i when k2 reaches past the kept groups."""
  rule = dataclasses.replace(routing.RULES["deepseek_v3"], n_groups=4, topk_groups=2)
  z = np.array([[3.0, 2.9, -5.0, -6.0, 2.0, 1.9, 1.0, 0.5]], np.float32)  # keeps groups 0, 2
  perm = [0, 1, 6, 7, 4, 5, 2, 3]  # swap the dropped groups 1 and 3
  a = float(routing.route(jnp.asarray(z), rule, 2, k2=6).weights_TxK.sum())
  b = float(routing.route(jnp.asarray(z[:, perm]), rule, 2, k2=6).weights_TxK.sum())
  s = 1 / (1 + np.exp(-z[0].astype(np.float64)))
  want = 2.5 * (s[0] + s[1]) / s[[0, 1, 4, 5, 6, 7]].sum()  # kept + the 2 best dropped
  assert a == pytest.approx(b, abs=1e-6), (a, b)
  assert a == pytest.approx(want, abs=1e-5), (a, want)
