"""Real processes, real signals: kill -9 at three points (one during a checkpoint save) and
rerunning gives the uninterrupted run's losses and bitwise state; SIGTERM and SIGINT save
the current step and exit 0 (docs/failures.md)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from failure_helpers import (
  TINY,
  assert_trees_equal,
  cli_args,
  kill_when,
  metric_rows,
  same_rows,
  tiny,
)
from tiers import FULL, one_default

from moejax.training import checkpoint, trainer
from runconfig import as_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 16
RUN = {
  **TINY,
  "train.steps": STEPS,
  "train.ckpt_every": 2,
  "train.log_every": 1,
  "train.keep_checkpoints": 2,
  "eval.after_train": False,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("xla_cache"))
  return {
    **os.environ,
    "WANDB_MODE": "disabled",
    "MOEJAX_TRACEBACK": "1",  # a run that fails shows where (moejax.cli.run_main)
    "PYTHONPATH": REPO,
    "JAX_COMPILATION_CACHE_DIR": cache,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }


def start(workdir: str, env: dict, **values) -> subprocess.Popen:
  args = cli_args({**RUN, **values})
  cmd = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py", *args]
  return subprocess.Popen(
    [*cmd, "--workdir", workdir],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def logged_steps(workdir: str) -> list[int]:
  """Steps of the complete rows of metrics.jsonl so far."""
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = f.read().split("\n")[:-1]
  except FileNotFoundError:
    return []
  return [json.loads(line)["step"] for line in lines if line]


def saving(workdir: str) -> bool:
  """An orbax save in progress: its temporary step directory exists."""
  return bool(glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*")))


@FULL
def test_kill_9_at_three_points_then_rerun_matches_an_uninterrupted_run(env, tmp_path):
  reference, workdir = str(tmp_path / "reference"), str(tmp_path / "killed")
  ref = start(reference, env)
  first = start(workdir, env)
  kill_when(first, lambda: len(logged_steps(workdir)) >= 1)
  during_save = start(workdir, env)
  kill_when(during_save, lambda: saving(workdir))
  assert saving(workdir)  # the kill landed mid-save: its temporary directory is left behind
  third = start(workdir, env)
  kill_when(third, lambda: max(logged_steps(workdir), default=0) >= STEPS - 5)
  last = start(workdir, env)
  _, err = last.communicate(timeout=300)
  assert last.returncode == 0, err[-3000:]
  _, ref_err = ref.communicate(timeout=300)
  assert ref.returncode == 0, ref_err[-3000:]
  assert [r["step"] for r in metric_rows(workdir)] == list(range(1, STEPS + 1))
  same_rows(metric_rows(workdir), metric_rows(reference))
  abstract = trainer.build(as_run(tiny(**{k.replace(".", "__"): v for k, v in RUN.items()})), None).state
  a = checkpoint.restore(checkpoint.manager(workdir), abstract)
  b = checkpoint.restore(checkpoint.manager(reference), abstract)
  assert a[0] == b[0] == STEPS and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "final state after three kills")
  assert not saving(workdir)  # the abandoned temporary directory was cleaned up


@pytest.mark.parametrize(
  "sig", one_default([signal.SIGTERM, signal.SIGINT], signal.SIGTERM, ids=lambda s: s.name)
)
def test_signal_saves_the_current_step_and_exits_0(env, tmp_path, sig):
  workdir = str(tmp_path / "run")
  proc = start(workdir, env, **{"train.steps": 2000, "train.ckpt_every": 1000})
  deadline = time.time() + 300
  while len(logged_steps(workdir)) < 3 and proc.poll() is None and time.time() < deadline:
    time.sleep(0.005)
  seen = max(logged_steps(workdir))
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert "Traceback" not in err
  saved = checkpoint.manager(workdir).all_steps()
  assert len(saved) == 1, saved
  (step,) = saved
  assert seen <= step <= seen + 3, (seen, step)  # the step in flight, not a later one
  assert f"stopped by {sig.name} at step {step}" in out, out
  assert max(logged_steps(workdir)) <= step
