"""Shared tiny configs and helpers for the failure tests (test_failures, test_preemption)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from moejax import config as config_lib

# The shape every trainer test shares: 2 layers, d_model 32, synthetic data, batch 4.
TINY_SHAPE = {
  "model.n_layers": 2,
  "model.d_model": 32,
  "model.d_ff": 64,
  "model.n_heads": 2,
  "model.n_kv_heads": 1,
  "model.moe.d_expert": 32,
  "data.corpus": "synthetic",
  "data.synthetic_docs": 200,
  "data.batch_size": 4,
}

# TINY_SHAPE with the cadence every trainer test shares: 6 steps, a log line each, a
# checkpoint every 3, no periodic eval, no wandb.
TINY_RUN = {
  **TINY_SHAPE,
  "train.steps": 6,
  "train.log_every": 1,
  "train.eval_every": 100,
  "train.ckpt_every": 3,
  "train.eval_sequences": 4,
  "eval.batch_size": 4,
  "wandb.mode": "disabled",
  "train.tensorboard": False,  # tensorboardX imports torch (seconds per process); its own tests
}

# d_model 32, 2 layers, E 4, seq 16, batch 4 (the tiny config).
TINY = {
  **TINY_RUN,
  "model.moe.n_experts": 4,
  "model.moe.top_k": 2,
  "data.seq_len": 16,
  "train.progress": False,
  "optim.warmup_steps": 2,
  "eval.sequences": 8,
}


def override(c: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
  """A copy of `c` with dotted keys set (each key must exist)."""
  c = ml_collections.ConfigDict(c.to_dict())
  for dotted, value in values.items():
    *parents, leaf = dotted.split(".")
    node = c
    for part in parents:
      node = node[part]
    assert leaf in node, dotted
    node[leaf] = value
  return c


def tiny(base: dict = TINY, **values) -> ml_collections.ConfigDict:
  """base_config() shrunk by `base` (TINY), then `values` (dotted keys spelled with `__`)."""
  extra = {k.replace("__", "."): v for k, v in values.items()}
  return override(override(config_lib.base_config(), base), extra)


@pytest.fixture(scope="module", autouse=True)
def fast_compiles(tmp_path_factory):
  """A persistent XLA cache and XLA's cheap (-O0-like) compiles, for each module that
  imports this fixture (autouse applies where pytest finds it: the importing module)."""
  values = {
    "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("xla_cache")),
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
    "jax_disable_most_optimizations": True,
  }
  old = {n: jax.config.values[n] for n in values}
  for n, v in values.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()
  yield
  for n, v in old.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()


def cli_args(values: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in values.items()]


def metric_rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def assert_trees_equal(a, b, what: str) -> None:
  """Bitwise equality of two pytrees."""
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb], what
  diff = [
    jax.tree_util.keystr(p)
    for (p, x), (_, y) in zip(la, lb)
    if not np.array_equal(np.asarray(x), np.asarray(y))
  ]
  assert not diff, f"{what}: leaves differ: {diff[:8]}"


TRAIN_KEYS = ("loss", "lm_loss", "grad_norm", "lr", "moe/aux_loss", "eval_loss")


def same_rows(a: list[dict], b: list[dict]) -> None:
  """Same steps and bitwise the same training metrics (timing excluded)."""
  assert [r["step"] for r in a] == [r["step"] for r in b]
  for key in TRAIN_KEYS:
    assert [r.get(key) for r in a] == [r.get(key) for r in b], key


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results_on_host_devices(script: str, path, n_devices: int, timeout: int = 600, **env) -> dict:
  """Runs `script` (written to `path`) in a subprocess with `n_devices` fake CPU devices and
  returns the JSON of its one `RESULTS ` line; `env` adds variables."""
  path.write_text(script)
  flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip(), **env}
  proc = subprocess.run(
    [sys.executable, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
  assert len(lines) == 1, proc.stdout[-2000:]
  return json.loads(lines[0][len("RESULTS ") :])


def kill_when(proc: subprocess.Popen, condition, timeout: float = 300, poll_s: float = 0.002):
  """SIGKILLs `proc` as soon as `condition()` holds (polled every `poll_s`); fails the test
  with `proc`'s exit code and the tail of its stderr if it exits, or times out, first."""
  deadline = time.time() + timeout
  while proc.poll() is None and time.time() < deadline:
    if condition():
      proc.kill()
      proc.wait()
      return
    time.sleep(poll_s)
  proc.kill()
  _, err = proc.communicate()
  pytest.fail(f"exited {proc.returncode} before the kill condition held:\n{err[-3000:]}")


class Killed(Exception):
  """A prepare killed mid-corpus (`kill_at_fourth_shard`)."""


def kill_at_fourth_shard(monkeypatch):
  """Patches the shard writer to raise Killed at the 4th shard (part 0's two written, then
  one of part 1's). Returns (the names written, `record`): `record()` patches it again for
  the rerun, which appends every shard it writes to the same list."""
  from moejax.data import shards  # pylint: disable=import-outside-toplevel

  real, written = shards.write_shard, []

  def dies_at_the_fourth(directory, name, w):
    if len(written) == 3:
      raise Killed(name)
    written.append(name)
    return real(directory, name, w)

  def record():
    monkeypatch.setattr(shards, "write_shard", lambda *a: written.append(a[1]) or real(*a))

  monkeypatch.setattr(shards, "write_shard", dies_at_the_fourth)
  return written, record
