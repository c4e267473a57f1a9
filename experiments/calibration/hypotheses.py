"""H1–H5 as plain statements, each verdict read mechanically off a seed-level 95% CI
(`results.seed_interval`); each contrast also prints its one-new-seed prediction interval."""

from __future__ import annotations

import results as res

RENORM_PANEL, PLAIN_PANEL = "A qwen3_moe", "A olmoe"


def verdict(
  contrast,
  below: str,
  above: str,
  undecided: str = "no detectable difference (CI includes 0)",
  missing: str = "not measured",
) -> str:
  """`below` when the CI (`contrast.lo`, `.hi`) is under 0, `above` when over 0, else
  `undecided`; `missing` without a contrast."""
  if contrast is None:
    return missing
  if contrast.hi < 0:
    return below
  if contrast.lo > 0:
    return above
  return undecided


def _est(runs, cell, **kw) -> str:
  e = res.estimate(runs, cell, **kw)
  return "—" if e is None else e.fmt()


def renorm_lines(runs: list, best: dict) -> list[str]:
  """Per k1 < K: Δ(k2=k1), Δ(k2=K) and their difference, for a renormalized-trained panel."""
  K, out = runs[0].top_k, []
  for k1 in sorted({a for (a, _) in runs[0].final_grid if a < K}, reverse=True):
    c = res.estimate(runs, (k1, K), against=(k1, k1))
    b = best.get(k1)
    e_k1, e_K = res.estimate(runs, (k1, k1)), res.estimate(runs, (k1, K))
    kept = ""
    if e_k1 and e_K and e_k1.mean:
      kept = f" (k2 = K keeps {e_K.mean / e_k1.mean:.0%} of the k2 = k1 loss)"
    out.append(
      f"- k1 = {k1}: Δ(k2=k1) {_est(runs, (k1, k1))}, Δ(k2=K) {_est(runs, (k1, K))}{kept}; "
      f"difference {c.full() if c else '—'}: "
      f"{verdict(c, 'k2 = K loses less', 'k2 = K loses more')}. Best k2 here: {b[1] if b else '—'}."
    )
  return out


def plain_lines(runs: list) -> list[str]:
  """Per k1: Δ(native), Δ(k2=k1) and their difference, for a panel trained unnormalized."""
  out = []
  for k1 in sorted({a for (a, _) in runs[0].final_grid}, reverse=True):
    c = res.estimate(runs, (k1, k1), against=(k1, "native"))
    out.append(
      f"- k1 = {k1}: Δ(native) {_est(runs, (k1, 'native'))}, Δ(renormalized, k2=k1) "
      f"{_est(runs, (k1, k1))}; renormalized − native {c.full() if c else '—'}: "
      f"{verdict(c, 'renormalizing helps', 'renormalizing hurts')}."
    )
  return out


def h1(panels: dict, best: dict) -> list[str]:
  runs = panels.get(RENORM_PANEL)
  if not runs:
    return ["**H1** (renormalized models lose much less at k1 < K with k2 ≥ K): not run yet."]
  head = f"**H1** (renormalized-trained `qwen3_moe`, {len(runs)} seed(s); k2 = K vs k2 = k1):"
  return [head] + renorm_lines(runs, best[RENORM_PANEL])


def h2(panels: dict) -> list[str]:
  runs = panels.get(PLAIN_PANEL)
  if not runs:
    return ["**H2** (unnormalized models are best at native, hurt by renormalizing): not run yet."]
  head = (
    f"**H2** (`olmoe`, trained without renormalization, {len(runs)} seed(s); k2 = k1 vs native):"
  )
  return [head] + plain_lines(runs)


def factor_d(panels: dict, best: dict, variants: dict[str, str]) -> list[str]:
  """H1 and H2 again under each factor-D variant (`variants`: name → what it changes)."""
  out = ["**Factor D** (scale sensitivity: H1 and H2 at a second shape and init scale):"]
  for variant, what in variants.items():
    for rule, lines in (("qwen3_moe", renorm_lines), ("olmoe", plain_lines)):
      title = f"D {variant} {rule}"
      runs = panels.get(title)
      if not runs:
        out.append(f"- {variant} ({what}), {rule}: not run yet.")
        continue
      args = (runs, best[title]) if rule == "qwen3_moe" else (runs,)
      out.append(f"- {variant} ({what}), {rule}, {len(runs)} seed(s), K = {runs[0].top_k}:")
      out += ["  " + line for line in lines(*args)]
  return out


def h3(panels: dict, k1: int) -> list[str]:
  out = [
    (
      f"**H3** (other conventions, factor B, one seed each; Δ at k1 = {k1}, and whether the "
      "k1:k2 trick with k2 = K beats the convention's own rule there):"
    )
  ]
  b_panels = {t: r for t, r in panels.items() if t.startswith("B ")}
  if not b_panels:
    return out + ["- not run yet."]
  for title, runs in b_panels.items():
    K = runs[0].top_k
    cells = [("native", (k1, "native")), ("k2=k1", (k1, k1)), ("k2=K", (k1, K))]
    cells += [("sqrt", (k1, "sqrt")), ("gain", (k1, "gain"))]
    parts = [f"{name} {_est(runs, c)}" for name, c in cells if c in runs[0].final_grid]
    trick = res.estimate(runs, (k1, K), against=(k1, "native"))
    said = verdict(trick, "the top-K denominator helps", "the top-K denominator hurts")
    out.append(
      f"- {title[2:]}: " + "; ".join(parts) + f". k2=K − native {trick.full() if trick else '—'}: "
      f"{said}."
    )
  return out


def h4(panels: dict, k1: int) -> list[str]:
  out = [f"**H4** (does it grow with training? factor C, Δ at k1 = {k1} per checkpoint):"]
  for title, against_name in ((RENORM_PANEL, "k2=k1"), (PLAIN_PANEL, "native")):
    runs = panels.get(title)
    if not runs:
      out.append(f"- {title}: not run yet.")
      continue
    K = runs[0].top_k
    cell, against = ((k1, K), (k1, k1)) if title == RENORM_PANEL else ((k1, k1), (k1, "native"))
    name = "k2=K" if title == RENORM_PANEL else "k2=k1"
    steps = sorted(set.intersection(*(set(r.grids) for r in runs)))
    parts = []
    for s in steps:
      c = res.estimate(runs, cell, against=against, step=s)
      parts.append(f"step {s}: {c.full() if c else '—'}")
    out.append(f"- {title[2:]}, Δ({name}) − Δ({against_name}): " + "; ".join(parts) + ".")
  return out


def h5(panels: dict, best: dict, k1: int) -> list[str]:
  out = [f"**H5** (does the gain-matched cell recover most of the loss? k1 = {k1}):"]
  for title, runs in panels.items():
    if (k1, "gain") not in runs[0].final_grid:
      continue
    native = res.estimate(runs, (k1, "native"))
    gain = res.estimate(runs, (k1, "gain"))
    b = best[title].get(k1)
    vs_best = res.estimate(runs, (k1, "gain"), against=b) if b else None
    frac = 1 - gain.mean / native.mean if native.mean else float("nan")
    out.append(
      f"- {title} (n={len(runs)}): Δ(native) {native.fmt()}, Δ(gain) {gain.fmt()} "
      f"({frac:.0%} of native's loss recovered); gain − best k2 ({b[1] if b else '—'}) "
      f"{vs_best.full() if vs_best else '—'}: "
      f"{verdict(vs_best, 'gain beats the best k2', 'the best k2 beats gain')}."
    )
  return out if len(out) > 1 else out + ["- not run yet."]


def statements(panels: dict, best: dict, k1: int, variants: dict[str, str]) -> str:
  lines = ["## Findings\n"]
  for block in (h1(panels, best), h2(panels), h3(panels, k1), h4(panels, k1)):
    lines += block + [""]
  lines += h5(panels, best, k1) + [""]
  lines += factor_d(panels, best, variants) + [""]
  return "\n".join(lines)
