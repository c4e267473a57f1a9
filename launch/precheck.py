"""What a sky sweep must pass before anything is launched (dry run or not).

* No placeholder is left in a run's data path or any string override (the TPU sweep's
  `gs://YOUR_BUCKET/...` is refused, naming the run and the key).
* The run's train step is compiled for its accelerator's compile-only devices the way
  `moejax.aot` builds it, and refused when it does not compile or its per-device bytes
  exceed the device's memory: a TPU slice by its topology (`tpu-v5e-16` -> `v5e:4x4`, libtpu:
  the `tpu` extra), GPU nodes by their shipped target config (`H100:8` with num_nodes 2 ->
  `h100:2x8`; jax's CUDA plugin: the `cuda` extra). Without the compiler the run is listed as
  not checked (a GPU run is still exported for ("cuda",), so a lowering error refuses it);
  so is a GPU without a target config (`aot.GPUS`).

One compile per memory signature (`memory_signature`), not per run: runs whose configs
differ only in what sets values, not buffers, build programs of the same bytes. Left out of
the key: `train.seed`, the schedule's lengths and rates, init scales, `data.paths` and `data.prepared`, `eval.*`
(the grid is not compiled here), `wandb.*`, and the merge rule's coefficient math (its
score, norm, lp, scale and group score): those are elementwise maps of the router's
[tokens, E] scores into buffers of the same shapes and dtypes. The rule's structure stays in
the key (a shared expert and its gate, a selection bias, expert groups: they add parameters
or router state), as do shapes, dtypes, dispatch mode and impl, remat, attention, mesh,
batch, the losses and the accelerator. Measured on v5e:4x4 (docs/cloud.md): factor B's
eight rules at the TPU preset span 0.03 GiB of 15.75. Distinct programs compile in parallel
worker processes (`workers`); `per_run=True` compiles every run on its own.

Each compile's answer is kept in an `aot.cache.Store` (`cache_dir`), keyed by the lowered
program's text, the target and the compilers, so the launch after a dry run, or a second
dry run, lowers every program and compiles only those it has not compiled before
(`fresh=True`: all of them again).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import re
import time
from collections.abc import Callable

import ml_collections

from launch import commands
from launch.spec import RunSpec, Sweep
from moejax.errors import UserError

PLACEHOLDER = re.compile(r"YOUR_[A-Z_]+|<[A-Za-z_ -]+>|CHANGE_?ME")
# Config keys that set values, not the program's buffers (see the module docstring).
VALUE_KEYS = (
  "train.seed",
  "train.steps",
  "train.log_every",
  "train.eval_every",
  "train.ckpt_every",
  "train.keep_checkpoints",
  "optim.lr",
  "optim.warmup_steps",
  "model.init_std",
  "model.moe.expert_init_std",
  "data.paths",
  "data.prepared",
  "eval",
  "wandb",
)
RULE_MATH = ("score", "norm", "lp", "scale", "group_score")  # routing.MergeRule fields


def run_config(sweep: Sweep, run: RunSpec) -> ml_collections.ConfigDict:
  """The config `moejax.train` will see: the run's file with the launcher's and the run's
  overrides (`commands.overrides`) set."""
  from moejax import cli  # pylint: disable=import-outside-toplevel

  c = cli.load_file(run.config)
  for key, value in commands.overrides(sweep, run).items():
    *path, last = key.split(".")
    node = c
    try:
      for part in path:
        node = node[part]
      if last not in node:
        raise KeyError(last)
      node[last] = value
    except (KeyError, TypeError, AttributeError) as e:
      raise UserError(f"override {key}={value!r} is not allowed ({e})") from None
  return c


def check_placeholders(run: RunSpec, c: ml_collections.ConfigDict) -> None:
  """Refuses a data path or string override that still holds a placeholder."""
  values = {"data.paths": c.data.paths, **run.overrides}
  for key, value in values.items():
    found = isinstance(value, str) and PLACEHOLDER.search(value)
    if found:
      raise UserError(
        f"run {run.name}: {key}={value!r} still holds the placeholder {found.group(0)!r}; "
        "set it (e.g. the sweep's environment variable) before launching"
      )


def memory_signature(c: ml_collections.ConfigDict) -> str:
  """What sets the train step's bytes: the config without VALUE_KEYS, with the merge rule
  as its resolved structure (RULE_MATH left out)."""
  from moejax import config  # pylint: disable=import-outside-toplevel
  from moejax.nn import routing  # pylint: disable=import-outside-toplevel

  d = c.to_dict()
  for key in VALUE_KEYS:
    *path, last = key.split(".")
    node = d
    for part in path:
      node = node.get(part, {})
    node.pop(last, None)
  if c.model.moe_every > 0:
    rule = routing.rule_dict(config.merge_rule(c.model.moe))
    for field in (*rule, "rule"):
      d["model"]["moe"].pop(field, None)
    d["model"]["moe"]["resolved_rule"] = {k: v for k, v in rule.items() if k not in RULE_MATH}
  return json.dumps(d, sort_keys=True, default=str)


def check_fit(
  label: str, c: ml_collections.ConfigDict, accelerators: str, num_nodes: int, store=None
):
  """The one line describing the program of run `label` on its accelerator; raises a
  UserError naming the run when it does not compile, lower or fit. `store`: an
  `aot.cache.Store` of earlier compiles (None: compile)."""
  from moejax import aot  # pylint: disable=import-outside-toplevel
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  rc = resolve(c)
  topology = aot.topology_of_accelerator(accelerators)
  if topology is not None:
    if not aot.libtpu_available():
      return f"not checked: no libtpu here ({aot.TPU_INSTALL}) to compile for {topology}"
    target, flag = aot.tpu_target(topology), f"--topology {topology}"
    return _fit_line(label, rc, accelerators, target, flag, store)
  gpu = aot.gpu_of_accelerator(accelerators, num_nodes)
  if gpu is not None and aot.cuda_available():
    return _fit_line(label, rc, accelerators, aot.gpu_target(gpu), f"--gpu {gpu}", store)
  gpus = _gpu_count(accelerators) * num_nodes
  try:
    aot.export_gpu(rc, gpus)
  except UserError as e:
    raise UserError(f"run {label}: {e}") from None
  except Exception as e:  # noqa: BLE001  any lowering error refuses the run
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise UserError(f"run {label}: the train step does not lower for cuda: {first}") from None
  why = (
    f"no GPU compiler here ({aot.CUDA_INSTALL})"
    if gpu
    else f"no compile-only target for {accelerators} (known: {', '.join(_sky_gpus(aot))})"
  )
  return f"lowers for cuda on {gpus} GPUs; memory not checked: {why}"


def _sky_gpus(aot) -> list[str]:
  return [g.sky[0] for g in aot.GPUS.values()]


def _fit_line(label, rc, accelerators, target, flag, store) -> str:
  from moejax import aot  # pylint: disable=import-outside-toplevel

  fp = aot.footprint(rc, target, f"run {label}", store)
  need, have = fp.total / 2**30, target.hbm_bytes / 2**30
  if not fp.fits:
    raise UserError(
      f"run {label}: the train step needs {need:.2f} GiB per device on {accelerators} "
      f"({target.name}; temporaries {fp.temporaries / 2**30:.2f} GiB), over the {have:.2f} GiB "
      f"usable; see python -m moejax.describe --config CONFIG {flag}"
    )
  grows = sum(lp.grows for lp in fp.loops)
  loops = f", {len(fp.loops)} while loops ({grows} grow with rows)" if fp.loops else ""
  cached = "; compiled before, read from the cache" if fp.cached else ""
  return (
    f"fits {target.name}: {need:.2f} of {have:.2f} GiB per device (impl {fp.impl}{loops}){cached}"
  )


def _gpu_count(accelerators: str) -> int:
  """'H100:8' -> 8, 'A100' -> 1."""
  _, _, count = accelerators.partition(":")
  try:
    return int(count) if count else 1
  except ValueError:
    raise UserError(f"accelerators {accelerators!r}: use NAME or NAME:COUNT") from None


def _check(job: tuple) -> tuple[bool, str]:
  """(ok, line or error message) of one program; runs in a worker process."""
  from moejax.aot import cache  # pylint: disable=import-outside-toplevel

  label, config_dict, accelerators, num_nodes, (cache_dir, read) = job
  c = ml_collections.ConfigDict(config_dict)
  store = cache.Store(cache_dir, read) if cache_dir is not None else None
  try:
    return True, check_fit(label, c, accelerators, num_nodes, store)
  except UserError as e:
    return False, str(e)


# Cores one compile keeps busy, by compiler (`compile_threads`). XLA:TPU compiles in
# threads: the TPU preset's step took 72 CPU-s in 39 s of wall on a 2-core host, and two
# compiles at once there took 12-17 % more CPU-s and longer than one after the other
# (docs/cloud.md, "How long the precheck takes here"). XLA:GPU's compile of the GPU preset
# ran on under one core (16 CPU-s in 22 s). Measured on 2 cores only.
COMPILE_THREADS = {"tpu": 2, "cuda": 1}


def compile_threads(accelerators: str) -> int:
  """`COMPILE_THREADS` of the compiler that checks `accelerators` (a TPU slice or GPUs). A
  TPU name the topology refuses counts as TPU: its job reports the refusal, naming the run."""
  from moejax import aot  # pylint: disable=import-outside-toplevel

  try:
    tpu = aot.topology_of_accelerator(accelerators) is not None
  except UserError:
    tpu = True
  return COMPILE_THREADS["tpu" if tpu else "cuda"]


def default_workers(n_programs: int, threads: int) -> int:
  """One process per `threads` cores (`compile_threads`), at least one, at most one per
  program."""
  return max(1, min(n_programs, (os.cpu_count() or 1) // threads))


def check_runs(
  sweep: Sweep,
  runs: list[RunSpec],
  compute_of: Callable,
  log: Callable[[str], None] = print,
  workers: int = 0,
  per_run: bool = False,
  cache_dir: str | None = "",
  fresh: bool = False,
) -> None:
  """Every run's placeholders, then its program on its accelerator: one compile per memory
  signature (`per_run`: per run), distinct ones in `workers` processes (0: `default_workers`).
  Compiled answers are kept in `cache_dir` (an `aot.cache.Store`; "": its default
  directory; None: none) and read from it unless `fresh`. Raises a one-line UserError for
  the first run refused, in the sweep's order."""
  configs = {}
  for run in runs:
    try:
      configs[run.name] = run_config(sweep, run)
    except UserError as e:
      raise UserError(f"run {run.name}: {e}") from None
    check_placeholders(run, configs[run.name])
  key_of, jobs, store = {}, {}, (cache_dir, not fresh)
  for run in runs:
    compute = compute_of(run)
    c = configs[run.name]
    program = run.name if per_run else memory_signature(c)
    key = (compute.accelerators, compute.num_nodes, program)
    key_of[run.name] = key
    if key not in jobs:
      jobs[key] = (run.name, c.to_dict(), compute.accelerators, compute.num_nodes, store)
  threads = max((compile_threads(acc) for acc, _, _ in jobs), default=1)
  results = _run_jobs(jobs, workers or default_workers(len(jobs), threads), log)
  shared = {k: sum(1 for v in key_of.values() if v == k) for k in jobs}
  for run in runs:
    key = key_of[run.name]
    ok, text = results[key]
    if not ok:  # the first run of a program in the sweep's order: its error names it
      raise UserError(text)
    note = f"; one compile for {shared[key]} runs" if shared[key] > 1 else ""
    log(f"checked: {run.name}: {text}{note}")


def _run_jobs(jobs: dict, workers: int, log: Callable[[str], None] = print) -> dict:
  """{key: (ok, text)}: in this process for one program or one worker, else in `workers`
  spawned processes (a forked JAX is unsafe); logs each program as it is done."""
  start, out = time.monotonic(), {}

  def done(key, result):
    out[key] = result
    log(f"program {len(out)}/{len(jobs)} done: {jobs[key][0]} ({time.monotonic() - start:.0f} s)")

  if workers <= 1 or len(jobs) <= 1:
    for key, job in jobs.items():
      done(key, _check(job))
    return out
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
    futures = {pool.submit(_check, job): key for key, job in jobs.items()}
    for f in concurrent.futures.as_completed(futures):
      done(futures[f], f.result())
  return out
