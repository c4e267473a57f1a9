"""launch.dashboard: the workspace and report spec (panels, grouping, filters), offline."""

import json
import os
import re

import pytest

from launch import dashboard, spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = os.path.join(REPO, "experiments", "example", "sweep.py")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  out = tmp_path_factory.mktemp("dash") / "dashboard.json"
  assert dashboard.main([SWEEP, "--dry-run", "--entity", "me", "--out", str(out)]) == 0
  with open(out) as f:
    return json.load(f)


def _panels(section: dict) -> list[dict]:
  return section["panels"]


def test_workspace_sections_group_by_rule_and_filter_the_sweep_group(written):
  w = written["workspace"]
  assert (w["entity"], w["project"], w["name"]) == ("me", "moejax", "sweep example")
  assert [s["name"] for s in w["sections"]] == [
    "held-out loss",
    "routing diagnostics",
    "k1:k2 grid",
  ]
  view = json.dumps(written["workspace_view"])  # what wandb-workspaces would save
  assert '"grouping": [{"section": "config", "name": "model.value.moe.rule"}]' in view
  assert '{"key": {"section": "run", "name": "group"}, "op": "=", "value": "example"' in view
  loss = _panels(w["sections"][0])
  assert [(p["x"], p["y"]) for p in loss] == [("Step", ["eval_loss"])]


def test_diagnostic_panels_cover_every_layer_of_each_metric(written):
  panels = _panels(written["workspace"]["sections"][1])
  names = ["routed_mass", "load_max_over_mean", "router_entropy", "drop_fraction"]
  means = [p["y"] for p in panels if p["y"]]
  assert means == [[f"moe/{n}"] for n in names]
  regexes = [p["metric_regex"] for p in panels if p["metric_regex"]]
  assert len(regexes) == 4
  for n, rx in zip(names, regexes):
    assert all(re.search(rx, f"moe/layer{i}/{n}") for i in (0, 3, 11))
    assert not re.search(rx, f"moe/{n}") and not re.search(rx, f"moe/layer0/{n}_x")


def test_grid_panels_and_report_comparison(written):
  grid = _panels(written["workspace"]["sections"][2])
  assert grid[0]["table_name"] == "eval/k_grid"
  assert grid[1]["media_keys"] == ["eval/k_grid_heatmap"]
  r = written["report"]
  assert r["title"] == "Sweep example" and r["entity"] == "me"
  grids = [b for b in r["blocks"] if "runsets" in b]
  heads = [b["text"] for b in r["blocks"] if b.get("text") and isinstance(b["text"], str)]
  assert "Δ at k1 = K/4 per rule and k2" in json.dumps(heads, ensure_ascii=False)
  assert len(grids) == 4
  for g in grids:
    (rs,) = g["runsets"]
    assert rs["filters"] == "Metric(\"Group\") == 'example'"
  by_rule = [g["runsets"][0]["groupby"] == ["config.model.moe.rule"] for g in grids]
  assert by_rule == [True, True, False, True]  # per-run grids stay ungrouped
  bars, table = grids[3]["panels"]
  expected = [f"eval/delta_k1_quarter/{k2}" for k2 in "native k1 K 2K 4K E sqrt gain".split()]
  assert [m if isinstance(m, str) else m["name"] for m in bars["metrics"]] == expected
  assert table["table_name"] == "eval/k_grid"
  assert grids[2]["panels"][1]["media_keys"] == ["eval/k_grid_heatmap"]


def test_dashboard_bad_sweep_file_is_one_line(capsys):
  assert dashboard.main(["experiments/nope/sweep.py", "--dry-run"]) == 2
  assert capsys.readouterr().err.startswith("error: sweep file experiments/nope/sweep.py")


def test_project_follows_the_runs_overrides():
  run = spec.RunSpec("a", "c.py", {"wandb.project": "p2", "wandb.entity": "team"}, {})
  assert dashboard.project_of(spec.Sweep("s", [run])) == ("team", "p2")
