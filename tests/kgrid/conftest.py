"""Fixtures of the k1:k2 grid tests, shared by every file in this folder (package scope).

One tiny mixtral-rule model is trained once (checkpoints at steps 15 and 30). Other merge
rules are evaluated on the same parameters by copying the run directory and editing
`model.moe` in its config.json (the evaluator reads the rule from there; the parameter
shapes do not depend on the rule).

Every evaluator run compiles one eval step per k1 and k2 family, so these tests turn on
JAX's persistent compilation cache (restored after the last test of this folder) and hand
the same cache to the CLI subprocesses: a cell compiled once is reused by every later run
with the same shapes.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from moejax.kgrid import forward, loading
from moejax.kgrid.loading import load_config
from moejax.kgrid.run import run_grid
from moejax.training import trainer

from .helpers import (
  BAD,
  BATCH,
  GRID,
  QUIET,
  RESAMPLES,
  SEQUENCES,
  K,
  cli,
  finish,
  read,
  tiny_config,
  variant,
)
from runconfig import as_run, saved_eval


@pytest.fixture(scope="package", autouse=True)
def compile_cache(tmp_path_factory):
  """Persistent XLA cache for this folder only (restored and reset afterwards)."""
  names = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
  )
  old = {n: getattr(jax.config, n) for n in names}
  cache = str(tmp_path_factory.mktemp("xla_cache"))
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  compilation_cache.reset_cache()
  yield cache
  for n, v in old.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()


@pytest.fixture(scope="package")
def trained(tmp_path_factory) -> str:
  """A 30-step mixtral run (K=4, E=8) with checkpoints at steps 15 and 30."""
  workdir = str(tmp_path_factory.mktemp("mixtral"))
  trainer.train(as_run(tiny_config()), workdir, log=lambda *a: None)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["15", "30"]
  return workdir


@pytest.fixture(scope="package")
def background(trained, compile_cache, tmp_path_factory):
  """Subprocesses started early so that they overlap the in-process grids (2 CPU cores).

  Right after training: every bad CLI invocation and the import check. `start_default()`
  (called once the in-process mixtral grid has filled the compile cache): the default CLI
  grid on a copy of the run.
  """
  base = tmp_path_factory.mktemp("cli")
  run = variant(trained, base / "bad_run")
  no_ckpt = base / "no_ckpt"
  no_ckpt.mkdir()
  shutil.copy(os.path.join(trained, "config.json"), no_ckpt / "config.json")
  no_cfg = base / "no_cfg"
  no_cfg.mkdir()
  procs = {}
  for name, (args, _) in BAD.items():
    workdir = {"no_checkpoint": no_ckpt, "no_config": no_cfg}.get(name, run)
    procs[name] = cli("--workdir", workdir, *args, "--sequences", SEQUENCES, cache=compile_cache)
  default_dir = variant(trained, base / "default_run")
  step_dir = variant(trained, base / "step_run")
  common = ["--sequences", SEQUENCES, "--batch_size", BATCH, "--resamples", RESAMPLES]

  def start_default():
    if "default" not in procs:
      procs["default"] = cli("--workdir", default_dir, *common, cache=compile_cache)
      procs["step"] = cli(
        "--workdir",
        step_dir,
        "--step",
        15,
        "--k1",
        K,
        "--k2",
        "native,E",
        *common,
        cache=compile_cache,
      )

  yield procs, start_default, {"default": default_dir, "step": step_dir}
  for proc in procs.values():  # only if a test failed before collecting it
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


@pytest.fixture(scope="package")
def mixtral_grid(trained, background, tmp_path_factory):
  """In-process run_grid on the mixtral run: k1 in {4, 2}, k2 in {native, k1, E, sqrt, gain}."""
  workdir = variant(trained, tmp_path_factory.mktemp("mixtral_grid") / "run")
  rows = run_grid(
    workdir, saved_eval(workdir, k1="4,2", k2="native,k1,E,sqrt,gain", **GRID), **QUIET
  )
  background[1]()  # its cells are cached now: start the default CLI grid
  return workdir, rows


@pytest.fixture(scope="package")
def olmoe_grid(trained, mixtral_grid, tmp_path_factory):
  """The same parameters under the olmoe rule (softmax, no renormalization)."""
  workdir = variant(trained, tmp_path_factory.mktemp("olmoe") / "run", rule="olmoe")
  return workdir, run_grid(
    workdir, saved_eval(workdir, k1="4,2", k2="native,E,sqrt", **GRID), **QUIET
  )


@pytest.fixture(scope="package")
def v3_grid(trained, mixtral_grid, tmp_path_factory):
  """The same parameters under deepseek_v3 (sigmoid, 4 groups keep 2, scale 2.5), K=2."""
  workdir = variant(
    trained,
    tmp_path_factory.mktemp("v3") / "run",
    rule="deepseek_v3",
    top_k=2,
    n_groups=4,
    topk_groups=2,
  )
  return workdir, run_grid(
    workdir, saved_eval(workdir, k1="2", k2="native,K,2K,6,E", **GRID), **QUIET
  )


@pytest.fixture(scope="package")
def cli_default(background, mixtral_grid, olmoe_grid, v3_grid):
  """`python -m moejax.evaluate --workdir DIR` with default k1/k2 on the step-30 run (the
  other in-process grids are computed first, while this subprocess runs)."""
  procs, start_default, dirs = background
  start_default()
  res = finish(procs["default"])
  out = os.path.join(dirs["default"], "eval")
  files = {}
  for name in ("k_grid.jsonl", "k_grid.md", "k_grid.png"):
    path = os.path.join(out, name)
    files[name] = read(path, "rb") if os.path.exists(path) else None
  rows = (
    [json.loads(l) for l in files["k_grid.jsonl"].decode().splitlines() if l.strip()]
    if files["k_grid.jsonl"]
    else []
  )
  return res, rows, files


@pytest.fixture(scope="package")
def bad_runs(background):
  procs = background[0]
  return {name: finish(procs[name]) for name in BAD}


@pytest.fixture(scope="package")
def restored(trained):
  c = load_config(trained)
  ev = loading.load_run(trained, c, None)
  return c, ev, forward.CellForward(ev.graphdef, ev.params, ev.router, ev.n_moe_layers)
