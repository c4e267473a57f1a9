"""k1:k2 grid reports: a markdown table and a Δ-loss heatmap (`k_grid.md`, `k_grid.png`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moejax.errors import UserError

NATIVE = "native"
SIG_P = 0.05


def _k2_key(k2) -> tuple[int, int]:
  """Sort key: "native" first, then ints ascending."""
  return (0, 0) if k2 == NATIVE else (1, int(k2))


def _check(rows: list[dict]) -> None:
  seen = set()
  for row in rows:
    for key in ("k1", "k2", "delta"):
      if key not in row:
        raise UserError(f"rows: every row needs keys k1, k2, delta; missing {key!r} in {row}")
    k2 = row["k2"]
    if not (k2 == NATIVE or (isinstance(k2, (int, np.integer)) and not isinstance(k2, bool))):
      raise UserError(f"k2: got {k2!r}, allowed an int or {NATIVE!r}")
    if (row["k1"], k2) in seen:
      raise UserError(f"rows: duplicate cell k1={row['k1']}, k2={k2}")
    seen.add((row["k1"], k2))


def is_significant(row: dict) -> bool:
  """p < 0.05 and the 95% CI excludes 0."""
  p, ci = row.get("p_value"), row.get("delta_ci95")
  if p is None or ci is None or not math.isfinite(p):
    return False
  return p < SIG_P and (ci[0] > 0 or ci[1] < 0)


def pivot(rows: list[dict]) -> tuple[list[int], list, np.ndarray]:
  """(k1 values ascending, k2 labels "native" then ints ascending, delta_K1xK2 with NaN holes)."""
  _check(rows)
  k1s = sorted({int(r["k1"]) for r in rows})
  k2s = sorted({r["k2"] if r["k2"] == NATIVE else int(r["k2"]) for r in rows}, key=_k2_key)
  delta_K1xK2 = np.full((len(k1s), len(k2s)), np.nan)
  for r in rows:
    k2 = r["k2"] if r["k2"] == NATIVE else int(r["k2"])
    delta_K1xK2[k1s.index(int(r["k1"])), k2s.index(k2)] = float(r["delta"])
  return k1s, k2s, delta_K1xK2


def _fmt(x, spec: str) -> str:
  if x is None or not math.isfinite(float(x)):
    return "—"
  return format(float(x), spec)


def write_markdown(rows: list[dict], path, *, title: str) -> Path:
  """One row per cell plus a k1 × k2 pivot of Δ loss; `*` marks significant cells."""
  k1s, k2s, _ = pivot(rows)
  cells = {(int(r["k1"]), r["k2"] if r["k2"] == NATIVE else int(r["k2"])): r for r in rows}
  lines = [
    f"# {title}",
    "",
    "Δ = loss − loss at k1=K native (nats/token); `*`: p < 0.05 and 95% CI excludes 0.",
    "",
    "| k1 | k2 | loss | accuracy | Δ loss | 95% CI | p | routed mass | gain |",
    "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
  ]
  for k1 in k1s:
    for k2 in k2s:
      r = cells.get((k1, k2))
      if r is None:
        continue
      star = "*" if is_significant(r) else ""
      ci = r.get("delta_ci95")
      ci_s = f"[{_fmt(ci[0], '+.4f')}, {_fmt(ci[1], '+.4f')}]" if ci else "—"
      lines.append(
        f"| {k1} | {k2} | {_fmt(r.get('loss'), '.4f')} | {_fmt(r.get('accuracy'), '.4f')} "
        f"| {_fmt(r['delta'], '+.4f')}{star} | {ci_s} | {_fmt(r.get('p_value'), '.3g')} "
        f"| {_fmt(r.get('routed_mass'), '.3f')} | {_fmt(r.get('gain'), '.3f')} |"
      )
  lines += [
    "",
    "Δ loss, k1 (rows) × k2 (columns):",
    "",
    "| k1 \\ k2 | " + " | ".join(str(k) for k in k2s) + " |",
    "|---:|" + "---:|" * len(k2s),
  ]
  for k1 in k1s:
    vals = []
    for k2 in k2s:
      r = cells.get((k1, k2))
      vals.append(
        "" if r is None else _fmt(r["delta"], "+.4f") + ("*" if is_significant(r) else "")
      )
    lines.append(f"| {k1} | " + " | ".join(vals) + " |")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines) + "\n")
  return path


def write_heatmap(rows: list[dict], path, *, title: str, dpi: int = 100) -> Path:
  """Heatmap of Δ loss (k1 rows × k2 columns), annotated, `*` and a bold border on significant cells."""
  import matplotlib
  from matplotlib.figure import Figure  # no pyplot: Agg canvas, no global backend state
  from matplotlib.patches import Rectangle

  k1s, k2s, delta_K1xK2 = pivot(rows)
  sig = {
    (int(r["k1"]), r["k2"] if r["k2"] == NATIVE else int(r["k2"]))
    for r in rows
    if is_significant(r)
  }
  fig = Figure(figsize=(2.5 + 1.1 * len(k2s), 1.6 + 0.8 * len(k1s)), layout="constrained")
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
  ax.set_xticks(range(len(k2s)), [str(k) for k in k2s])
  ax.set_yticks(range(len(k1s)), [str(k) for k in k1s])
  ax.set_xlabel("k2 (normalization denominator)")
  ax.set_ylabel("k1 (active experts)")
  ax.set_title(title)
  fig.colorbar(im, ax=ax, label="Δ loss (nats/token)")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=dpi)
  return path
