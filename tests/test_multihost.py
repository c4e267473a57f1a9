"""Multi-host JAX (moejax.distributed): two processes on this machine train like one.

Two `python -m moejax.train` processes started with JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID (one CPU device each, gloo collectives) train 3 steps,
save, and are started again to resume and train 2 more, in one shared workdir with a BPE
tokenizer. The reference is one process over the same 2-device mesh
(`--xla_force_host_platform_device_count=2`) training 5 steps on the same global batches:
losses and final parameters must agree within 1e-5. (That a 2-device mesh equals one
device is test_sharding.py's job.) The unit tests below check the per-process row split.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from failure_helpers import TINY_RUN
from tiers import FULL

from moejax import distributed
from moejax.data.pipeline import TrainIterator
from moejax.distributed import Shard
from moejax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
TINY = {
  **TINY_RUN,
  "data.tokenizer": "bpe",
  "data.bpe_vocab_size": 300,
  "data.seq_len": 32,
  "train.steps": 5,
  "eval.after_train": False,
}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(workdir: str, log: str, stop_at: int, env: dict) -> subprocess.Popen:
  args = [f"--config.{k}={v}" for k, v in {**TINY, "train.stop_at": stop_at}.items()]
  cmd = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py"]
  with open(log, "a") as f:
    return subprocess.Popen(
      [*cmd, "--workdir", workdir, *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
    )


def _env(**extra: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
  return {
    **env,
    "PYTHONPATH": REPO,
    "WANDB_MODE": "disabled",
    "JAX_PLATFORMS": "cpu",
    "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",  # cheap compiles; both sides run the same flags
    **extra,
  }


def _wait(procs: list[subprocess.Popen], logs: list[str]) -> None:
  for p, log in zip(procs, logs):
    p.wait(timeout=600)
    assert p.returncode == 0, _read(log)[-4000:]


def _two_processes(workdir: str, logs: list[str], stop_at: int) -> None:
  port = _free_port()
  procs = [
    _start(
      workdir,
      logs[i],
      stop_at,
      _env(
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)
      ),
    )
    for i in range(2)
  ]
  _wait(procs, logs)


def _checkpoint(workdir: str, step: int) -> dict:
  """The saved train state as NumPy arrays, whatever mesh wrote it."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  with ocp.PyTreeCheckpointer() as ck:
    tree = ck.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multihost")
  multi, single = str(root / "two_processes"), str(root / "one_process")
  logs = [str(root / f"process{i}.log") for i in range(2)]
  ref_log = str(root / "one_process.log")
  ref = _start(
    single, ref_log, 0, _env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
  )  # runs alongside the two-process phases
  _two_processes(multi, logs, stop_at=3)
  first_rows = _rows(multi)
  _two_processes(multi, logs, stop_at=0)
  _wait([ref], [ref_log])
  return {
    "multi": multi,
    "single": single,
    "first_rows": first_rows,
    "rows": _rows(multi),
    "ref_rows": _rows(single),
    "logs": [_read(p) for p in logs],
    "state": _checkpoint(multi, 5),
    "ref_state": _checkpoint(single, 5),
  }


@FULL
def test_two_processes_log_once_and_resume(runs):
  assert [r["step"] for r in runs["first_rows"]] == [1, 2, 3]
  assert [r["step"] for r in runs["rows"]] == [1, 2, 3, 4, 5]  # process 1 writes no rows
  assert sorted(os.listdir(os.path.join(runs["multi"], "checkpoints"))) == ["3", "5"]
  p0, p1 = runs["logs"]
  assert "resumed from" in p0 and "model:" in p0
  assert "resumed from" not in p1 and "model:" not in p1  # only process 0 prints
  config = json.loads(_read(os.path.join(runs["multi"], "config.json")))
  assert config["resolved"]["devices"] == 2


@FULL
def test_bpe_trained_once_and_shared(runs):
  names = os.listdir(os.path.join(runs["multi"], "tokenizer"))
  assert len(names) == 1 and names[0].endswith(".json"), names  # no temporary files left
  ours = _read(os.path.join(runs["multi"], "tokenizer", names[0]))
  ref = _read(os.path.join(runs["single"], "tokenizer", names[0]))
  assert ours == ref


@FULL
def test_losses_match_one_process(runs):
  assert len(runs["ref_rows"]) == 5
  for ours, ref in zip(runs["rows"], runs["ref_rows"]):
    for key in ("loss", "lm_loss", "grad_norm"):
      assert abs(ours[key] - ref[key]) <= TOL * max(1.0, abs(ref[key])), (ours["step"], key)


@FULL
def test_final_parameters_match_one_process(runs):
  ours, ref = runs["state"], runs["ref_state"]
  assert int(ours["step"]) == int(ref["step"]) == 5
  leaves = jax.tree_util.tree_leaves_with_path(ours)
  ref_leaves = jax.tree.leaves(ref)
  assert len(leaves) == len(ref_leaves) > 10
  for (path, a), b in zip(leaves, ref_leaves):
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=jax.tree_util.keystr(path))


# --- the per-process row split (no subprocess) -----------------------------------------------


def test_shards_concatenate_to_the_one_process_batch():
  windows_NxL = np.arange(30 * 3).reshape(30, 3)
  whole = TrainIterator(windows_NxL, 6, seed=1)
  parts = [TrainIterator(windows_NxL, 6, seed=1, shard=Shard(i, 3)) for i in range(3)]
  for _ in range(12):  # past an epoch boundary (5 batches per epoch)
    expected = next(whole)["tokens"]
    got = np.concatenate([next(p)["tokens"] for p in parts])
    np.testing.assert_array_equal(got, expected)
  # The state counts global batches, so it moves between process counts.
  resumed = TrainIterator(windows_NxL, 6, seed=1, shard=Shard(1, 3))
  resumed.set_state(whole.get_state())
  np.testing.assert_array_equal(next(resumed)["tokens"], next(whole)["tokens"][2:4])


def test_batch_that_does_not_split_is_a_user_error():
  with pytest.raises(UserError, match="data.batch_size=5"):
    TrainIterator(np.zeros((10, 3), np.int32), 5, seed=0, shard=Shard(0, 2))


class _FakeSharding:
  """What process_rows reads: row slices of this process's devices."""

  def __init__(self, slices):
    self.slices = slices

  def addressable_devices_indices_map(self, shape):
    return {i: (s,) for i, s in enumerate(self.slices)}


@pytest.mark.parametrize(
  ("slices", "expected"),
  [
    ([slice(0, 8)], (0, 1)),  # one process holds the whole batch
    ([slice(4, 6), slice(6, 8)], (1, 2)),  # second half over two local devices
    ([slice(2, 4), slice(2, 4)], (1, 4)),  # replicated over a local `expert` axis
    ([slice(None)], (0, 1)),  # fully replicated
  ],
)
def test_process_rows(slices, expected):
  assert distributed.process_rows(_FakeSharding(slices), 8) == expected


def test_process_rows_rejects_a_gap():
  with pytest.raises(UserError, match="contiguous"):
    distributed.process_rows(_FakeSharding([slice(0, 2), slice(4, 6)]), 8)


@pytest.mark.parametrize(
  ("env", "message"),
  [
    ({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_PROCESS_ID is required"),
    (
      {"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "2"},
      r"JAX_PROCESS_ID='2': must be an integer in \[0, 1\]",
    ),
  ],
)
def test_bad_process_environment_is_a_user_error(monkeypatch, env, message):
  for key in (distributed.ENV_ADDRESS, distributed.ENV_COUNT, distributed.ENV_ID):
    monkeypatch.delenv(key, raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  with pytest.raises(UserError, match=message):
    distributed.env_processes()


def test_environment_selects_multi_process_mode(monkeypatch):
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  assert distributed.env_processes() is None  # one process: nothing to start
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.2:1234")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert distributed.env_processes() == ("10.0.0.2:1234", 4, 3)
