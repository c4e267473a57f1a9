"""Tracker: metrics.jsonl rows, wandb offline with a run id kept for resume."""

import json
import math
import os

import pytest

from moejax.training import tracking


def test_metrics_rows_and_nonfinite_as_null(tmp_path):
  t = tracking.Tracker(str(tmp_path), {"a": 1}, mode="disabled", project="p")
  t.log({"step": 1, "loss": 2.5, "bad": math.inf})
  t.log({"step": 2, "loss": 2.0})
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows == [{"step": 1, "loss": 2.5, "bad": None}, {"step": 2, "loss": 2.0}]
  assert t.run is None and not os.path.exists(tmp_path / "wandb_run_id")


def test_wandb_offline_keeps_run_id_for_resume(tmp_path, monkeypatch):
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.setenv("WANDB_SILENT", "true")
  first = tracking.Tracker(str(tmp_path), {"x": 1}, mode="offline", project="moejax-test")
  first.log({"step": 1, "loss": 1.0})
  first.finish()
  run_id = open(tmp_path / "wandb_run_id").read().strip()
  assert run_id and "wandb sync" in first.note
  second = tracking.Tracker(str(tmp_path), {"x": 1}, mode="offline", project="moejax-test")
  assert second.run.id == run_id
  second.finish()
  assert any(p.startswith("offline-run-") for p in os.listdir(tmp_path / "wandb"))


@pytest.mark.parametrize("mode", ["offline", "online", "disabled"])
def test_explicit_modes_pass_through(mode):
  assert tracking.wandb_mode(mode) == mode


def test_auto_mode_respectswandb_mode_env(monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "disabled")
  assert tracking.wandb_mode("auto") == "disabled"
  monkeypatch.setenv("WANDB_MODE", "offline")
  assert tracking.wandb_mode("auto") == "offline"


def test_auto_withwandb_mode_disabled_starts_no_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "disabled")
  t = tracking.Tracker(str(tmp_path), {}, mode="auto", project="p")
  assert t.run is None and not os.path.exists(tmp_path / "wandb")
