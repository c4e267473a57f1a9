"""Which cells a grid runs: k1 values, k2 labels, and their resolution per k1 (docs/design.md §7).

k1 is the number of experts activated at inference. k2 is an integer denominator override
(p_i = s_i / Σ_{top-k2} s_j), `native` (the trained rule's own normalization), or one of the
rescaling cells `sqrt` and `gain` (native coefficients times a per-layer scalar).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from moejax.errors import UserError
from moejax.kgrid import gain

NATIVE = "native"
NAMED_K2 = {  # label -> k2 as a function of (k1, K, E)
  "k1": lambda k1, K, E: k1,
  "K": lambda k1, K, E: K,
  "2K": lambda k1, K, E: 2 * K,
  "4K": lambda k1, K, E: 4 * K,
  "E": lambda k1, K, E: E,
}


class Rescaling(NamedTuple):
  """A rescaling cell: the native coefficients, MoE layer l's routed output times c_l."""

  scale: Callable[[gain.ScaleInputs], np.ndarray]  # c_M of a cell at k1
  column: str  # its column label in k_grid.md and k_grid.png
  needs_norm: bool = False  # undefined for a rule without normalization: skipped, with a note
  calibrated: bool = False  # fitted on the calibration split (eval.gain_sequences windows)


# The rescaling cells, in report column order: adding one is one entry here (the grid,
# the report and the dashboards iterate this table). Neither runs at k1 = K (native there).
RESCALINGS: dict[str, Rescaling] = {
  "sqrt": Rescaling(gain.sqrt_cell, column="sqrt √(k1/K)", needs_norm=True),
  "gain": Rescaling(gain.gain_cell, column="gain", calibrated=True),
}
LABELS = (NATIVE, *NAMED_K2, *RESCALINGS)
DEFAULT_K2 = "native,k1,K,2K,E"  # docs/design.md §7

Cell = tuple[int, int | str]  # (k1, k2): k2 an int, "native", "sqrt" or "gain"

# wandb summary scalars of the cells at k1 = K/4, one per k2 label (the dashboards' bar chart
# compares them across rules): `eval/delta_k1_quarter/<label>`.
QUARTER_PREFIX = "eval/delta_k1_quarter/"


def relative_label(k1: int, k2: int | str, K: int, E: int) -> str:
  """The k2 of a cell as a label that means the same thing in every run: the first of
  LABELS that resolves to it (`k1` before `K`, ...), else the integer as text."""
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


def default_k1(K: int) -> list[int]:
  """K, K/2, K/4, ..., 1."""
  out, k = [], K
  while k >= 1:
    out.append(k)
    k //= 2
  return out if out[-1] == 1 else out + [1]


def parse_k1(spec: str, K: int, E: int) -> list[int]:
  """`--k1 8,4,2` (or empty for the default halving ladder); each in [1, E], descending."""
  if not spec:
    return default_k1(K)
  out = []
  for tok in spec.split(","):
    tok = tok.strip()
    if not tok.isdigit() or not 1 <= int(tok) <= E:
      raise UserError(f"--k1 value {tok!r} is not allowed; use integers in [1, E={E}]")
    out.append(int(tok))
  return sorted(set(out), reverse=True)


def parse_k2(spec: str, K: int, E: int, k1s: list[int]) -> list[str | int]:
  """`--k2 native,k1,K,2K,4K,E,16,sqrt,gain`: labels resolved per k1 by `cells`."""
  out: list[str | int] = []
  for tok in (t.strip() for t in (spec or DEFAULT_K2).split(",")):
    if tok in LABELS:
      out.append(tok)
    elif tok.isdigit() and min(k1s) <= int(tok) <= E:
      out.append(int(tok))
    else:
      raise UserError(
        f"--k2 value {tok!r} is not allowed; use {', '.join(LABELS)} or an "
        f"integer in [min k1={min(k1s)}, E={E}] (k2 >= k1)"
      )
  return out


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


def check_eval(rc) -> None:
  """A RunConfig's eval.k1/eval.k2 parse now, not after training (`python -m moejax.train`
  checks them with the rest of the config, before anything is built)."""
  ev, moe = rc.eval, rc.model.moe
  if not (ev.k1 or ev.k2) or moe is None:
    return
  K, E = moe.top_k, moe.n_experts
  try:
    parse_k2(ev.k2, K, E, parse_k1(ev.k1, K, E))
  except UserError as e:
    raise UserError(f"eval.k1={ev.k1!r}, eval.k2={ev.k2!r}: {e}") from None
