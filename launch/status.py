"""A local run directory's state: complete or not, progress from metrics.jsonl, results copy."""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

from launch import commands
from launch.spec import RunSpec

RESULT_FILES = ("config.json", "metrics.jsonl")


class Progress(NamedTuple):
  step: int  # last logged step (0 before the first row)
  steps: int  # target step from config.json (0 until training has started)
  eval_loss: float | None  # latest held-out loss


def is_complete(workdir: str, run: RunSpec, results: str | None) -> bool:
  """Every grid file exists, under the run dir or under `<results>/<run>`."""
  dirs = [workdir] + ([os.path.join(results, run.name)] if results else [])
  return any(
    all(os.path.exists(os.path.join(d, f)) for f in commands.grid_files(run)) for d in dirs
  )


def target_steps(workdir: str) -> int:
  """`train.stop_at or train.steps` from config.json (0 when there is none yet)."""
  path = os.path.join(workdir, "config.json")
  try:
    with open(path) as f:
      train = json.load(f)["train"]
  except (OSError, ValueError, KeyError):
    return 0
  return int(train.get("stop_at") or train["steps"])


def progress(workdir: str) -> Progress:
  step, eval_loss = 0, None
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:  # a row being written
          continue
        step = row.get("step", step)
        eval_loss = row.get("eval_loss") if row.get("eval_loss") is not None else eval_loss
  return Progress(step, target_steps(workdir), eval_loss)


def copy_results(workdir: str, dest: str) -> None:
  """config.json, metrics.jsonl and the whole eval/ folder into `dest`."""
  os.makedirs(dest, exist_ok=True)
  for name in RESULT_FILES:
    shutil.copy2(os.path.join(workdir, name), os.path.join(dest, name))
  shutil.copytree(os.path.join(workdir, "eval"), os.path.join(dest, "eval"), dirs_exist_ok=True)
