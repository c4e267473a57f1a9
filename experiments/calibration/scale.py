"""H9: does the calibration effect change with scale? Factor F (width and training length).

Sizes: d_model 64 and 256 (factor F) and 128 (factor A's seeds 0 and 1), 600 steps each,
the core pair at seeds 0 and 1. Length: d_model 128, seed 0, 600 steps (factor A) against
2,400 (factor F's `f-long`, gridded at 25/50/75/100% of its own schedule).

Per size and rule, at k1 in SCALE_K1:
- `qwen3_moe` (renormalized): the k2 = K saving, Δ(k2=k1) − Δ(k2=K) (> 0: k2 = K loses
  less), and the fraction of the k2 = k1 loss that k2 = K keeps, Δ(k2=K) / Δ(k2=k1) (the blog
  behind seed 003 reports about 10% on Qwen3.6-35B-A3B: −1.2 against −12 MMLU points);
- `olmoe` (unnormalized): H2's renormalization cost, Δ(k2=k1) − Δ(native).

The trend is the least-squares slope of each size's value against log10 of its non-embedding
parameters, with a percentile bootstrap CI: each resample draws the held-out sequences with
replacement (one draw shared by every run, since all are gridded on the same sequences) and,
within each size, the seeds with replacement. With two seeds per size that seed draw is
coarse, so the CI can be narrow where the seeds happen to agree. Beside it: the seed-level
slope, an OLS fit through every per-seed value with a Student-t CI on n − 2 degrees of
freedom. A direction is stated only where both CIs exclude 0 on the same side.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import hypotheses
import numpy as np
import results as res
from scipy import stats as sps

NATIVE = res.NATIVE
SCALE_K1 = (4, 2, 1)
RENORMALIZED, PLAIN = "qwen3_moe", "olmoe"
BLOG_KEPT = 0.10  # seed 003: k2 = 16 keeps about 10% of the k2 = k1 loss at k1 = 3
SEEDS = (0, 1)
RESAMPLES = 2000
CONFIDENCE = 0.95


class Size(NamedTuple):
  """One point of the trend: a width (or length) and its runs, one per seed."""

  label: str
  params: int  # non-embedding parameters
  tokens: int  # training tokens
  runs: list


class Trend(NamedTuple):
  slope: float  # per decade of non-embedding parameters
  lo: float
  hi: float


def non_embedding_params(run: res.RunResult) -> int:
  """`resolved.n_params` less the token embedding (and the output head when untied)."""
  m, r = run.config["model"], run.config["resolved"]
  tables = 1 if m["tie_embeddings"] else 2
  return int(r["n_params"]) - tables * int(r["vocab_size"]) * int(m["d_model"])


def train_tokens(run: res.RunResult) -> int:
  d = run.config["data"]
  return int(run.config["train"]["steps"]) * d["batch_size"] * d["seq_len"]


def width_runs(runs: dict, rule: str) -> dict[str, list]:
  """d_model 64, 128, 256 at 600 steps -> their finished runs at seeds 0 and 1 (sizes with
  none left out), smallest first."""
  out = {}
  for d in (64, 128, 256):
    prefix = f"a-{rule}" if d == 128 else f"f-d{d}-{rule}"
    found = [runs[f"{prefix}-s{s}"] for s in SEEDS if f"{prefix}-s{s}" in runs]
    if found:
      out[f"d{d}"] = found
  return out


def widths(runs: dict, rule: str) -> list[Size]:
  """The trend's points; [] until two sizes have finished runs."""
  groups = width_runs(runs, rule)
  if len(groups) < 2:
    return []
  return [
    Size(lab, non_embedding_params(rs[0]), train_tokens(rs[0]), rs) for lab, rs in groups.items()
  ]


def contrast(rule: str, k1: int, K: int) -> tuple[tuple, tuple]:
  """(cell, against) of the rule's per-sequence contrast (module docstring)."""
  if rule == RENORMALIZED:
    return (k1, k1), (k1, K)  # the k2 = K saving
  return (k1, k1), (k1, NATIVE)  # the renormalization cost


def _arrays(runs: list, cell: tuple, against: tuple, step: int | None = None) -> list:
  grids = [r.grids.get(r.final_step if step is None else step) for r in runs]
  diffs = [res.paired_diffs(g, cell, against) for g in grids if g is not None]
  return [d for d in diffs if d is not None]


def kept_arrays(runs: list, k1: int, step: int | None = None) -> tuple[list, list]:
  """Per seed: Δ(k2=K) and Δ(k2=k1) per sequence (both against native k1 = K)."""
  K = runs[0].top_k
  native = (K, NATIVE)
  return _arrays(runs, (k1, K), native, step), _arrays(runs, (k1, k1), native, step)


def ratio(num: list, den: list) -> float:
  n, d = np.mean([a.mean() for a in num]), np.mean([a.mean() for a in den])
  return float(n / d) if d else float("nan")


def _resample(arrays: list, seeds_idx: np.ndarray, seq_idx: np.ndarray) -> float:
  return float(np.mean([arrays[s][seq_idx].mean() for s in seeds_idx]))


def _percentiles(values: np.ndarray) -> tuple[float, float]:
  alpha = (1 - CONFIDENCE) / 2
  if not np.any(np.isfinite(values)):
    return float("nan"), float("nan")
  lo, hi = np.nanquantile(values, [alpha, 1 - alpha])
  return float(lo), float(hi)


def bootstrap_trend(x: list[float], per_size: list, stat, seed: int = 0) -> Trend | None:
  """Slope of stat(size's arrays) against log10(x) with its bootstrap CI (module docstring).
  `per_size[i]` is a tuple of array lists (one list per term, one array per seed)."""
  if len(x) < 2 or not all(terms and all(terms) for terms in per_size):
    return None
  logx = np.log10(np.asarray(x, np.float64))
  point = np.polyfit(logx, [stat(*terms) for terms in per_size], 1)[0]
  rng = np.random.default_rng(seed)
  n_seq = per_size[0][0][0].size
  slopes = np.empty(RESAMPLES)
  for b in range(RESAMPLES):
    seq = rng.integers(0, n_seq, n_seq)
    ys = []
    for terms in per_size:
      seeds = rng.integers(0, len(terms[0]), len(terms[0]))
      ys.append(stat(*[[a[seq] for a in (t[s] for s in seeds)] for t in terms]))
    slopes[b] = np.polyfit(logx, ys, 1)[0] if np.all(np.isfinite(ys)) else np.nan
  return Trend(float(point), *_percentiles(slopes))


def mean_of(arrays: list) -> float:
  return float(np.mean([a.mean() for a in arrays]))


def kept_interval(num: list, den: list, seed: int = 0) -> tuple[float, float]:
  """Bootstrap CI of the kept fraction at one size (sequences, then seeds, resampled). A draw
  whose Δ(k2=k1) is exactly 0 (possible for accuracy, whose per-item Δ is 0 on most items)
  has no fraction and is left out (NaN)."""
  rng = np.random.default_rng(seed)
  n_seq, n_seeds = num[0].size, len(num)
  out = np.empty(RESAMPLES)
  for b in range(RESAMPLES):
    seq, seeds = rng.integers(0, n_seq, n_seq), rng.integers(0, n_seeds, n_seeds)
    den_b = _resample(den, seeds, seq)
    out[b] = _resample(num, seeds, seq) / den_b if den_b else float("nan")
  return _percentiles(out)


def direction(t: Trend | None, toward_blog: str, away: str) -> str:
  return hypotheses.verdict(
    t,
    toward_blog,
    away,
    undecided="the CI includes 0: these sizes cannot tell",
    missing="not measured (fewer than two sizes)",
  )


def _fmt_params(n: int) -> str:
  return f"{n / 1e6:.2f}M"


def saving_table(sizes: list[Size], rule: str) -> list[str]:
  renorm = rule == RENORMALIZED
  what = (
    "k2 = K saving Δ(k2=k1) − Δ(k2=K)" if renorm else "renormalization cost Δ(k2=k1) − Δ(native)"
  )
  head = f"| size | non-emb. params | tokens | loss at native K | k1 | {what} |"
  out = [head + (" kept by k2 = K |" if renorm else "")]
  out.append("|---|---|---|---|---|---|" + ("---|" if renorm else ""))
  for size in sizes:
    for k1 in SCALE_K1:
      cell, against = contrast(rule, k1, size.runs[0].top_k)
      e = res.estimate(size.runs, cell, against=against)
      row = (
        f"| {size.label} (n={len(size.runs)}) | {_fmt_params(size.params)} | "
        f"{size.tokens / 1e6:.2f}M | {native_loss(size):.4f} | {k1} | {e.full() if e else '—'} |"
      )
      out.append(row + (f" {kept_text(size.runs, k1)} |" if renorm else ""))
  return out


def native_loss(size: Size) -> float:
  """Held-out loss at native k1 = K, the mean over the size's seeds."""
  return float(np.mean([r.eval_loss for r in size.runs]))


def kept_text(runs: list, k1: int, step: int | None = None) -> str:
  """Δ(k2=K) / Δ(k2=k1) with its bootstrap CI."""
  num, den = kept_arrays(runs, k1, step)
  if not num or not den:
    return "—"
  lo, hi = kept_interval(num, den)
  return f"{ratio(num, den):.0%} [{lo:.0%}, {hi:.0%}]"


def seed_trend(x: list[float], per_seed: list[list[float]]) -> Trend | None:
  """OLS slope of every per-seed value against log10(x) (each size's seeds as separate
  points), with a Student-t CI on n − 2 degrees of freedom: the seed-level check on the
  bootstrap, which two seeds per size can make too narrow."""
  xs = [np.log10(xi) for xi, vals in zip(x, per_seed) for _ in vals]
  ys = [v for vals in per_seed for v in vals]
  if len(set(xs)) < 2 or len(ys) < 3:
    return None
  fit = sps.linregress(xs, ys)
  half = float(sps.t.ppf(0.5 + CONFIDENCE / 2, len(ys) - 2)) * fit.stderr
  return Trend(float(fit.slope), float(fit.slope - half), float(fit.slope + half))


def verdict(boot: Trend | None, seed: Trend | None, down: str, up: str) -> str:
  """Read off both CIs: a direction only where both exclude 0 on the same side."""
  said = {direction(t, down, up) for t in (boot, seed)}
  if len(said) == 1:
    return said.pop()
  return "the bootstrap and the seed-level CIs disagree: these sizes cannot tell"


def trend_lines(sizes: list[Size], rule: str) -> list[str]:
  x = [s.params for s in sizes]
  out = []
  for k1 in SCALE_K1:
    cell, against = contrast(rule, k1, sizes[0].runs[0].top_k)
    per = [(_arrays(s.runs, cell, against),) for s in sizes]
    t = bootstrap_trend(x, per, mean_of)
    st = seed_trend(x, [[a.mean() for a in arrays] for (arrays,) in per])
    name = "saving" if rule == RENORMALIZED else "renormalization cost"
    said = verdict(t, st, f"the {name} shrinks with size", f"the {name} grows with size")
    line = (
      f"- k1 = {k1}: {name} slope {_fmt_trend(t)} nats per decade (bootstrap; seed-level "
      f"{_fmt_trend(st)}): {said}."
    )
    if rule == RENORMALIZED:
      terms = [kept_arrays(s.runs, k1) for s in sizes]
      kt = bootstrap_trend(x, terms, ratio)
      kst = seed_trend(x, [[ratio([n], [d]) for n, d in zip(*tm)] for tm in terms])
      toward = verdict(
        kt,
        kst,
        f"toward the blog's {BLOG_KEPT:.0%} (k2 = K keeps less with size)",
        f"away from the blog's {BLOG_KEPT:.0%} (k2 = K keeps more with size)",
      )
      line += (
        f" Kept-fraction slope {_fmt_trend(kt, pct=True)} per decade (seed-level "
        f"{_fmt_trend(kst, pct=True)}): {toward}."
      )
    out.append(line)
  return out


def _fmt_trend(t: Trend | None, pct: bool = False) -> str:
  if t is None:
    return "—"
  if pct:
    return f"{t.slope * 100:+.0f} pp [{t.lo * 100:+.0f}, {t.hi * 100:+.0f}]"
  return f"{t.slope:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}]"


def length_lines(runs: dict, rule: str) -> list[str]:
  """600 steps (factor A, seed 0) against the 2,400-step run, at each of its checkpoints."""
  short, long = runs.get(f"a-{rule}-s0"), runs.get(f"f-long-{rule}-s0")
  if not short or not long:
    return [f"- {rule}: not run yet."]
  out = []
  for k1 in SCALE_K1:
    cell, against = contrast(rule, k1, long.top_k)
    a_long, a_short = _arrays([long], cell, against), _arrays([short], cell, against)
    if not a_long or not a_short:
      continue
    parts = [f"600 steps {_est([short], cell, against)}"]
    for step in sorted(long.grids):
      parts.append(f"{step}/{long.final_step} of the long run {_est([long], cell, against, step)}")
    d = res.seed_interval([a_long[0] - a_short[0]])
    line = f"- {rule}, k1 = {k1}: " + "; ".join(parts) + f"; 2,400 − 600 steps {d.full()}"
    seeds = [r for name, r in sorted(runs.items()) if name.startswith(f"a-{rule}-s")]
    line += f" (factor A's {len(seeds)} seeds at 600 steps span {seed_range(seeds, cell, against)})"
    if rule == RENORMALIZED:
      kept = [ratio(*kept_arrays([r], k1)) for r in seeds]
      line += (
        f"; k2 = K keeps {kept_text([short], k1)} of the k2 = k1 loss at 600 steps, "
        f"{kept_text([long], k1)} at 2,400 (factor A's seeds: {min(kept):.0%} to {max(kept):.0%})"
      )
    out.append(line + ".")
  return out


def seed_range(runs: list, cell: tuple, against: tuple) -> str:
  """The lowest and highest per-seed mean of a contrast: what one seed alone can vary by."""
  means = [a.mean() for a in _arrays(runs, cell, against)]
  return f"{min(means):+.3f} to {max(means):+.3f}"


def _est(runs: list, cell: tuple, against: tuple, step: int | None = None) -> str:
  e = res.estimate(runs, cell, against=against, step=step)
  return "—" if e is None else e.fmt()


def statements(runs: dict) -> str:
  out = [
    (
      "**H9** (does the k2 = K saving, the fraction of the k2 = k1 loss it keeps, and H2's "
      "renormalization cost change with non-embedding parameters and with tokens? factor F; "
      "slopes against log10 parameters with bootstrap CIs over sequences and seeds):"
    ),
    "",
  ]
  for rule in (RENORMALIZED, PLAIN):
    sizes = widths(runs, rule)
    out.append(f"*{rule}, by width (600 steps, 1.23M tokens):*\n")
    if not sizes:
      done = ", ".join(width_runs(runs, rule)) or "none"
      out += [f"- fewer than two sizes finished ({done}).", ""]
      continue
    out += saving_table(sizes, rule) + [""] + trend_lines(sizes, rule) + [""]
  out.append(
    "*By training length (d_model 128, seed 0; one seed, so its CIs are over sequences only: "
    "a change smaller than the spread of factor A's seeds is not separable from the seed):*\n"
  )
  for rule in (RENORMALIZED, PLAIN):
    out += length_lines(runs, rule)
  return "\n".join(out) + "\n"


def curve(sizes: list[Size], rule: str, k1: int) -> list[tuple]:
  """(params, estimate) per size for scale.png; estimates missing at a size are left out."""
  pts = []
  for s in sizes:
    cell, against = contrast(rule, k1, s.runs[0].top_k)
    e = res.estimate(s.runs, cell, against=against)
    if e is not None and math.isfinite(e.mean):
      pts.append((s.params, e))
  return pts


def figure_panels(runs: dict) -> dict[str, dict[str, list[tuple]]]:
  """scale.png's panels: (params, mean, lo, hi) per size, one line per k1."""
  out = {}
  renorm, plain = widths(runs, RENORMALIZED), widths(runs, PLAIN)
  if len(renorm) >= 2:
    out[f"{RENORMALIZED}: k2 = K saving (nats)"] = {
      f"k1={k1}": [(x, e.mean, e.lo, e.hi) for x, e in curve(renorm, RENORMALIZED, k1)]
      for k1 in SCALE_K1
    }
    kept = {}
    for k1 in SCALE_K1:
      pts = []
      for s in renorm:
        num, den = kept_arrays(s.runs, k1)
        if num and den:
          pts.append((s.params, ratio(num, den), *kept_interval(num, den)))
      kept[f"k1={k1}"] = pts
    out[f"{RENORMALIZED}: fraction kept by k2 = K"] = kept
  if len(plain) >= 2:
    out[f"{PLAIN}: renormalization cost (nats)"] = {
      f"k1={k1}": [(x, e.mean, e.lo, e.hi) for x, e in curve(plain, PLAIN, k1)] for k1 in SCALE_K1
    }
  return out
