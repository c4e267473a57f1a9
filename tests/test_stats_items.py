"""moejax.stats on per-item right/wrong outcomes (downstream tasks, issue 52): exact McNemar,
the paired bootstrap of Δ accuracy, Holm across cells, each against an independent reference."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from moejax import stats
from moejax.errors import UserError


def test_mcnemar_published_example():
  """The k1:k2 write-up: 127 items flipped to wrong, 103 to right, p = 0.13."""
  p = stats.mcnemar_exact(127, 103)
  assert round(p, 2) == 0.13, p
  assert math.isclose(p, sps.binomtest(103, 230, 0.5).pvalue, rel_tol=1e-12)


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (5, 0), (3, 3), (1, 9), (40, 17), (500, 430)])
def test_mcnemar_against_binomtest(b, c):
  expected = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
  assert math.isclose(stats.mcnemar_exact(b, c), expected, rel_tol=1e-10, abs_tol=1e-300)
  assert stats.mcnemar_exact(b, c) == stats.mcnemar_exact(c, b)


def _holm_loop(p):
  """Holm by its definition: reject in ascending order while p_(i) <= α/(m − i); the
  adjusted p of each is the smallest α at which it is rejected (searched on a grid of the
  candidate values m − i times p_(i))."""
  m = len(p)
  order = sorted(range(m), key=lambda i: p[i])
  adjusted = [1.0] * m
  candidates = sorted({min(1.0, (m - r) * p[order[r]]) for r in range(m)} | {1.0})
  for alpha in reversed(candidates):
    for r, i in enumerate(order):
      if p[i] <= alpha / (m - r) + 1e-15:
        adjusted[i] = min(adjusted[i], alpha)
      else:
        break
  return adjusted


def test_holm_against_definition():
  rng = np.random.default_rng(0)
  for m in (1, 2, 3, 7):
    for _ in range(20):
      p = list(rng.uniform(0, 0.3, size=m) ** 2)
      np.testing.assert_allclose(stats.holm(p), _holm_loop(p), rtol=1e-12)
  np.testing.assert_allclose(stats.holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
  with pytest.raises(UserError, match="p_values"):
    stats.holm([0.1, 1.5])


def test_accuracy_delta_counts_and_bootstrap_against_hand_loop():
  rng = np.random.default_rng(3)
  ref = rng.random(300) < 0.6
  now = np.where(rng.random(300) < 0.15, ~ref, ref)
  out = stats.accuracy_delta(now, ref, n_resamples=1000, seed=5)
  b = sum(1 for r, x in zip(ref, now) if r and not x)
  c = sum(1 for r, x in zip(ref, now) if x and not r)
  assert (out.flips_to_wrong, out.flips_to_right, out.n_items) == (b, c, 300)
  assert math.isclose(out.accuracy, sum(now) / 300)
  assert math.isclose(out.delta_points, 100 * (sum(now) - sum(ref)) / 300)
  assert math.isclose(out.mcnemar_p, sps.binomtest(min(b, c), b + c, 0.5).pvalue, rel_tol=1e-10)
  # the paired bootstrap by hand: resample items (the same indices for both cells)
  gen = np.random.default_rng(5)
  idx = gen.integers(0, 300, size=(1000, 300))
  means = [100 * (now[i].mean() - ref[i].mean()) for i in idx]
  np.testing.assert_allclose(out.delta_ci95, np.quantile(means, [0.025, 0.975]), rtol=1e-12)
  assert out.delta_ci95[0] < out.delta_points < out.delta_ci95[1]


def test_accuracy_delta_identical_and_bad_input():
  ref = np.array([1, 0, 1, 1], bool)
  out = stats.accuracy_delta(ref, ref)
  assert (out.delta_points, out.delta_ci95, out.mcnemar_p) == (0.0, (0.0, 0.0), 1.0)
  with pytest.raises(UserError, match="same items"):
    stats.accuracy_delta(ref, ref[:3])
  with pytest.raises(UserError, match="0/1"):
    stats.accuracy_delta([0.5, 1], [1, 1])


def test_binomial_ci_covers_chance():
  lo, hi = stats.binomial_ci(25, 100)
  assert lo < 0.25 < hi
  ref = sps.beta.ppf([0.025, 0.975], [25, 26], [76, 75])  # Clopper–Pearson from the beta
  np.testing.assert_allclose((lo, hi), ref, rtol=1e-8)
