"""`python -m launch.dashboard experiments/<name>/sweep.py [--dry-run] [--entity E]`.

Builds, with wandb-workspaces, a saved workspace and a report for the sweep's wandb group:
held-out loss against step grouped by merge rule; routed mass, load max/mean, router
entropy and drop fraction (mean and per layer); each run's k1:k2 table and heatmap
(`eval/k_grid`, `eval/k_grid_heatmap`); and the grid rows of every run side by side, for
Δ at k1 = K/4 per rule and k2. `--dry-run` writes the specification as JSON, no network.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pydantic
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
from wandb_workspaces import expr

from launch import spec
from moejax.errors import UserError
from moejax.config.grid_labels import LABELS
from moejax.kgrid.cells import QUARTER_PREFIX

RULE_KEY = "model.moe.rule"
LOSS = "eval_loss"
GRID_TABLE = "eval/k_grid"
GRID_HEATMAP = "eval/k_grid_heatmap"
DIAGNOSTICS = {  # panel label: metric name under moe/ (docs/design.md §6)
  "routed mass": "routed_mass",
  "load max/mean": "load_max_over_mean",
  "router entropy": "router_entropy",
  "drop fraction": "drop_fraction",
}


def project_of(sweep: spec.Sweep) -> tuple[str, str]:
  """(entity, project) from the runs' `wandb.*` overrides, else the config defaults."""
  overrides = sweep.runs[0].overrides
  return str(overrides.get("wandb.entity", "")), str(overrides.get("wandb.project", "moejax"))


def loss_panels() -> list:
  return [wr.LinePlot(title="held-out loss (nats/token)", x="Step", y=[LOSS])]


def diagnostic_panels() -> list:
  """Per diagnostic: the mean over MoE layers, and one line per layer (regex)."""
  panels = []
  for label, name in DIAGNOSTICS.items():
    panels.append(wr.LinePlot(title=f"{label} (mean over layers)", x="Step", y=[f"moe/{name}"]))
    panels.append(
      wr.LinePlot(title=f"{label} per layer", x="Step", metric_regex=rf"^moe/layer\d+/{name}$")
    )
  return panels


def grid_panels() -> list:
  return [
    wr.WeavePanelSummaryTable(table_name=GRID_TABLE),
    wr.MediaBrowser(title="k1:k2 Δ heatmap per run", media_keys=[GRID_HEATMAP], num_columns=3),
  ]


def comparison_panels() -> list:
  """Δ at k1 = K/4 per k2 label, bars per rule (mean over its runs, stderr), then every
  run's grid rows in one table."""
  bars = wr.BarPlot(
    title="Δ loss at k1 = K/4 by k2 (mean over the rule's runs)",
    metrics=[QUARTER_PREFIX + label for label in LABELS],
    orientation="v",
    groupby_aggfunc="mean",
    groupby_rangefunc="stderr",
  )
  return [bars, wr.WeavePanelSummaryTable(table_name=GRID_TABLE)]


def workspace(sweep: spec.Sweep, entity: str, project: str) -> ws.Workspace:
  sections = [
    ws.Section(name="held-out loss", panels=loss_panels(), is_open=True),
    ws.Section(name="routing diagnostics", panels=diagnostic_panels(), is_open=True),
    ws.Section(name="k1:k2 grid", panels=grid_panels(), is_open=True),
  ]
  return ws.Workspace(
    entity=entity,
    project=project,
    name=f"sweep {sweep.name}",
    sections=sections,
    runset_settings=ws.RunsetSettings(
      filters=expr.And(expr.Metric("Group") == sweep.name), groupby=[expr.Config(RULE_KEY)]
    ),
  )


def _runset(sweep: spec.Sweep, entity: str, project: str, grouped: bool) -> wr.Runset:
  return wr.Runset(
    entity=entity,
    project=project,
    name=f"{sweep.name} by rule" if grouped else f"{sweep.name} runs",
    filters=expr.And(expr.Metric("Group") == sweep.name),
    groupby=[f"config.{RULE_KEY}"] if grouped else [],
  )


def report(sweep: spec.Sweep, entity: str, project: str) -> wr.Report:
  def grid(panels: list, grouped: bool = True) -> wr.PanelGrid:
    return wr.PanelGrid(runsets=[_runset(sweep, entity, project, grouped)], panels=panels)

  return wr.Report(
    entity=entity,
    project=project,
    title=f"Sweep {sweep.name}",
    description=f"wandb group {sweep.name}: {len(sweep.runs)} runs, grouped by {RULE_KEY}.",
    blocks=[
      wr.H1(f"Sweep {sweep.name}"),
      wr.H2("Held-out loss"),
      grid(loss_panels()),
      wr.H2("Routing diagnostics"),
      grid(diagnostic_panels()),
      wr.H2("k1:k2 grid of each run"),
      grid(grid_panels(), grouped=False),
      wr.H2("Δ at k1 = K/4 per rule and k2"),
      wr.P("Bars: mean Δ (stderr) over each rule's runs, per k2 label; table: every grid row."),
      grid(comparison_panels()),
    ],
  )


def specification(sweep: spec.Sweep, entity: str, project: str) -> dict:
  """What the library would save, as plain JSON (no network)."""
  w = workspace(sweep, entity, project)
  return {
    "workspace": pydantic.TypeAdapter(ws.Workspace).dump_python(w, mode="json"),
    "workspace_view": w._to_model().model_dump(mode="json", by_alias=True, exclude_none=True),
    "report": pydantic.TypeAdapter(wr.Report).dump_python(
      report(sweep, entity, project), mode="json"
    ),
  }


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.dashboard", description=__doc__.split("\n")[2])
  p.add_argument("sweep_file")
  p.add_argument("--dry-run", action="store_true", help="write the spec as JSON, no network")
  p.add_argument("--entity", default="", help="wandb entity (default: the sweep's or yours)")
  p.add_argument("--out", default="", help="dry run: JSON path (runs/launch/<sweep>/...)")
  args = p.parse_args(argv)
  try:
    sweep = spec.load(args.sweep_file)
  except UserError as e:
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2
  entity, project = project_of(sweep)
  entity = args.entity or entity
  if args.dry_run:
    out = args.out or os.path.join("runs", "launch", sweep.name, "dashboard.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(specification(sweep, entity or "ENTITY", project), f, indent=1, default=str)
    print(f"dashboard spec (dry run): {out}")
    return 0
  import wandb  # pylint: disable=import-outside-toplevel

  entity = entity or wandb.Api().default_entity
  saved_ws = workspace(sweep, entity, project).save()
  saved_report = report(sweep, entity, project).save()
  print(f"workspace: {saved_ws.url}\nreport: {saved_report.url}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
