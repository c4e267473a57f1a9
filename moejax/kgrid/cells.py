"""Which cells a grid runs: the k1 values and k2 labels (parsed by `moejax.config.grid_labels`,
where a run config's check reads them) resolved per k1 into cells (docs/design.md §7), and
what each rescaling cell computes (`RESCALINGS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from moejax.config.grid_labels import NAMED_K2, NATIVE
from moejax.kgrid import gain


class Rescaling(NamedTuple):
  """A rescaling cell: the native coefficients, MoE layer l's routed output times c_l."""

  scale: Callable[[gain.ScaleInputs], np.ndarray]  # c_M of a cell at k1
  column: str  # its column label in k_grid.md and k_grid.png
  needs_norm: bool = False  # undefined for a rule without normalization: skipped, with a note
  calibrated: bool = False  # fitted on the calibration split (eval.gain_sequences windows)


# The rescaling cells, in report column order (grid_labels.RESCALED, where a config's check
# reads their labels): adding one is its label there and its entry here (the grid, the report
# and the dashboards iterate this table). Neither runs at k1 = K (native there).
RESCALINGS: dict[str, Rescaling] = {
  "sqrt": Rescaling(gain.sqrt_cell, column="sqrt √(k1/K)", needs_norm=True),
  "gain": Rescaling(gain.gain_cell, column="gain", calibrated=True),
}

Cell = tuple[int, int | str]  # (k1, k2): k2 an int, "native", "sqrt" or "gain"

# wandb summary scalars of the cells at k1 = K/4, one per k2 label (the dashboards' bar chart
# compares them across rules): `eval/delta_k1_quarter/<label>`.
QUARTER_PREFIX = "eval/delta_k1_quarter/"


def relative_label(k1: int, k2: int | str, K: int, E: int) -> str:
  """The k2 of a cell as a label that means the same thing in every run: the first of
  grid_labels.LABELS that resolves to it (`k1` before `K`, ...), else the integer as text."""
  if isinstance(k2, str):
    return k2
  for label, fn in NAMED_K2.items():
    if fn(k1, K, E) == k2:
      return label
  return str(k2)


def quarter_summary(rows: list[dict], K: int, E: int) -> dict[str, float]:
  """{QUARTER_PREFIX + label: delta} for the rows at k1 = max(1, K // 4)."""
  k1 = max(1, K // 4)
  return {
    QUARTER_PREFIX + relative_label(k1, r["k2"], K, E): r["delta"] for r in rows if r["k1"] == k1
  }


def cells(
  k1s: list[int], labels: list[str | int], K: int, E: int, *, normalizes: bool
) -> tuple[list[Cell], list[str]]:
  """(cells, notes): resolved, deduplicated cells, the native k1 = K reference first.

  Integer k2 is kept only when k1 <= k2 <= E. The rescaling cells are skipped at k1 = K (they
  are native there), and those that need a normalization (`sqrt`) for rules that do not
  normalize (`normalizes=False`: Σ r_i then already shrinks with k1); each such skip adds a
  note for the report."""
  out: list[Cell] = [(K, NATIVE)]  # the reference every delta is measured against
  notes: list[str] = []
  for k1 in k1s:
    for label in labels:
      rescaling = RESCALINGS.get(label)
      if rescaling is not None and k1 == K:
        continue
      if rescaling is not None and rescaling.needs_norm and not normalizes:
        note = f"{label}: not defined for a rule without normalization (norm=none); skipped"
        notes += [note] if note not in notes else []
        continue
      named = label == NATIVE or rescaling is not None or isinstance(label, int)
      k2 = label if named else NAMED_K2[label](k1, K, E)
      if isinstance(k2, int) and not k1 <= k2 <= E:
        continue
      if (k1, k2) not in out:
        out.append((k1, k2))
  return out, notes


def calibrated(labels: list[str | int]) -> list[str]:
  """The labels of `labels` whose cells are fitted on the calibration split (`gain`)."""
  return [k2 for k2 in dict.fromkeys(labels) if k2 in RESCALINGS and RESCALINGS[k2].calibrated]
