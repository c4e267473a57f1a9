"""The rescaling cells of the grid (docs/design.md §7): `sqrt` and the fitted per-layer `gain`.

Both multiply the routed output Σ r_i·Expert_i(x) of each MoE layer by a scalar c_l (the
shared expert is left alone: its coefficient does not depend on k1). For rules without a
shared expert the routed output is the whole MoE branch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np


class ScaleInputs(NamedTuple):
  """What a rescaling cell's per-layer scale c_M is computed from (cells.RESCALINGS)."""

  k1: int
  K: int
  n_moe_layers: int
  # (k1, scale_M or None) -> the routed output's mean square per MoE layer, calibration split
  measure_ms: Callable[[int, np.ndarray | None], np.ndarray]
  target_ms: Callable[[], np.ndarray]  # native k1 = K's measure_ms (computed once, on demand)


def sqrt_scale(k1: int, K: int, n_moe_layers: int) -> np.ndarray:
  """c_l = √(k1/K) in every layer: the independence approximation of restoring the trained
  routed RMS for a rule whose Σ r_i does not depend on k (OLMo-core's √(k0/k) rescale)."""
  return np.full((n_moe_layers,), math.sqrt(k1 / K), np.float32)


def fit_gain(measure_ms: Callable[[np.ndarray], np.ndarray], target_ms_M: np.ndarray) -> np.ndarray:
  """Per-layer c_l with RMS(c_l · routed_l) = √target_l, fitted in layer order.

  `measure_ms(scale_M)` returns the routed output's mean square per MoE layer on the
  calibration split with those scales applied. Layer l is measured with the already fitted
  c_0..c_{l-1} in place (they change its input) and c_l = 1; the routed output is linear
  in c_l, so c_l = √(target_l / ms_l) is exact. A layer with zero routed output keeps 1.
  """
  target_ms_M = np.asarray(target_ms_M, np.float64)
  scale_M = np.ones(target_ms_M.shape, np.float32)
  for layer in range(target_ms_M.shape[0]):
    ms = float(np.asarray(measure_ms(scale_M.copy()))[layer])
    if ms > 0 and math.isfinite(ms):
      scale_M[layer] = math.sqrt(target_ms_M[layer] / ms)
  return scale_M


def sqrt_cell(x: ScaleInputs) -> np.ndarray:
  """The `sqrt` cell's scales: `sqrt_scale` (no calibration)."""
  return sqrt_scale(x.k1, x.K, x.n_moe_layers)


def gain_cell(x: ScaleInputs) -> np.ndarray:
  """The `gain` cell's scales: `fit_gain` at k1 to native k1 = K's routed mean square."""
  return fit_gain(lambda scale_M: x.measure_ms(x.k1, scale_M), x.target_ms())
