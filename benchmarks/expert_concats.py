"""Concatenates of expert weights in a preset's compiled train step, and its bytes per device,
for a source tree (this one, or an older checkout for the before/after of issue 50's
`experts.w_gate_up`).

    JAX_PLATFORMS=cpu python benchmarks/expert_concats.py \
        --config configs/study_calibration.py:gpu --gpu h100:8 \
        [--tree before=/path/to/older/checkout --tree after=.] [--result NAME]

It runs that tree's `python -m moejax.describe` (a public command, the same on both sides)
with XLA's HLO dump on, then reads the train step's HLO before XLA's passes (what the model
asked for) and after them (what the device runs). A concatenate counts as one of expert
weights when it joins two arrays into a result whose last two dimensions are (d, 2f), with d
a shard of d_model and f a shard of d_expert (or d_shared) at most `devices`-way: gate and up
joined at run time. (XLA's own horizontal fusion of the attention's q, k and v projections
inside a GEMM joins three.) The bytes are describe's per-device line (the compiler's memory analysis) and, where the
compiler writes a memory-usage report (XLA:GPU), its buffer assignment's total. Nothing
here is timed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from common import write_result

from moejax import cli
from moejax.config import resolve

HERE = Path(__file__).resolve().parent
CONCAT = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+concatenate\(([^)]*)\)")


class Dims(NamedTuple):
  d_model: int
  widths: tuple[int, ...]  # d_expert, and d_shared where there is a shared expert
  devices: int


def shards(n: int, devices: int) -> set[int]:
  """n split k ways for every k up to `devices` that divides it."""
  return {n // k for k in range(1, devices + 1) if n % k == 0}


def device_count(spec: str) -> int:
  """Devices of a target spec: `h100:8` 8, `h100:2x8` 16, `v5e:4x4` 16."""
  n = 1
  for v in spec.split(":")[-1].split("x"):
    n *= int(v)
  return n


def is_expert_concat(shape: tuple[int, ...], dims: Dims) -> bool:
  """Whether a concatenate's result is shaped like gate and up joined: [..., d, 2f]."""
  if len(shape) < 2:
    return False
  d, two_f = shape[-2], shape[-1]
  fs = set().union(*(shards(w, dims.devices) for w in dims.widths))
  return d in shards(dims.d_model, dims.devices) and two_f % 2 == 0 and two_f // 2 in fs


def expert_concats(hlo: str, dims: Dims) -> list[str]:
  """Every expert-weight concatenate's result shape in an HLO text, as `f32[8,64,256]`."""
  found = []
  for dtype, text, operands in CONCAT.findall(hlo):
    shape = tuple(int(v) for v in text.split(",") if v)
    if operands.count(",") == 1 and is_expert_concat(shape, dims):
      found.append(f"{dtype}[{text}]")
  return found


def step_module(dump: Path, suffix: str) -> Path:
  """The train step's module file (`jit_traced`, the largest when several match)."""
  files = sorted(dump.glob(f"*jit_traced*{suffix}"), key=lambda p: p.stat().st_size)
  if not files:
    sys.exit(f"error: no train step module (*jit_traced*{suffix}) in {dump}")
  return files[-1]


def describe(tree: Path, argv: list[str], dump: Path) -> str:
  env = {
    **os.environ,
    "PYTHONPATH": str(tree),
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
  }
  cmd = [sys.executable, "-m", "moejax.describe", *argv]
  out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
  if out.returncode:
    sys.exit(f"error: describe failed in {tree}:\n{out.stderr[-3000:]}")
  return out.stdout


TOTAL = re.compile(r"Total bytes: (\d+)")


def buffer_bytes(dump: Path) -> int | None:
  """The step's bytes in XLA's buffer assignment (its memory-usage report, where the compiler
  writes one: XLA:GPU does), exact to the byte."""
  files = sorted(dump.glob("*jit_traced*memory-usage-report.txt"), key=lambda p: p.stat().st_size)
  found = TOTAL.search(files[-1].read_text()) if files else None
  return int(found.group(1)) if found else None


def per_device(text: str) -> str:
  """describe's per-device memory line."""
  lines = [ln.strip() for ln in text.splitlines() if "per device" in ln and "GiB" in ln]
  return lines[0] if lines else "?"


def measure(label: str, tree: Path, argv: list[str], dims: Dims) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = describe(tree, argv, Path(tmp))
    before = expert_concats(step_module(Path(tmp), "before_optimizations.txt").read_text(), dims)
    after = expert_concats(step_module(Path(tmp), "after_optimizations.txt").read_text(), dims)
    total = buffer_bytes(Path(tmp))
  git = ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"]
  commit = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()
  row = {
    "tree": label,
    "commit": commit,
    "expert_concats_before_passes": len(before),
    "expert_concats_after_passes": len(after),
    "shapes": " ".join(sorted(set(before + after))) or "-",
    "per_device": per_device(out),
    "buffer_bytes": total,
  }
  print(row)
  return row


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--gpu", help="a GPU target such as h100:8")
  p.add_argument("--topology", help="a TPU topology such as v5e:4x4")
  p.add_argument(
    "--tree", action="append", default=[], help="LABEL=PATH, repeatable (default: this tree)"
  )
  p.add_argument("--result", default="", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  if bool(args.gpu) == bool(args.topology):
    p.error("give one of --gpu and --topology")
  trees = [t.split("=", 1) for t in args.tree] or [["this", str(HERE.parent)]]
  target = ["--gpu", args.gpu] if args.gpu else ["--topology", args.topology]
  argv = ["--config", args.config, *target]
  rc = resolve(cli.load_file(args.config))
  moe = rc.model.moe
  widths = tuple(w for w in (moe.d_expert, moe.d_shared) if w)
  dims = Dims(rc.model.d_model, widths, device_count(target[1]))
  rows = [measure(label, Path(path).resolve(), argv, dims) for label, path in trees]
  if args.result:
    write_result(args.result, {"config": args.config, "target": target[1], "rows": rows})


if __name__ == "__main__":
  main()
