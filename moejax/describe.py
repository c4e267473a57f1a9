"""The seed-004 worksheet of any config: what the model is, with its parameters counted.

`worksheet(c, vocab_size)` builds the real `moejax.nn.model.Transformer` with shapes only
(`build.abstract_params`: nothing is allocated, so a 671B model takes seconds) and groups its
parameter leaves by path, each counted by `build.param_count` (the trainer's count is their
sum); `format_worksheet` renders it as text. The trainer stores `to_dict()` under
`resolved.worksheet` in config.json and the wandb config.

    python -m moejax.describe --config configs/full/mixtral.py [--config.a.b=v] [--json]
    python -m moejax.describe --config C --topology v5e:4x4     # TPU: compiled, sized
    python -m moejax.describe --config C --devices 8 --hbm 80   # GPUs: state exact, rest estimated

`--topology` / `--devices` add the fit table (`format_fit`): the train step compiled ahead
of time for the target by `moejax.aot`, its per-device bytes and whether they fit the HBM.

Counting convention: every `nnx.Param` leaf is counted once, in exactly one group (an
unknown path is an error, so nothing goes uncounted). "Active" is what one token reads at
k1 = K: every group whole, routed experts at K/E. The embedding table and the LM head count
whole in both columns; published counts differ only in which of them they include, so three
conventions are reported (see `CONVENTIONS`).
"""

from __future__ import annotations

import math
import sys

import ml_collections

from moejax import aot, sharding
from moejax import config as config_lib
from moejax.errors import UserError
from moejax.sizing.worksheet import (  # noqa: F401  (public: describe.worksheet and friends)
  count_groups,
  format_worksheet,
  group_of,
  nominal_vocab,
  worksheet,
)


def _gib(n: int) -> str:
  """Bytes as GiB, MiB below 1 GiB, KiB below 1 MiB."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:9.2f} {unit}"
  return f"{n / 2**10:9.2f} KiB"


def format_fit(fp, c: ml_collections.ConfigDict, grid=None) -> str:
  """Per-device bytes of the compiled train step on a target (a `moejax.aot.Footprint`),
  and whether they fit its HBM; `grid`: the k-grid forward's bytes on one device."""
  t = fp.target
  sizes = sharding.mesh_shape(c.mesh, t.n_devices)
  mesh = ", ".join(f"{a} {n}" for a, n in zip(sharding.AXES, sizes))
  compiled = t.platform == "tpu" and not fp.refused
  how = "TPU compiler: memory_analysis()"
  if fp.refused:
    how = "TPU compiler's RESOURCE_EXHAUSTED (in 0.01 GiB)"
  if fp.estimate:
    share = c.data.batch_size // math.prod(sizes[:2])
    how = f"ESTIMATE: CPU compile of one device's {share} rows"
  rows = [
    ("parameters", fp.params, "exact, from the shardings"),
    ("optimizer state", fp.opt_state, "exact, from the shardings"),
    ("router state", fp.router, "exact, from the shardings"),
    ("batch", fp.batch, "exact, from the shardings"),
    ("arguments", fp.arguments, "state, batch and rng" + (" (compiler)" if compiled else "")),
    ("outputs", fp.outputs - fp.aliased, "beyond those written into donated arguments"),
    ("temporaries", fp.temporaries, how),
    ("code", fp.code, "generated code" if t.platform == "tpu" else "not counted"),
    ("total", fp.total, "arguments + outputs + temporaries + code"),
  ]
  lines = [
    (
      f"fit: {t.name} ({t.n_devices} devices, {t.hbm_bytes / 2**30:.2f} GiB usable HBM each: "
      f"{t.hbm_source})"
    ),
    f"  train step per device: impl {fp.impl}, mesh {mesh}, grad_accum {c.train.grad_accum},",
    f"  batch {c.data.batch_size} x {c.data.seq_len} tokens, dtype {c.model.dtype}",
  ]
  lines += [f"    {name:<16}{_gib(n)}  {note}" for name, n, note in rows]
  if grid is not None:
    lines.append(
      f"    {'k-grid forward':<16}{_gib(grid.temp_size_in_bytes)}  temporaries on one device, "
      f"eval.batch_size {c.eval.batch_size}, beside {_gib(grid.argument_size_in_bytes).strip()}"
    )
  verdict = "fits" if fp.fits else "DOES NOT FIT"
  label = " (estimate)" if fp.estimate else ""
  lines.append(
    f"  {verdict}{label}: {fp.total / 2**30:.2f} GiB of {t.hbm_bytes / 2**30:.2f} GiB per device"
  )
  return "\n".join(lines)


def fit(c: ml_collections.ConfigDict, topology: str, devices: int, hbm_gib: float) -> str:
  """The fit table of `c` on a TPU topology, or on `devices` GPUs of `hbm_gib` each."""

  if topology and devices:
    raise UserError("--topology and --devices exclude each other; give one target")
  if devices and not hbm_gib:
    raise UserError("--devices needs --hbm, the GPU memory in GiB (e.g. --hbm 80)")
  target = aot.tpu_target(topology) if topology else aot.gpu_target(devices, hbm_gib)
  fp = aot.footprint(c, target, "--config")
  grid = None
  if target.platform == "tpu" and c.model.moe_every > 0:
    grid = _grid_memory(aot, c, target)
  return format_fit(fp, c, grid)


def _grid_memory(aot, c, target):
  """The grid forward's memory_analysis, or None when it does not compile on one device."""
  try:
    return aot.grid_forward(c, target).memory_analysis()
  except Exception:  # noqa: BLE001  (an OOM on one chip: reported as absent)
    return None


def main(argv: list[str]) -> int:
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  from moejax import cli  # pylint: disable=import-outside-toplevel

  config = config_flags.DEFINE_config_file("config", None, "A get_config() file (configs/*.py).")
  as_json = flags.DEFINE_bool("json", False, "Print the worksheet as JSON (config.json's form).")
  topology = flags.DEFINE_string(
    "topology", "", "TPU topology to compile the train step for, e.g. v5e:4x4 (needs libtpu)."
  )
  devices = flags.DEFINE_integer("devices", 0, "GPUs to size the train step for (with --hbm).")
  hbm = flags.DEFINE_float("hbm", 0.0, "Memory per GPU in GiB, with --devices (e.g. 80).")
  cli.parse_flags(argv, config, example="configs/full/mixtral.py")
  config_lib.validate(config.value)
  vocab, note = nominal_vocab(config.value)
  ws = worksheet(config.value, vocab)
  if as_json.value:
    import json  # pylint: disable=import-outside-toplevel

    print(json.dumps(ws.to_dict(), indent=2))
  else:
    print(format_worksheet(ws, cli.config_path(argv) or ""))
    if note:
      print(note)
  if topology.value or devices.value:
    print(fit(config.value, topology.value, devices.value, hbm.value))
  return 0


if __name__ == "__main__":
  from moejax import cli as _cli

  _cli.run_main(lambda: main(sys.argv))
