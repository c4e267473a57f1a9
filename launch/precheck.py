"""What a sky sweep must pass before anything is launched (dry run or not).

* No placeholder is left in a run's data path or any string override (the TPU sweep's
  `gs://YOUR_BUCKET/...` is refused, naming the run and the key).
* The run's train step is built for its accelerator the way `moejax.aot` builds it: on a
  TPU, compiled ahead of time for the slice's topology (`tpu-v5e-16` -> `v5e:4x4`) and
  refused when it does not compile or its per-device bytes exceed the chip's HBM; on GPUs,
  exported for ("cuda",) on an abstract mesh of all the job's GPUs, refused when it does not
  lower (no fit check: the GPU's memory is not known from its name).

Runs whose configs differ only in `train.seed` or `wandb.*` build the same program, so it
is compiled once for all of them. Without libtpu (the `tpu` extra) the TPU compile cannot
run: each TPU run is then listed as not checked, and nothing is refused for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import ml_collections

from launch import commands
from launch.spec import RunSpec, Sweep
from moejax.errors import UserError

PLACEHOLDER = re.compile(r"YOUR_[A-Z_]+|<[A-Za-z_ -]+>|CHANGE_?ME")


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


def _program_key(c: ml_collections.ConfigDict) -> str:
  d = c.to_dict()
  d.pop("wandb", None)
  d["train"].pop("seed", None)
  return json.dumps(d, sort_keys=True, default=str)


def check_fit(run: RunSpec, c: ml_collections.ConfigDict, accelerators: str, num_nodes: int):
  """The one line describing the run's program on its accelerator; raises a UserError
  naming the run when it does not compile, lower or fit."""
  from moejax import aot  # pylint: disable=import-outside-toplevel

  topology = aot.topology_of_accelerator(accelerators)
  if topology is not None:
    if not aot.libtpu_available():
      return f"not checked: no libtpu here (pip install -e '.[tpu]') to compile for {topology}"
    fp = aot.footprint(c, aot.tpu_target(topology), f"run {run.name}")
    need, have = fp.total / 2**30, fp.target.hbm_bytes / 2**30
    if not fp.fits:
      raise UserError(
        f"run {run.name}: the train step needs {need:.2f} GiB per device on {accelerators} "
        f"({topology}; temporaries {fp.temporaries / 2**30:.2f} GiB), over the {have:.2f} GiB "
        f"HBM; see python -m moejax.describe --config {run.config} --topology {topology}"
      )
    return f"fits {topology}: {need:.2f} of {have:.2f} GiB per device (impl {fp.impl})"
  gpus = _gpu_count(accelerators) * num_nodes
  try:
    aot.export_gpu(c, gpus)
  except UserError as e:
    raise UserError(f"run {run.name}: {e}") from None
  except Exception as e:  # noqa: BLE001  any lowering error refuses the run
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise UserError(f"run {run.name}: the train step does not lower for cuda: {first}") from None
  return f"lowers for cuda on {gpus} GPUs (memory not checked: see moejax.describe --devices)"


def _gpu_count(accelerators: str) -> int:
  """'H100:8' -> 8, 'A100' -> 1."""
  _, _, count = accelerators.partition(":")
  try:
    return int(count) if count else 1
  except ValueError:
    raise UserError(f"accelerators {accelerators!r}: use NAME or NAME:COUNT") from None


def check_runs(
  sweep: Sweep, runs: list[RunSpec], compute_of: Callable, log: Callable[[str], None] = print
) -> None:
  """Every run's placeholders, then its program on its accelerator (one compile per
  distinct program); raises a one-line UserError for the first run refused."""
  configs = {}
  for run in runs:
    try:
      configs[run.name] = run_config(sweep, run)
    except UserError as e:
      raise UserError(f"run {run.name}: {e}") from None
    check_placeholders(run, configs[run.name])
  done: dict[tuple, str] = {}
  for run in runs:
    compute = compute_of(run)
    key = (compute.accelerators, compute.num_nodes, _program_key(configs[run.name]))
    if key not in done:
      done[key] = check_fit(run, configs[run.name], compute.accelerators, compute.num_nodes)
    log(f"checked: {run.name}: {done[key]}")
