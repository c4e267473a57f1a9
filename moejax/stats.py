"""Statistics for the k1:k2 grid: paired per-sequence tests of a cell against the reference
cell within one run, a seed-level (hierarchical bootstrap) estimate across runs, and the
downstream-task tests on per-item right/wrong outcomes (exact McNemar, Holm)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import stats as sps

from moejax.errors import UserError

MIN_RESAMPLES = 1000
# A cell whose per-sequence losses differ from the reference by less than this times the
# reference's mean |loss| is the same computation up to float rounding: Δ 0, p 1.
EQUAL_RTOL = 1e-6
_CHUNK_ELEMENTS = 2_000_000  # resample indices drawn per chunk, bounds memory


def _as_diff(diff_N, name: str = "diff_N") -> np.ndarray:
  diff_N = np.asarray(diff_N, dtype=np.float64)
  if diff_N.ndim != 1 or diff_N.size == 0:
    raise UserError(f"{name}: must be a non-empty 1-D array, got shape {diff_N.shape}")
  if not np.all(np.isfinite(diff_N)):
    raise UserError(f"{name}: must be finite (no NaN or inf)")
  return diff_N


def paired_bootstrap_ci(
  diff_N, *, n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
  """Percentile-bootstrap CI of the mean per-sequence difference; deterministic per seed."""
  diff_N = _as_diff(diff_N)
  if int(n_resamples) != n_resamples or n_resamples < MIN_RESAMPLES:
    raise UserError(f"n_resamples: got {n_resamples!r}, allowed an int >= {MIN_RESAMPLES}")
  if not 0.0 < confidence < 1.0:
    raise UserError(f"confidence: got {confidence!r}, allowed a float in (0, 1)")
  n = diff_N.size
  rng = np.random.default_rng(seed)
  chunk = max(1, _CHUNK_ELEMENTS // n)
  means_R = np.empty(int(n_resamples))
  for start in range(0, int(n_resamples), chunk):
    stop = min(start + chunk, int(n_resamples))
    idx_RxN = rng.integers(0, n, size=(stop - start, n))
    means_R[start:stop] = diff_N[idx_RxN].mean(axis=1)
  alpha = 1.0 - confidence
  low, high = np.quantile(means_R, [alpha / 2, 1.0 - alpha / 2])
  return float(low), float(high)


def paired_p_value(diff_N) -> float:
  """Two-sided paired t-test (one-sample t-test of the differences against 0, = ttest_rel).

  Chosen because per-sequence loss differences average many tokens and are near-normal;
  all-zero differences give 1.0, constant non-zero differences give 0.0 (never NaN).
  """
  diff_N = _as_diff(diff_N)
  if diff_N.size < 2:
    raise UserError(f"diff_N: needs at least 2 sequences for a paired test, got {diff_N.size}")
  if np.all(diff_N == 0.0):
    return 1.0
  if np.all(diff_N == diff_N[0]):
    return 0.0
  return float(sps.ttest_1samp(diff_N, 0.0).pvalue)


def summarize_cell(loss_N, ref_loss_N, **kw) -> dict:
  """Delta, paired-bootstrap CI and p-value of a cell's per-sequence losses vs the reference.

  `kw` goes to `paired_bootstrap_ci` (n_resamples, confidence, seed). Differences all below
  EQUAL_RTOL · mean|ref| are float rounding of the same computation (e.g. softmax ÷ Σ of all
  E scores vs no normalization): reported as Δ 0, CI [0, 0], p 1, never significant.
  """
  loss_N = _as_diff(loss_N, "loss_N")
  ref_loss_N = _as_diff(ref_loss_N, "ref_loss_N")
  if loss_N.shape != ref_loss_N.shape:
    raise UserError(
      f"ref_loss_N: shape {ref_loss_N.shape} must equal loss_N shape "
      f"{loss_N.shape} (same sequences, same order)"
    )
  diff_N = loss_N - ref_loss_N
  if np.max(np.abs(diff_N)) <= EQUAL_RTOL * np.mean(np.abs(ref_loss_N)):
    return {"delta": 0.0, "delta_ci95": [0.0, 0.0], "p_value": 1.0}
  low, high = paired_bootstrap_ci(diff_N, **kw)
  p_value = paired_p_value(diff_N)
  return {"delta": float(diff_N.mean()), "delta_ci95": [low, high], "p_value": p_value}


def seed_level(
  deltas_by_seed: list, n_resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, tuple[float, float]]:
  """(mean, (lo, hi)): the mean over seeds of each seed's mean per-sequence Δ, with a
  percentile CI from a hierarchical bootstrap that includes seed-to-seed variance.

  Each resample draws S seeds with replacement, then, for every drawn seed, its sequences
  with replacement, and averages the drawn seeds' means. With one seed this is the paired
  bootstrap of that seed. Deterministic per `seed`.
  """
  if not isinstance(deltas_by_seed, (list, tuple)) or not deltas_by_seed:
    raise UserError("deltas_by_seed: must be a non-empty list of 1-D arrays (one per seed)")
  if int(n_resamples) != n_resamples or n_resamples < MIN_RESAMPLES:
    raise UserError(f"n_resamples: got {n_resamples!r}, allowed an int >= {MIN_RESAMPLES}")
  if not 0.0 < confidence < 1.0:
    raise UserError(f"confidence: got {confidence!r}, allowed a float in (0, 1)")
  seeds = [_as_diff(d, f"deltas_by_seed[{i}]") for i, d in enumerate(deltas_by_seed)]
  S, R = len(seeds), int(n_resamples)
  rng = np.random.default_rng(seed)
  pick_RxS = rng.integers(0, S, size=(R, S))
  means_RxS = np.empty((R, S))
  for s, d_N in enumerate(seeds):  # every slot that drew seed s gets one bootstrap mean of s
    slots = np.flatnonzero(pick_RxS.ravel() == s)
    chunk = max(1, _CHUNK_ELEMENTS // d_N.size)
    for start in range(0, slots.size, chunk):
      part = slots[start : start + chunk]
      idx_PxN = rng.integers(0, d_N.size, size=(part.size, d_N.size))
      means_RxS.ravel()[part] = d_N[idx_PxN].mean(axis=1)
  alpha = 1.0 - confidence
  low, high = np.quantile(means_RxS.mean(axis=1), [alpha / 2, 1.0 - alpha / 2])
  return float(np.mean([d.mean() for d in seeds])), (float(low), float(high))


# ----------------------------------------------------------------- per-item right/wrong outcomes


class AccuracyDelta(NamedTuple):
  """A cell's per-item outcomes against the reference cell's on the same items."""

  accuracy: float
  delta_points: float  # 100 · (accuracy − reference accuracy)
  flips_to_wrong: int  # right at the reference, wrong here
  flips_to_right: int  # wrong at the reference, right here
  mcnemar_p: float  # exact (binomial) McNemar on the discordant pairs
  delta_ci95: tuple[float, float]  # paired bootstrap over items, in points
  n_items: int


def mcnemar_exact(flips_to_wrong: int, flips_to_right: int) -> float:
  """Two-sided exact McNemar p: under H0 each of the b + c discordant items flips either way
  with probability 1/2, so p = min(1, 2·P[Binomial(b + c, 1/2) <= min(b, c)]); 1 for b + c = 0."""
  b, c = int(flips_to_wrong), int(flips_to_right)
  if b < 0 or c < 0:
    raise UserError(f"flips: counts must be >= 0, got {b} and {c}")
  if b + c == 0:
    return 1.0
  return float(min(1.0, 2.0 * sps.binom.cdf(min(b, c), b + c, 0.5)))


def holm(p_values) -> np.ndarray:
  """Holm–Bonferroni adjusted p-values, in the input's order (step-down, made monotone)."""
  p_P = np.asarray(p_values, np.float64)
  if p_P.ndim != 1 or not np.all((p_P >= 0) & (p_P <= 1)):
    raise UserError(f"p_values: must be a 1-D array of probabilities in [0, 1], got {p_values!r}")
  m = p_P.size
  order = np.argsort(p_P, kind="stable")
  stepped = np.maximum.accumulate((m - np.arange(m)) * p_P[order])
  out = np.empty(m)
  out[order] = np.minimum(1.0, stepped)
  return out


def _as_outcomes(correct_N, name: str) -> np.ndarray:
  out = np.asarray(correct_N)
  if out.ndim != 1 or out.size == 0 or not np.isin(out, (0, 1)).all():
    raise UserError(f"{name}: must be a non-empty 1-D array of 0/1 (or bool) outcomes")
  return out.astype(bool)


def accuracy_delta(correct_N, ref_correct_N, **kw) -> AccuracyDelta:
  """Accuracy, Δ points, flips, exact McNemar p and the paired-bootstrap CI of Δ (points) of
  a cell's per-item outcomes against the reference's. `kw` goes to `paired_bootstrap_ci`."""
  now_N, ref_N = _as_outcomes(correct_N, "correct_N"), _as_outcomes(ref_correct_N, "ref_correct_N")
  if now_N.shape != ref_N.shape:
    raise UserError(
      f"ref_correct_N: shape {ref_N.shape} must equal correct_N shape {now_N.shape} (same items)"
    )
  diff_N = 100.0 * (now_N.astype(np.float64) - ref_N)
  to_wrong, to_right = int(np.sum(ref_N & ~now_N)), int(np.sum(~ref_N & now_N))
  ci = (0.0, 0.0) if to_wrong + to_right == 0 else paired_bootstrap_ci(diff_N, **kw)
  return AccuracyDelta(
    accuracy=float(now_N.mean()),
    delta_points=float(diff_N.mean()),
    flips_to_wrong=to_wrong,
    flips_to_right=to_right,
    mcnemar_p=mcnemar_exact(to_wrong, to_right),
    delta_ci95=ci,
    n_items=int(now_N.size),
  )


def binomial_ci(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
  """Clopper–Pearson (exact) CI of a proportion, e.g. an accuracy against chance."""
  res = sps.binomtest(int(successes), int(n)).proportion_ci(confidence, method="exact")
  return float(res.low), float(res.high)
