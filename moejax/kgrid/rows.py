"""One JSON row per grid cell (docs/design.md §7 plus the issue-7 mass and RMS columns).

Row keys: `k1`, `k2`, `loss`, `accuracy`, `delta`, `delta_ci95`, `p_value`, `n_sequences`,
`loss_per_sequence` (mean loss of each evaluated sequence, in order, rounded to 1e-6: any
two cells, or runs of other seeds on the same held-out split, compare paired per sequence);
per MoE layer and averaged over layers (`X` and `X_per_layer`):
  `mass_k1`      Σ of the top-k1 scores (selection order)
  `mass_K`       Σ of the top-K scores, K the trained top-k
  `mass_k2`      the denominator actually used (k2's top-k2 mass; native: the rule's own,
                 1 for norm=none)
  `coef_sum`     Σ r_i, α included (`routed_mass`, docs/design.md §6's name, is the same value)
  `shared_coef`  mean shared coefficient c(x)
  `routed_rms`   RMS of Σ r_i·Expert_i(x) (after the `sqrt`/`gain` scale)
  `moe_rms`      RMS of the whole MoE branch, routed + shared
  `gain`         routed_rms / routed_rms of native k1 = K (docs/design.md §7)
  `moe_gain`     moe_rms / moe_rms of native k1 = K
and for the rescaling cells `scale` / `scale_per_layer`: the c_l applied.
"""

from __future__ import annotations

import numpy as np

from moejax import stats
from moejax.kgrid.cells import Cell
from moejax.kgrid.forward import CellResult

# row name -> LAYER_STATS name (rms names hold mean squares)
_LAYER_COLUMNS = {
  "mass_k1": "mass_k1",
  "mass_K": "mass_K",
  "mass_k2": "mass_k2",
  "coef_sum": "routed_mass",
  "routed_mass": "routed_mass",
  "shared_coef": "shared_coef",
  "routed_rms": "routed_out_rms",
  "moe_rms": "moe_out_rms",
}


def _ratio_M(ms_M: np.ndarray, ref_ms_M: np.ndarray) -> np.ndarray:
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(ref_ms_M > 0, np.sqrt(ms_M / ref_ms_M), np.nan)


def _put(row: dict, name: str, v_M: np.ndarray) -> None:
  row[name] = float(np.mean(v_M)) if v_M.size else float("nan")
  row[f"{name}_per_layer"] = {f"layer{i}": float(v) for i, v in enumerate(v_M)}


def row(
  cell: Cell,
  res: CellResult,
  ref: CellResult,
  *,
  resamples: int,
  seed: int,
  scale_M: np.ndarray | None = None,
) -> dict:
  """The row of `cell` from its result and the native k1 = K reference's."""
  k1, k2 = cell
  summary = stats.summarize_cell(res.loss_N, ref.loss_N, n_resamples=resamples, seed=seed)
  out = {
    "k1": k1,
    "k2": k2,
    "loss": float(res.loss_N.mean()),
    "accuracy": float(res.accuracy_N.mean()),
    "delta": float(summary["delta"]),
    "delta_ci95": [float(v) for v in summary["delta_ci95"]],
    "p_value": float(summary["p_value"]),
    "n_sequences": int(res.loss_N.shape[0]),
    "loss_per_sequence": [round(float(v), 6) for v in res.loss_N],
  }
  for name, stat in _LAYER_COLUMNS.items():
    v_M = res.layers[stat]
    _put(out, name, np.sqrt(v_M) if stat.endswith("_rms") else v_M)
  _put(out, "gain", _ratio_M(res.layers["routed_out_rms"], ref.layers["routed_out_rms"]))
  _put(out, "moe_gain", _ratio_M(res.layers["moe_out_rms"], ref.layers["moe_out_rms"]))
  if scale_M is not None:
    _put(out, "scale", np.asarray(scale_M, np.float64))
  return out
