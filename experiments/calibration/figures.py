"""The calibration study's figures, drawn from seed-level estimates (results.py)."""

from __future__ import annotations

import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import results as res

LINES = ("native", "k2=k1", "k2=K", "best k2", "gain")


def save(fig, path: pathlib.Path) -> None:
  """Every figure of the report: tight layout, 110 dpi, then closed."""
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def errorbars(ax, xs, means, los, his, label: str) -> None:
  """One line with asymmetric bars from `los` to `his` (every figure's point style)."""
  yerr = [[m - lo for m, lo in zip(means, los)], [hi - m for m, hi in zip(means, his)]]
  ax.errorbar(xs, means, yerr=yerr, marker="o", capsize=2, label=label)


def line_cells(run: res.RunResult, k1: int, best: dict) -> dict:
  """The cell behind each plotted line at this k1 (None where the grid lacks it)."""
  grid, K = run.final_grid, run.top_k
  cells = {"native": (k1, "native"), "k2=k1": (k1, k1), "k2=K": (k1, K), "gain": (k1, "gain")}
  cells["best k2"] = best.get(k1)
  return {name: (c if c in grid else None) for name, c in cells.items()}


def delta_vs_k1(panels: dict[str, list[res.RunResult]], best: dict, path: pathlib.Path) -> None:
  """Δ against k1, one line per k2 choice, one panel per rule (seed-level where seeds exist)."""
  n = len(panels)
  cols = min(n, 4)
  rows = math.ceil(n / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
  for ax, (title, runs) in zip(axes.flat, panels.items()):
    k1s = sorted({k1 for (k1, _) in runs[0].final_grid})
    for name in LINES:
      xs, ys, errs = [], [], [[], []]
      for k1 in k1s:
        cell = line_cells(runs[0], k1, best[title])[name]
        est = None if cell is None else res.estimate(runs, cell)
        if est is not None:
          xs.append(k1)
          ys.append(est.mean)
          errs[0].append(est.mean - est.lo)
          errs[1].append(est.hi - est.mean)
      if xs:
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=2, label=name)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{title} (n={len(runs)})", fontsize=9)
    ax.set_xlabel("k1")
    ax.set_ylabel("Δ loss (nats/token)")
    ax.axhline(0, color="k", lw=0.5)
  for ax in list(axes.flat)[n:]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  save(fig, path)


def delta_vs_gain(runs: list[res.RunResult], path: pathlib.Path) -> None:
  """Every cell of every final grid: Δ against the routed gain vs native K."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for factor in sorted({r.factors["factor"] for r in runs}):
    xs, ys = [], []
    for run in (r for r in runs if r.factors["factor"] == factor):
      for row in run.final_grid.values():
        if math.isfinite(row.get("gain", float("nan"))):
          xs.append(row["gain"])
          ys.append(row["delta"])
    ax.scatter(xs, ys, s=10, alpha=0.6, label=f"factor {factor}")
  ax.axvline(1.0, color="k", lw=0.5)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("routed gain (RMS of routed output vs native k1=K)")
  ax.set_ylabel("Δ loss (nats/token)")
  ax.legend(fontsize=8)
  save(fig, path)


def delta_vs_step(by_rule: dict[str, list[res.RunResult]], k1: int, path: pathlib.Path) -> None:
  """Factor C: seed-level Δ(k1) at each gridded checkpoint, for k2 = k1 and k2 = K."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for rule, runs in by_rule.items():
    K = runs[0].top_k
    steps = sorted(set.intersection(*(set(r.grids) for r in runs)))
    for label, cell in (("k2=k1", (k1, k1)), ("k2=K", (k1, K))):
      pts = [(s, res.estimate(runs, cell, step=s)) for s in steps]
      pts = [(s, e) for s, e in pts if e is not None]
      if pts:
        ax.errorbar(
          [s for s, _ in pts],
          [e.mean for _, e in pts],
          yerr=[[e.mean - e.lo for _, e in pts], [e.hi - e.mean for _, e in pts]],
          marker="o",
          capsize=2,
          label=f"{rule} {label}",
        )
  ax.set_xlabel("training step")
  ax.set_ylabel(f"Δ loss at k1={k1} (nats/token)")
  ax.axhline(0, color="k", lw=0.5)
  ax.legend(fontsize=8)
  save(fig, path)


def loss_vs_active(curves_by_rule: dict[str, dict[str, list]], path: pathlib.Path) -> None:
  """Held-out loss (absolute) against active experts k1, one line per training recipe, one
  panel per rule; `curves_by_rule`: rule -> recipe label -> [elastic.Point] (bars: the range
  of the seed means)."""
  n = len(curves_by_rule)
  fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.6), squeeze=False)
  for ax, (rule, curves) in zip(axes.flat, curves_by_rule.items()):
    for label, pts in curves.items():
      if pts:
        n = max(p.n_seeds for p in pts)
        errorbars(ax, *zip(*[(p.k1, p.mean, p.lo, p.hi) for p in pts]), f"{label} (n={n})")
    ax.set_xscale("log", base=2)
    ax.set_title(rule, fontsize=9)
    ax.set_xlabel("active experts k1")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.legend(fontsize=7)
  save(fig, path)


def against_params(panels: dict[str, dict[str, list[tuple]]], path: pathlib.Path) -> None:
  """H9: one panel per quantity, one line per k1; points (params, mean, lo, hi), x log."""
  n = len(panels)
  fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.6), squeeze=False)
  for ax, (title, lines) in zip(axes.flat, panels.items()):
    for label, pts in lines.items():
      if pts:
        errorbars(ax, *zip(*pts), label)
    ax.set_xscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("non-embedding parameters")
    ax.axhline(0, color="k", lw=0.5)
    ax.legend(fontsize=7)
  save(fig, path)
