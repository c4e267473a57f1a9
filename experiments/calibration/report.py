"""Writes experiments/calibration/README.md and figures/ from the committed run results.

    python experiments/calibration/report.py [--results DIR] [--out DIR] [--device DIR]
        [--retrained DIR]

Every number in the README is computed here from `runs/<run>/{config.json, metrics.jsonl,
eval/**/k_grid.jsonl}`; runs not finished yet are listed as missing, never estimated. Where
`device/plan.json` exists (the files of a `device_study.py` run), the section "At
accelerator scale" is added from `device/` (`device_report.py`); without it, no section.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import accuracy
import device_report
import elastic
import figures
import hypotheses
import results as res
import retrained
import scale
import sweep as sweep_file
import tables

PANEL_K1 = 2  # factor C follows the loss at k1 = 2 (K/4 of the main shape)
# Factor D's variants as what they override, e.g. "n_experts=32, top_k=4, d_expert=64".
VARIANT_TEXT = {
  name: ", ".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items())
  for name, overrides in sweep_file.VARIANTS
}


def group(runs: dict[str, res.RunResult], **match) -> list[res.RunResult]:
  return [r for r in runs.values() if all(r.factors.get(k) == v for k, v in match.items())]


def panels(runs: dict[str, res.RunResult]) -> dict[str, list[res.RunResult]]:
  """One panel per rule: factor A pooled over seeds, factor B per run, factor D per variant,
  factor E per recipe."""
  out = {}
  for rule in sweep_file.CORE_RULES:
    if group(runs, factor="A", rule=rule):
      out[f"A {rule}"] = group(runs, factor="A", rule=rule)
  for r in group(runs, factor="B"):
    out[f"B {r.factors['rule']}"] = [r]
  for variant, _ in sweep_file.VARIANTS:
    for rule in sweep_file.CORE_RULES:
      if group(runs, factor="D", variant=variant, rule=rule):
        out[f"D {variant} {rule}"] = group(runs, factor="D", variant=variant, rule=rule)
  for (recipe, rule), rs in elastic_study(runs).elastic.items():
    if rs:
      out[f"E {recipe} {rule}"] = rs
  return out


def elastic_study(runs: dict[str, res.RunResult]) -> elastic.Study:
  """Factor A's fixed-K runs per rule and every factor-E (recipe, rule), finished or not."""
  fixed = {rule: group(runs, factor="A", rule=rule) for rule in sweep_file.CORE_RULES}
  expected = [(recipe, rule) for recipe, seeds, _ in sweep_file.RECIPES for rule in seeds]
  return elastic.Study(
    {rule: rs for rule, rs in fixed.items() if rs},
    {
      (recipe, rule): group(runs, factor="E", recipe=recipe, rule=rule) for recipe, rule in expected
    },
  )


def build(
  results_dir: pathlib.Path,
  out_dir: pathlib.Path,
  device_dir: pathlib.Path = device_report.DEVICE_DIR,
  retrained_dir: pathlib.Path | None = None,
) -> str:
  sweep = sweep_file.get_sweep()
  runs = res.load_all(results_dir, sweep.runs)
  fig_dir = out_dir / "figures"
  fig_dir.mkdir(parents=True, exist_ok=True)
  pan = panels(runs)
  best = {title: tables.best_k2(rs) for title, rs in pan.items()}
  study = elastic_study(runs)
  parts = [
    tables.header(sweep, runs),
    tables.setup(runs),
    tables.native_losses(runs),
    hypotheses.statements(pan, best, PANEL_K1, VARIANT_TEXT),
    elastic.statements(study),
    scale.statements(runs),
    accuracy.statements(runs),
  ]
  device = device_report.section(device_dir, results_dir)  # "" until a device study has run
  if device:
    parts.append(device)
  core_runs = {rule: group(runs, factor="A", rule=rule) for rule in sweep_file.CORE_RULES}
  if retrained_dir is not None and retrained_dir.is_dir():
    parts.append(retrained.statements(core_runs, retrained_dir))
  if pan:
    figures.delta_vs_k1(pan, best, fig_dir / "delta_vs_k1.png")
    figures.delta_vs_gain(list(runs.values()), fig_dir / "delta_vs_gain.png")
    parts.append(
      "## Figures\n\n"
      "![Δ vs k1](figures/delta_vs_k1.png)\n\n"
      "Δ against k1, one line per k2 choice (seed-level mean and 95% CI where a panel "
      "pools seeds; `best k2` is chosen on the same held-out data, so it is optimistic).\n\n"
      "![Δ vs gain](figures/delta_vs_gain.png)\n\n"
      "Every cell of every final grid: Δ against the routed gain relative to native K.\n"
    )
  core = {rule: group(runs, factor="A", rule=rule) for rule in sweep_file.CORE_RULES}
  core = {k: v for k, v in core.items() if v}
  if core:
    figures.delta_vs_step(core, PANEL_K1, fig_dir / "delta_vs_step.png")
    parts.append(
      f"![Δ vs step](figures/delta_vs_step.png)\n\nFactor C: Δ at k1 = {PANEL_K1} at each "
      "gridded checkpoint, k2 = k1 and k2 = K.\n"
    )
  if study.fixed:
    curves = {rule: elastic.curves(study, rule) for rule in study.fixed}
    figures.loss_vs_active(curves, fig_dir / "loss_vs_active.png")
    parts.append(
      "![loss vs active experts](figures/loss_vs_active.png)\n\nHeld-out loss (absolute) "
      "against active experts k1, one line per training recipe (each elastic model at its "
      "native cell; `best fix` is chosen per k1 on the same held-out data, so it is "
      "optimistic); the mean over seeds, bars the range of the seed means (H7 and H8 give "
      "the CIs of the differences, paired by seed and sequence).\n"
    )
  trend = scale.figure_panels(runs)
  if trend:
    figures.against_params(trend, fig_dir / "scale.png")
    parts.append(
      "![H9 against parameters](figures/scale.png)\n\nH9 (factor F): at 600 steps, each "
      "quantity against non-embedding parameters (d_model 64, 128, 256), one line per k1; "
      "seed-level mean and 95% CI (the kept fraction: bootstrap over sequences and seeds).\n"
    )
  parts += [tables.grid_section(title, rs) for title, rs in pan.items()]
  parts.append(tables.limits())
  text = "\n".join(parts)
  (out_dir / "README.md").write_text(text)
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--results", type=pathlib.Path, default=HERE / "runs")
  p.add_argument("--out", type=pathlib.Path, default=HERE)
  p.add_argument(
    "--device", type=pathlib.Path, default=device_report.DEVICE_DIR, help="device_study.py's files"
  )
  p.add_argument(
    "--retrained", type=pathlib.Path, default=HERE / "runs_tasks",
    help="factor A retrained at 10 seeds (sweep_tasks.py, tasks_grid.py)",
  )  # fmt: skip
  a = p.parse_args(argv)
  build(a.results, a.out, a.device, a.retrained)
  print(f"wrote {a.out / 'README.md'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
