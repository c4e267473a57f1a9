"""k1:k2 grid reports: a markdown table and a Δ-loss heatmap (`k_grid.md`, `k_grid.png`).

Columns are `native`, the integer k2 ascending, then the rescaling cells (`sqrt`, `gain`:
the order of `cells.RESCALINGS`, which also gives their column labels). The k2 = E column is
labelled for what it is: with softmax scores, ÷ Σ of all E = 1 (no renormalization); with
sigmoid scores, ÷ the sum of all E sigmoids, which is not the same as no renormalization.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moejax.errors import UserError
from moejax.config.grid_labels import NATIVE
from moejax.kgrid.cells import RESCALINGS

SIG_P = 0.05
_NAMED = (NATIVE, *RESCALINGS)
_NAMED_ORDER = {NATIVE: (0, 0), **{name: (2 + i, 0) for i, name in enumerate(RESCALINGS)}}
COLUMNS = (  # markdown: (header, row key, format)
  ("loss", "loss", ".4f"),
  ("accuracy", "accuracy", ".4f"),
  ("mass_k1", "mass_k1", ".3f"),
  ("mass_K", "mass_K", ".3f"),
  ("mass_k2", "mass_k2", ".3f"),
  ("coef_sum", "coef_sum", ".3f"),
  ("shared_coef", "shared_coef", ".3f"),
  ("routed_rms", "routed_rms", ".4f"),
  ("gain", "gain", ".3f"),
  ("moe_rms", "moe_rms", ".4f"),
  ("moe gain", "moe_gain", ".3f"),
  ("scale", "scale", ".3f"),
)


def _k2(value):
  """A row's k2 as a pivot key: an int or one of the named cells."""
  if value in _NAMED_ORDER:
    return value
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value)
  named = ", ".join(map(repr, _NAMED[:-1])) + f" or {_NAMED[-1]!r}"
  raise UserError(f"k2: got {value!r}, allowed an int, {named}")


def _k2_key(k2) -> tuple[int, int]:
  return _NAMED_ORDER.get(k2, (1, k2)) if isinstance(k2, str) else (1, k2)


def k2_label(k2, *, n_experts: int | None = None, score: str = "softmax") -> str:
  """Column label: the k2 = E column says what dividing by all E scores means."""
  if isinstance(k2, str) and k2 in RESCALINGS:
    return RESCALINGS[k2].column
  if k2 == n_experts:
    return f"{k2} (÷ all E sigmoids)" if score == "sigmoid" else f"{k2} (= no renorm)"
  return str(k2)


def _check(rows: list[dict]) -> None:
  seen = set()
  for row in rows:
    for key in ("k1", "k2", "delta"):
      if key not in row:
        raise UserError(f"rows: every row needs keys k1, k2, delta; missing {key!r} in {row}")
    cell = (int(row["k1"]), _k2(row["k2"]))
    if cell in seen:
      raise UserError(f"rows: duplicate cell k1={cell[0]}, k2={cell[1]}")
    seen.add(cell)


def is_significant(row: dict) -> bool:
  """p < 0.05 and the 95% CI excludes 0."""
  p, ci = row.get("p_value"), row.get("delta_ci95")
  if p is None or ci is None or not math.isfinite(p):
    return False
  return p < SIG_P and (ci[0] > 0 or ci[1] < 0)


def pivot(rows: list[dict]) -> tuple[list[int], list, np.ndarray]:
  """(k1 ascending, k2 columns: native, ints ascending, the rescaling cells; delta_K1xK2
  with NaN holes)."""
  _check(rows)
  k1s = sorted({int(r["k1"]) for r in rows})
  k2s = sorted({_k2(r["k2"]) for r in rows}, key=_k2_key)
  delta_K1xK2 = np.full((len(k1s), len(k2s)), np.nan)
  for r in rows:
    delta_K1xK2[k1s.index(int(r["k1"])), k2s.index(_k2(r["k2"]))] = float(r["delta"])
  return k1s, k2s, delta_K1xK2


def _fmt(x, spec: str) -> str:
  if x is None or not math.isfinite(float(x)):
    return "—"
  return format(float(x), spec)


def heldout_line(h: dict) -> str:
  """`Held-out data: ...`: corpus (and files), tokenizer, sequences and tokens scored."""
  corpus = f"{h['corpus']} ({h['paths']})" if h.get("paths") else h["corpus"]
  return (
    f"Held-out data: {corpus}, tokenizer {h['tokenizer']}, holdout_fraction "
    f"{h['holdout_fraction']}: {h['sequences']} sequences ({h['windows_available']} available), "
    f"{h['tokens']:,} tokens scored."
  )


def write_markdown(
  rows: list[dict],
  path,
  *,
  title: str,
  n_experts: int | None = None,
  score: str = "softmax",
  notes: list[str] = (),
  heldout: dict | None = None,
) -> Path:
  """One row per cell plus a k1 × k2 pivot of Δ loss; `*` marks significant cells;
  `heldout` (run.heldout_info) describes the evaluated data under the title."""
  k1s, k2s, _ = pivot(rows)
  cells = {(int(r["k1"]), _k2(r["k2"])): r for r in rows}
  label = {k2: k2_label(k2, n_experts=n_experts, score=score) for k2 in k2s}
  lines = [
    f"# {title}",
    "",
    *([heldout_line(heldout), ""] if heldout else []),
    "Δ = loss − loss at k1=K native (nats/token); `*`: p < 0.05 and 95% CI excludes 0.",
    "Masses are of the router scores in selection order; mass_k2 is the denominator used;",
    "gain = routed RMS / native k1=K's; `sqrt`/`gain` cells scale the routed output by c_l.",
    *[f"Note: {n}." for n in notes],
    "",
    "| k1 | k2 | Δ loss | 95% CI | p | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
    "|---:|---|---:|---|---:|" + "---:|" * len(COLUMNS),
  ]
  for k1 in k1s:
    for k2 in k2s:
      r = cells.get((k1, k2))
      if r is None:
        continue
      ci = r.get("delta_ci95")
      ci_s = f"[{_fmt(ci[0], '+.4f')}, {_fmt(ci[1], '+.4f')}]" if ci else "—"
      star = "*" if is_significant(r) else ""
      values = " | ".join(_fmt(r.get(key), spec) for _, key, spec in COLUMNS)
      lines.append(
        f"| {k1} | {label[k2]} | {_fmt(r['delta'], '+.4f')}{star} | {ci_s} "
        f"| {_fmt(r.get('p_value'), '.3g')} | {values} |"
      )
  lines += [
    "",
    "Δ loss, k1 (rows) × k2 (columns):",
    "",
    "| k1 \\ k2 | " + " | ".join(label[k] for k in k2s) + " |",
    "|---:|" + "---:|" * len(k2s),
  ]
  for k1 in k1s:
    vals = []
    for k2 in k2s:
      r = cells.get((k1, k2))
      vals.append("" if r is None else _fmt(r["delta"], "+.4f") + ("*" * is_significant(r)))
    lines.append(f"| {k1} | " + " | ".join(vals) + " |")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines) + "\n")
  return path


def write_heatmap(
  rows: list[dict],
  path,
  *,
  title: str,
  n_experts: int | None = None,
  score: str = "softmax",
  dpi: int = 100,
  label: str = "Δ loss (nats/token)",
) -> Path:
  """Heatmap of Δ (k1 rows × k2 columns; `label` names it), annotated; significant cells
  starred and boxed."""
  import matplotlib
  from matplotlib.figure import Figure  # no pyplot: Agg canvas, no global backend state
  from matplotlib.patches import Rectangle

  k1s, k2s, delta_K1xK2 = pivot(rows)
  sig = {(int(r["k1"]), _k2(r["k2"])) for r in rows if is_significant(r)}
  fig = Figure(figsize=(2.5 + 1.3 * len(k2s), 1.6 + 0.8 * len(k1s)), layout="constrained")
  ax = fig.add_subplot()
  finite = delta_K1xK2[np.isfinite(delta_K1xK2)]
  vmax = max(float(np.abs(finite).max()) if finite.size else 0.0, 1e-6)
  cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="white")
  im = ax.imshow(np.ma.masked_invalid(delta_K1xK2), cmap=cmap, vmin=-vmax, vmax=vmax, aspect="auto")
  for i, k1 in enumerate(k1s):
    for j, k2 in enumerate(k2s):
      d = delta_K1xK2[i, j]
      if not np.isfinite(d):
        continue
      star = (k1, k2) in sig
      ax.text(
        j,
        i,
        f"{d:+.3f}" + ("*" if star else ""),
        ha="center",
        va="center",
        fontsize=9,
        fontweight="bold" if star else "normal",
        color="white" if abs(d) > 0.6 * vmax else "black",
      )
      if star:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="black"))
  labels = [k2_label(k, n_experts=n_experts, score=score).replace(" (", "\n(") for k in k2s]
  ax.set_xticks(range(len(k2s)), labels)
  ax.set_yticks(range(len(k1s)), [str(k) for k in k1s])
  ax.set_xlabel("k2 (normalization denominator) or rescaling")
  ax.set_ylabel("k1 (active experts)")
  ax.set_title(title)
  fig.colorbar(im, ax=ax, label=label)
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=dpi)
  return path
