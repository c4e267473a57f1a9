"""Tracker: metrics.jsonl rows, wandb offline with a run id kept for resume."""

import glob
import json
import math
import os
import struct
import subprocess
import sys

import pytest
from failure_helpers import REPO, TINY, cli_args
from test_tensorboard import read_events
from tiers import FULL
from wandb.proto import wandb_internal_pb2

from moejax.kgrid.run import WANDB_COLUMNS
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


# ---------------------------------------------------------------- the k-grid's wandb, offline


def wandb_records(path: str):
  """The Records of an offline run's `run-<id>.wandb`: a ':W&B' header, then LevelDB log
  blocks of 32 KiB whose chunks (crc, length, type: 1 full, 2 first, 3 middle, 4 last)
  hold one serialized Record per full/first..last sequence."""
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  at, chunks = 7, []
  while at + 7 <= len(data):
    left = 32768 - at % 32768
    _, length, kind = struct.unpack("<IHB", data[at : at + 7])
    if left < 7 or (length == 0 and kind == 0):  # a block's zero padding
      at += left
      continue
    chunks.append(data[at + 7 : at + 7 + length])
    at += 7 + length
    if kind in (1, 4):
      yield wandb_internal_pb2.Record.FromString(b"".join(chunks))
      chunks = []


def summary(run_dir: str) -> dict:
  """The summary keys an offline run's records set, '/'-joined, JSON-decoded."""
  out = {}
  for path in glob.glob(os.path.join(run_dir, "run-*.wandb")):
    for r in wandb_records(path):
      if r.WhichOneof("record_type") == "summary":
        for u in r.summary.update:
          out[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
  return out


@FULL
def test_an_offline_run_with_its_grid_logs_the_table_heatmap_and_summary(tmp_path):
  """2 steps, wandb.mode=offline, eval.after_train: the training run's last row and, in the
  same run id, the grid's table (its file), heatmap and k1 = K/4 summary keys; the grid's
  table and heatmap also go to TensorBoard."""
  workdir = str(tmp_path / "run")
  values = {**TINY, "train.steps": 2, "wandb.mode": "offline", "eval.after_train": True,
            "train.tensorboard": True, "eval.k1": "2,1", "eval.k2": "native,k1"}  # fmt: skip
  env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"} | {"WANDB_SILENT": "true"}
  cmd = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py"]
  out = subprocess.run([*cmd, "--workdir", workdir, *cli_args(values)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]

  def lines(*path: str) -> list[dict]:
    with open(os.path.join(workdir, *path)) as f:
      return [json.loads(line) for line in f]

  with open(os.path.join(workdir, "wandb_run_id")) as f:
    run_id = f.read().strip()
  train_run, grid_run = sorted(glob.glob(os.path.join(workdir, "wandb", f"offline-run-*-{run_id}")))
  last = lines("metrics.jsonl")[-1]
  assert summary(train_run)["lm_loss"] == pytest.approx(last["lm_loss"], rel=1e-6)
  grid = lines("eval", "k_grid.jsonl")
  got = summary(grid_run)
  assert got["eval/k_grid/_type"] == "table-file" and got["eval/k_grid/nrows"] == len(grid) == 4
  assert got["eval/k_grid_heatmap/_type"] == "image-file"
  quarter = {k: v for k, v in got.items() if k.startswith("eval/delta_k1_quarter/")}
  assert sorted(quarter.values()) == sorted(r["delta"] for r in grid if r["k1"] == 1)  # K=2
  with open(os.path.join(grid_run, "files", got["eval/k_grid/path"])) as f:
    table = json.load(f)
  assert table["columns"] == list(WANDB_COLUMNS)
  rows = [dict(zip(table["columns"], row)) for row in table["data"]]
  assert [(r["k1"], r["loss"], r["delta"]) for r in rows] == [
    (g["k1"], g["loss"], g["delta"]) for g in grid
  ]
  values = {
    v.tag for e in read_events(os.path.join(workdir, "tensorboard")) for v in e.summary.value
  }
  assert {"eval/k_grid/text_summary", "eval/k_grid_heatmap", "lm_loss"} <= values
