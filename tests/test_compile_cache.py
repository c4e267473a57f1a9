"""train.compile_cache (moejax.training.compile_cache): which folder each setting names, that
JAX writes a compiled program there even after earlier compiles in the process, and that the
sweep launcher points every run of a sweep at one cache under the sweep's folder."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from launch import commands
from launch.spec import RunSpec, Sweep
from moejax.errors import UserError
from moejax.training import compile_cache

FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def jax_flags():
  """JAX's cache flags as they were before the test, put back after it."""
  old = {name: jax.config.values[name] for name in FLAGS}
  yield
  for name, value in old.items():
    jax.config.update(name, value)
  jax_cache.reset_cache()


def test_each_setting_names_its_folder(jax_flags, monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path))
  jax.config.update("jax_compilation_cache_dir", None)
  assert compile_cache.resolve("auto") == str(tmp_path / ".cache" / "moejax" / "xla")
  jax.config.update("jax_compilation_cache_dir", "/somewhere/jax")  # as JAX_COMPILATION_CACHE_DIR
  assert compile_cache.resolve("auto") == "/somewhere/jax"
  assert compile_cache.resolve("") is None
  assert compile_cache.resolve("gs://b/sweep/xla_cache") == "gs://b/sweep/xla_cache"
  assert compile_cache.resolve("~/c") == str(tmp_path / "c")


def test_enable_writes_the_next_compile_to_the_folder(jax_flags, tmp_path):
  jax.jit(lambda x: x * 3)(jnp.ones(3)).block_until_ready()  # a compile before the cache
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  cache = str(tmp_path / "xla")
  assert compile_cache.enable(cache) == cache
  assert jax.config.values["jax_compilation_cache_dir"] == cache
  jax.jit(lambda x: jnp.sin(x) * 7 + 1)(jnp.ones(5)).block_until_ready()
  assert os.listdir(cache)  # the program's executable was written
  assert compile_cache.enable("") is None
  assert jax.config.values["jax_compilation_cache_dir"] is None


def test_a_folder_that_cannot_be_made_is_a_one_line_error(jax_flags, tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(UserError, match=r"train.compile_cache='.*file/xla'.*not a directory"):
    compile_cache.enable(str(tmp_path / "file" / "xla"))


@pytest.mark.parametrize("root", ["runs", "gs://bucket/runs"])
def test_every_run_of_a_sweep_shares_one_cache_under_the_sweep(root):
  sweep = Sweep("s", [RunSpec(f"r{i}", "configs/quickstart.py", {}, {}) for i in range(2)])
  own = RunSpec("own", "c.py", {"train.compile_cache": ""}, {})
  caches = set()
  for run in sweep.runs:
    argv = commands.train_argv(sweep, run, commands.run_dir(root, sweep, run))
    caches |= {a.split("=", 1)[1] for a in argv if a.startswith("--config.train.compile_cache=")}
  assert caches == {f"{root}/s/xla_cache"}
  argv = commands.train_argv(sweep, own, commands.run_dir(root, sweep, own))
  assert "--config.train.compile_cache=" in argv  # a run's own setting wins
  assert f"--config.train.compile_cache={root}/s/xla_cache" not in argv
