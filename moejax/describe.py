"""The seed-004 worksheet of any config: what the model is, with its parameters counted.

`worksheet(c, vocab_size)` builds the real `moejax.nn.model.Transformer` with shapes only
(`build.abstract_params`: nothing is allocated, so a 671B model takes seconds) and groups its
parameter leaves by path, each counted by `build.param_count` (the trainer's count is their
sum); `format_worksheet` renders it as text. The trainer stores `to_dict()` under
`resolved.worksheet` in config.json and the wandb config.

    python -m moejax.describe --config configs/full/mixtral.py [--config.a.b=v] [--json]
    python -m moejax.describe --config C --topology v5e:4x4   # TPU (the tpu extra)
    python -m moejax.describe --config C --gpu h100:8         # GPUs (the cuda extra)
    python -m moejax.describe --config C --fit tpu-v5e        # the smallest slice that fits
    python -m moejax.describe --keys [SECTION]                 # every config key (docs/config.md)

`--topology` / `--gpu` add the fit table (`format_fit`): the train step compiled ahead of
time for the target's compile-only devices by `moejax.aot`, its per-device bytes and whether
they fit the device's memory, then the compiled step's while loops (`aot.loops`). `--fit
FAMILY` (`aot.fit.FAMILIES`: tpu-v5e, tpu-v6e, a100, h100, h200, b200) tries the family's
sizes from the smallest, one table row each, and prints the fit table of the first that fits
(`fit_search`; the mesh rule and the lower bound that skips compiles: `moejax.aot.fit`).

Counting convention: every `nnx.Param` leaf is counted once, in exactly one group (an
unknown path is an error, so nothing goes uncounted). "Active" is what one token reads at
k1 = K: every group whole, routed experts at K/E. The embedding table and the LM head count
whole in both columns; published counts differ only in which of them they include, so three
conventions are reported (see `CONVENTIONS`).
"""

from __future__ import annotations

import functools
import os
import sys

from moejax import aot, sharding
from moejax.config import table
from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.sizing.worksheet import (  # noqa: F401  (public: describe.worksheet and friends)
  count_groups,
  format_worksheet,
  group_of,
  nominal_vocab,
  worksheet,
)
from moejax.config.reader import resolve


def _gib(n: int) -> str:
  """Bytes as GiB, MiB below 1 GiB, KiB below 1 MiB."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:9.2f} {unit}"
  return f"{n / 2**10:9.2f} KiB"


_COMPILER = {"tpu": "TPU compiler", "cuda": "GPU compiler (XLA:GPU)"}


def format_fit(fp, rc: RunConfig, grid=None) -> str:
  """Per-device bytes of the compiled train step on a target (a `moejax.aot.Footprint`),
  whether they fit its memory, and the step's while loops; `grid`: the k-grid forward's
  bytes on one device."""
  t = fp.target
  sizes = sharding.mesh_shape(rc.mesh, t.n_devices)
  mesh = ", ".join(f"{a} {n}" for a, n in zip(sharding.AXES, sizes))
  compiler = _COMPILER[t.platform]
  how = f"{compiler}: memory_analysis()"
  if fp.refused:
    how = f"{compiler}'s RESOURCE_EXHAUSTED (in 0.01 GiB)"
  rows = [
    ("parameters", fp.params, "exact, from the shardings"),
    ("optimizer state", fp.opt_state, "exact, from the shardings"),
    ("router state", fp.router, "exact, from the shardings"),
    ("batch", fp.batch, "exact, from the shardings"),
    ("arguments", fp.arguments, "state, batch and rng" + ("" if fp.refused else " (compiler)")),
    ("outputs", fp.outputs - fp.aliased, "beyond those written into donated arguments"),
    ("temporaries", fp.temporaries, how),
    (
      "code",
      fp.code,
      "generated code" + (" (XLA:GPU reports none)" if t.platform == "cuda" else ""),
    ),
    ("total", fp.total, "arguments + outputs + temporaries + code"),
  ]
  lines = [
    f"fit: {t.name} ({t.n_devices} devices, {t.hbm_bytes / 2**30:.2f} GiB usable each:",
    f"  {t.hbm_source})",
    f"  train step per device: impl {fp.impl}, mesh {mesh}, grad_accum {rc.train.grad_accum},",
    (
      f"  batch {rc.data.batch_size} x {rc.data.seq_len} tokens, dtype {rc.model.dtype}, "
      f"remat {rc.model.remat}, attention {rc.model.attention}"
    ),
  ]
  lines += [f"    {name:<16}{_gib(n)}  {note}" for name, n, note in rows]
  if grid is not None:
    lines.append(
      f"    {'k-grid forward':<16}{_gib(grid.temp_size_in_bytes)}  temporaries on one device, "
      f"eval.batch_size {rc.eval.batch_size}, beside {_gib(grid.argument_size_in_bytes).strip()}"
    )
  verdict = "fits" if fp.fits else "DOES NOT FIT"
  lines.append(
    f"  {verdict}: {fp.total / 2**30:.2f} GiB of {t.hbm_bytes / 2**30:.2f} GiB per device"
  )
  if not fp.refused:
    lines += aot.format_loops(fp.loops)
    if t.platform == "cuda":
      lines.append("  step time: not estimated (XLA:GPU exposes no cost analysis for this compile)")
  return "\n".join(lines)


def resolve_target(topology: str = "", gpu: str = "", fit: str = ""):
  """The `moejax.aot.Target` of `--topology` or `--gpu`, or the `aot.fit.Family` of
  `--fit` (refused before anything compiles)."""
  given = [f"--{k}" for k, v in (("topology", topology), ("gpu", gpu), ("fit", fit)) if v]
  if len(given) > 1:
    raise UserError(f"{' and '.join(given)} exclude each other; give one target")
  if fit:
    return aot.fit.check(fit)
  return aot.tpu_target(topology) if topology else aot.gpu_target(gpu)


def fit(rc: RunConfig, topology: str = "", gpu: str = "") -> str:
  """The fit table of `c` on a TPU topology ('v5e:4x4') or on GPU nodes ('h100:8')."""
  return fit_on(rc, resolve_target(topology, gpu))


def fit_on(rc: RunConfig, target) -> str:
  """The fit table of `c` on a `moejax.aot.Target`."""
  fp = aot.footprint(rc, target, "--config")
  grid = None
  if rc.moe is not None:
    grid = _grid_memory(aot, rc, target)
  return format_fit(fp, rc, grid)


def fit_search(rc: RunConfig, family: str, out=print) -> list:
  """`--fit FAMILY`: the table of each size tried (`aot.fit.search`), each row passed to
  `out` as soon as it is known, then the smallest fit and its fit table. Returns the
  `aot.fit.Tried` rows."""
  out(aot.fit.format_intro(rc, family))
  tried = []
  for row in aot.fit.search(rc, family):
    tried.append(row)
    out(aot.fit.format_row(row))
  out(aot.fit.format_summary(tried, family))
  detail = aot.fit.shown(tried)
  if detail is not None:
    if not detail.fits:
      out(f"the largest size compiled, {detail.name}:")
    out(format_fit(detail.footprint, detail.config))
  return tried


def _grid_memory(aot, rc: RunConfig, target):
  """The grid forward's memory_analysis, or None when it does not compile on one device."""
  try:
    return aot.grid_forward(rc, target).memory_analysis()
  except Exception:  # noqa: BLE001  (an OOM on one chip: reported as absent)
    return None


def keys_section(argv: list[str]) -> str | None:
  """`--keys [SECTION]` (or `--keys=SECTION`): the section to list ('' all), else None."""
  for i, arg in enumerate(argv):
    if arg == "--keys":
      following = argv[i + 1] if i + 1 < len(argv) else ""
      return "" if following.startswith("-") else following
    if arg.startswith("--keys="):
      return arg.split("=", 1)[1]
  return None


def host_backend_cpu() -> None:
  """The deviceless compiles run on a CPU host backend (`moejax.aot`), as `launch.sweep`'s
  precheck sets: without it, JAX's CUDA plugin (the cuda extra) initializes its backend by
  calling cuInit, which fails on a host without a GPU driver (error 303) and leaves the
  plugin unregistered, so `--gpu` was refused ("topology not implemented for cuda"). An
  explicit JAX_PLATFORMS is left as it is."""
  if "JAX_PLATFORMS" not in os.environ:
    import jax  # pylint: disable=import-outside-toplevel

    jax.config.update("jax_platforms", "cpu")


def main(argv: list[str]) -> int:
  section = keys_section(argv[1:])
  if section is not None:  # the keys' table needs no config
    print(table.terminal(section))
    return 0
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  from moejax import cli  # pylint: disable=import-outside-toplevel

  config = config_flags.DEFINE_config_file("config", None, "A get_config() file (configs/*.py).")
  as_json = flags.DEFINE_bool("json", False, "Print the worksheet as JSON (config.json's form).")
  topology = flags.DEFINE_string(
    "topology", "", "TPU topology to compile the train step for, e.g. v5e:4x4 (needs libtpu)."
  )
  gpu = flags.DEFINE_string(
    "gpu", "", "GPU nodes to compile the train step for, e.g. h100:8 or h100:2x8 (the cuda extra)."
  )
  fit_family = flags.DEFINE_string(
    "fit",
    "",
    f"Accelerator family whose smallest slice the train step fits: {', '.join(aot.fit.FAMILIES)}.",
  )
  cli.parse_flags(argv, config, example="configs/full/mixtral.py")
  rc = resolve(config.value)
  targets = (topology.value, gpu.value, fit_family.value)
  if any(targets):
    host_backend_cpu()
  where = resolve_target(*targets) if any(targets) else None
  vocab, note = nominal_vocab(rc)
  ws = worksheet(rc.with_vocab(vocab))
  if as_json.value:
    import json  # pylint: disable=import-outside-toplevel

    print(json.dumps(ws.to_dict(), indent=2))
  else:
    print(format_worksheet(ws, cli.config_path(argv) or ""))
    if note:
      print(note)
  if fit_family.value:
    fit_search(rc, fit_family.value, functools.partial(print, flush=True))
  elif where is not None:
    print(fit_on(rc, where))
  return 0


if __name__ == "__main__":
  from moejax import cli as _cli

  _cli.run_main(lambda: main(sys.argv))
