"""One grid row (moejax.kgrid.rows): paired statistics against the native k1 = K cell."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moejax.kgrid import forward
from moejax.kgrid import rows as krows

from .helpers import ROW_KEYS, K

# ---------------------------------------------------------------- 4: paired statistics of a row


def _fake(loss_N, ms=1.0, mass=1.0):
  layers = {name: np.array([0.3, 0.4]) for name in forward.LAYER_STATS}
  layers.update(
    routed_mass=np.array([mass, mass]),
    routed_out_rms=np.array([ms, 4 * ms]),  # mean squares
    moe_out_rms=np.array([ms, 4 * ms]),
  )
  return forward.CellResult(np.asarray(loss_N), np.full(len(loss_N), 0.5), layers)


def test_row_detects_known_shift():
  rng = np.random.default_rng(0)
  n, shift = 64, 0.05
  ref_N = rng.normal(3.0, 0.3, n)
  loss_N = ref_N + shift + rng.normal(0.0, 0.05, n)
  row = krows.row((2, 8), _fake(loss_N, ms=0.25, mass=0.6), _fake(ref_N), resamples=1000, seed=0)
  assert row["k1"] == 2 and row["k2"] == 8 and ROW_KEYS <= set(row)
  assert row["delta"] == pytest.approx(float(np.mean(loss_N - ref_N)), abs=1e-12)
  assert row["loss"] == pytest.approx(float(loss_N.mean()), abs=1e-12)
  lo, hi = row["delta_ci95"]
  assert lo < shift < hi and lo > 0
  assert row["p_value"] < 0.05
  assert row["gain"] == pytest.approx(0.5)  # sqrt(0.25 / 1) and sqrt(1 / 4)
  assert row["routed_mass"] == pytest.approx(0.6) and row["coef_sum"] == row["routed_mass"]
  assert row["routed_rms_per_layer"] == {"layer0": 0.5, "layer1": 1.0}  # √ of the mean squares
  assert row["moe_gain"] == pytest.approx(0.5) and row["mass_k1"] == pytest.approx(0.35)
  assert row["n_sequences"] == n
  np.testing.assert_allclose(row["loss_per_sequence"], loss_N, atol=1e-6)  # in sequence order
  json.dumps(row)  # rows go to k_grid.jsonl


def test_row_ci_coverage_and_null():
  """Over many synthetic grids the 95% CI covers the true shift ~95% of the time, and a
  zero shift is rarely called significant."""
  n, shift, reps = 48, 0.02, 200
  covered = rejected_null = 0
  for rep in range(reps):
    rng = np.random.default_rng(100 + rep)
    ref_N = rng.normal(3.0, 0.3, n)
    noise = rng.normal(0.0, 0.05, n)
    alt = krows.row((1, 8), _fake(ref_N + shift + noise), _fake(ref_N), resamples=1000, seed=rep)
    covered += alt["delta_ci95"][0] <= shift <= alt["delta_ci95"][1]
    null = krows.row((1, 8), _fake(ref_N + noise), _fake(ref_N), resamples=1000, seed=rep)
    rejected_null += null["p_value"] < 0.05
  assert 0.90 * reps <= covered <= 0.99 * reps, covered
  assert rejected_null <= 0.10 * reps, rejected_null


def test_reference_row_is_exactly_zero():
  ref_N = np.random.default_rng(3).normal(3.0, 0.3, 16)
  row = krows.row((K, "native"), _fake(ref_N), _fake(ref_N), resamples=1000, seed=0)
  assert row["delta"] == 0.0 and row["delta_ci95"] == [0.0, 0.0]
  assert row["p_value"] == 1.0 and row["gain"] == 1.0
