"""The k1:k2 grid (DESIGN.md §7): which cells to run, and one row per cell.

k1 is the number of experts activated at inference; k2 the denominator override
(p_i = s_i / Σ_{top-k2} s_j), or "native" for the trained rule's own normalization.
"""

from __future__ import annotations

import jax
import numpy as np

from moejax import stats, step as step_lib
from moejax.errors import UserError

Cell = tuple[int, int | str]  # (k1, k2) with k2 an int or "native"


def default_k1(K: int) -> list[int]:
  """K, K/2, K/4, ..., 1."""
  out, k = [], K
  while k >= 1:
    out.append(k)
    k //= 2
  return out if out[-1] == 1 else out + [1]


def parse_k1(spec: str, K: int, E: int) -> list[int]:
  """`--k1 8,4,2` (or empty for the default halving ladder); each in [1, E]."""
  if not spec:
    return default_k1(K)
  out = []
  for tok in spec.split(","):
    tok = tok.strip()
    if not tok.isdigit():
      raise UserError(f"--k1 value {tok!r} is not allowed; use integers in [1, E={E}]")
    if not 1 <= int(tok) <= E:
      raise UserError(f"--k1 value {tok} is not allowed; use integers in [1, E={E}]")
    out.append(int(tok))
  return sorted(set(out), reverse=True)


def parse_k2(spec: str, K: int, E: int, k1s: list[int]) -> list[str | int]:
  """`--k2 native,k1,K,2K,E,16`: labels resolved per k1 by `cells` (default all five)."""
  tokens = [t.strip() for t in (spec or "native,k1,K,2K,E").split(",")]
  out: list[str | int] = []
  for tok in tokens:
    if tok in ("native", "k1", "K", "2K", "E"):
      out.append(tok)
    elif tok.isdigit() and min(k1s) <= int(tok) <= E:
      out.append(int(tok))
    else:
      raise UserError(
        f"--k2 value {tok!r} is not allowed; use native, k1, K, 2K, E or an "
        f"integer in [min k1={min(k1s)}, E={E}] (k2 >= k1)"
      )
  return out


def cells(k1s: list[int], k2_labels: list[str | int], K: int, E: int) -> list[Cell]:
  """Resolved, deduplicated cells; numeric k2 kept only when k1 <= k2 <= E."""
  named = {"k1": lambda k1: k1, "K": lambda k1: K, "2K": lambda k1: 2 * K, "E": lambda k1: E}
  out: list[Cell] = []
  for k1 in k1s:
    for label in k2_labels:
      k2 = label if label == "native" or isinstance(label, int) else named[label](k1)
      if k2 != "native" and not k1 <= k2 <= E:
        continue
      if (k1, k2) not in out:
        out.append((k1, k2))
  if (K, "native") not in out:
    out.insert(0, (K, "native"))  # the reference every delta is measured against
  return out


def evaluate_cell(graphdef, state: dict, batches: list[np.ndarray], k1: int, k2: int | str) -> dict:
  """Per-sequence losses/accuracies and per-layer routed mass and routed-output ms."""
  eval_step = jax.jit(step_lib.make_eval_step(graphdef, k=k1, k2=None if k2 == "native" else k2))
  return step_lib.evaluate_batches(eval_step, state, batches)


def row(cell: Cell, res: dict, ref: dict, *, resamples: int, seed: int) -> dict:
  """One DESIGN.md §7 row: loss, accuracy, paired delta stats, routed mass and gain."""
  k1, k2 = cell
  summary = stats.summarize_cell(res["loss_N"], ref["loss_N"], n_resamples=resamples, seed=seed)
  gain = {
    l: float(np.sqrt(res["routed_ms"][l] / ref["routed_ms"][l]))
    if ref["routed_ms"][l] > 0
    else float("nan")
    for l in res["routed_ms"]
  }
  mass = res["routed_mass"]
  return {
    "k1": k1,
    "k2": k2,
    "loss": float(res["loss_N"].mean()),
    "accuracy": float(res["accuracy_N"].mean()),
    "delta": float(summary["delta"]),
    "delta_ci95": [float(v) for v in summary["delta_ci95"]],
    "p_value": float(summary["p_value"]),
    "routed_mass": float(np.mean(list(mass.values()))) if mass else 0.0,
    "gain": float(np.mean(list(gain.values()))) if gain else float("nan"),
    "routed_mass_per_layer": {f"layer{l}": float(v) for l, v in mass.items()},
    "gain_per_layer": {f"layer{l}": v for l, v in gain.items()},
    "n_sequences": int(res["loss_N"].shape[0]),
  }
