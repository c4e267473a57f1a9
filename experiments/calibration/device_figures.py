"""The figures the device study's plan stands on (device_plan.py), each labelled with what
it is: measured, an estimate scaled from a measurement, or an allowance.

Before the device runs anything (`committed`, what `device_study.py --plan-only` prints):

* tokens/s: an estimate. The only committed step times at E = 64, K = 8 are the device
  benchmark's on one H200 (`benchmarks/results/accelerator_h200_*.json`, the `tokamax` rows
  at E/K/f 64/8/256 in the preset's layer layout: the command leaves `model.scan_layers` and
  `model.scan_unroll` at their defaults, or sets scan_layers=True), at d_model 1024 with a
  32k vocabulary. The lowest is scaled by model FLOPs per token (`moejax.sizing.flops`, the
  count the benchmark's TFLOPS column uses) to the preset's shape, i.e. at the same TFLOP/s.
  A narrower model's smaller matmuls usually reach fewer TFLOP/s, so this is optimistic;
  the probe measures the real rate on the device. For an H100, where nothing is
  committed, the H200's estimate is scaled by their HBM bandwidths (moejax/aot/gpu/*.txtpb;
  their bf16 peaks are equal), the slower of the two bounds.
* train-step compile: an estimate. The highest H200 compile of those rows (XLA's autotuning
  included) is scaled by the preset's deviceless XLA:GPU compile over the d_model 1024
  shape's (CPU seconds of lower + compile for a compile-only H200 with
  `benchmarks/aot_compile_time.py`, COMPILE_RESULT over D1024_RESULT, on the same host and day).
  The H100 gets the same figure: both are sm_90, with one compiler and autotuner.
* grid-forward compile over the train step's: measured deviceless (COMPILE_RESULT; a
  deviceless compile does not autotune, so the ratio carries over, not the seconds).
* a cached program's compile over a cold one: measured on this repository's CPU host
  (CACHE_RESULT, `benchmarks/compile_cache_hit.py` at the preset).
* startup, up to the probe's first step (imports, the accelerator's client, the held-out
  split, the probe's build: the process's first, which reads the corpus and compiles the
  initializers), and each arm's setup and final checkpoint (written and read back):
  allowances. This repository's 2-core CPU host, shared, took 18 and 28 s to the probe's
  first step in two tiny CPU runs (tests/test_device_study.py's shape; `log.txt`'s probe
  line: its start plus its setup).

On the device (`measured`): tokens/s and the train-step compile are the probe's
(device_probe.py) and the startup is the seconds already spent; the two ratios stay the
committed ones and the two per-arm allowances stay allowances (the probe's setup is the
process's first, which compiles the initializers and reads the corpus cold: not an arm's).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import NamedTuple

from moejax.config import RunConfig
from moejax.sizing import flops, worksheet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "benchmarks", "results")
GPU_SPECS = os.path.join(REPO, "moejax", "aot", "gpu")
THROUGHPUT_GLOB = "accelerator_h200_*.json"
MEASURED_SHAPE, KERNEL = "64/8/256", "tokamax"
OTHER_LAYOUTS = re.compile(r"model\.scan_layers=False|model\.scan_unroll=")  # not the preset's
COMPILE_RESULT = "device_study_compile_h200_1.json"
D1024_RESULT = "device_study_compile_h200_1_d1024.json"
CACHE_RESULT = "compile_cache_hit.json"
SPECS = {"h200": "h200_sxm.txtpb", "h100": "h100_sxm.txtpb"}
STARTUP_S = 30.0  # allowance: from the start to the probe's first step (module docstring)
CHECKPOINT_S = 5.0  # allowance: the final checkpoint written and read back
SETUP_S = 5.0  # allowance: an arm's data and initial state
MEASURED, ESTIMATE, ALLOWANCE = "measured", "estimate", "allowance"


class Unsupported(ValueError):
  """The committed figures cannot support a plan (which file or row is missing)."""


class Figure(NamedTuple):
  value: float
  kind: str  # MEASURED | ESTIMATE | ALLOWANCE
  source: str  # where it comes from, in a line


CHECKPOINT = Figure(CHECKPOINT_S, ALLOWANCE, "the final checkpoint written and read back")


class Figures(NamedTuple):
  where: str  # what the figures describe, e.g. "h100, from the committed figures"
  tokens_per_s: Figure
  train_compile_s: Figure
  forward_over_train: Figure
  warm_over_cold: Figure
  startup_s: Figure
  setup_s: Figure  # per arm, and the probe's
  checkpoint_s: Figure  # per arm

  def lines(self) -> list[str]:
    names = {
      "tokens_per_s": "tokens/s",
      "train_compile_s": "train-step compile s",
      "forward_over_train": "grid forward / train compile",
      "warm_over_cold": "cached / cold compile",
      "startup_s": "startup s",
      "setup_s": "setup s (per arm)",
      "checkpoint_s": "checkpoint s (per arm)",
    }
    out = []
    for field, name in names.items():
      f = getattr(self, field)
      value = f"{f.value:,.0f}" if f.value >= 100 else f"{f.value:.3g}"
      out.append(f"  {name:<29}{value:>10}  {f.kind}: {f.source}")
    return out


def _load(name: str, results: str) -> dict:
  path = os.path.join(results, name)
  if not os.path.exists(path):
    raise Unsupported(f"{path} is missing")
  with open(path) as f:
    return json.load(f)


def h200_rows(results: str = RESULTS) -> tuple[list[dict], tuple[str, ...]]:
  """The committed H200 rows at MEASURED_SHAPE with KERNEL in the preset's layout."""
  rows, files = [], []
  for path in sorted(glob.glob(os.path.join(results, THROUGHPUT_GLOB))):
    with open(path) as f:
      result = json.load(f)
    if OTHER_LAYOUTS.search(result.get("command", "")):
      continue
    hits = [
      r
      for r in result["figures"]["rows"]
      if r.get("E/K/f") == MEASURED_SHAPE and r.get("impl") == KERNEL
      and r.get("tokens_per_s") and r.get("compile_s") and r.get("tflops_per_device")
    ]  # fmt: skip
    if hits:
      rows += hits
      files.append(os.path.basename(path))
  if not rows:
    raise Unsupported(f"no committed H200 {KERNEL} row at E/K/f {MEASURED_SHAPE} in {results}")
  return rows, tuple(files)


def flops_per_token(rc: RunConfig) -> float:
  """Training FLOPs per token of the config (its vocabulary resolved as `describe` does)."""
  rc = rc.with_vocab(worksheet.nominal_vocab(rc)[0])
  return flops.training_flops_per_token(rc.model, rc.data.seq_len).at()


def bandwidth(device: str) -> float:
  """HBM bytes/s of a device key (SPECS) from its compile-only target file."""
  with open(os.path.join(GPU_SPECS, SPECS[device])) as f:
    return float(re.search(r"memory_bandwidth:\s*(\d+)", f.read()).group(1))


def compile_scale(results: str = RESULTS) -> tuple[float, float, float]:
  """(scale, preset CPU-s, d_model 1024 CPU-s): the deviceless lower + compile seconds."""
  seconds = []
  for name in (COMPILE_RESULT, D1024_RESULT):
    row = _load(name, results)["figures"]["rows"][0]
    seconds.append(row["lower_cpu_s"] + row["compile_cpu_s"])
  return seconds[0] / seconds[1], seconds[0], seconds[1]


def ratios(results: str = RESULTS) -> tuple[Figure, Figure]:
  """(grid forward over train step, cached over cold): the two compile ratios."""
  row = _load(COMPILE_RESULT, results)["figures"]["rows"][0]
  fwd = Figure(
    float(row["grid_forward_over_train_step"]),
    MEASURED,
    f"deviceless XLA:GPU CPU seconds, one k1's grid forward over the train step ({COMPILE_RESULT})",
  )
  warm = _load(CACHE_RESULT, results)["figures"]["warm_over_cold"]
  cache = Figure(
    float(warm),
    MEASURED,
    f"the preset's programs read back from the cache, CPU host ({CACHE_RESULT})",
  )
  return fwd, cache


def committed(rc: RunConfig, device: str, results: str = RESULTS) -> Figures:
  """The figures for `device` (a SPECS key) from the committed results alone; Unsupported
  when a file or row they need is missing."""
  if device not in SPECS:
    raise Unsupported(f"no committed figures for {device!r}; there are for {sorted(SPECS)}")
  rows, files = h200_rows(results)
  slow = min(rows, key=lambda r: r["tokens_per_s"])
  measured_flops = slow["tflops_per_device"] * 1e12 / slow["tokens_per_s"]
  preset_flops = flops_per_token(rc)
  rate = slow["tokens_per_s"] * measured_flops / preset_flops
  source = (
    f"the H200's lowest measured {slow['tokens_per_s']:,.0f} tokens/s at d_model 1024, "
    f"E/K/f {MEASURED_SHAPE} ({measured_flops / 1e6:.0f} MFLOP/token; {', '.join(files)}) "
    f"scaled to this shape's {preset_flops / 1e6:.1f} MFLOP/token"
  )
  if device != "h200":
    ratio = bandwidth(device) / bandwidth("h200")
    rate *= ratio
    source += f", x {ratio:.3f} ({device} over H200 HBM bandwidth; equal bf16 peaks)"
  scale, cpu_preset, cpu_1024 = compile_scale(results)
  top = max(float(r["compile_s"]) for r in rows)
  compile_src = (
    f"the H200's highest measured train-step compile at d_model 1024, {top:.1f} s, x {scale:.3f} "
    f"(this shape's deviceless compile {cpu_preset:.1f} CPU-s over d_model 1024's {cpu_1024:.1f}; "
    f"{COMPILE_RESULT}, {D1024_RESULT})"
  )
  fwd, cache = ratios(results)
  return Figures(
    f"{device}, from the committed figures",
    Figure(rate, ESTIMATE, source),
    Figure(top * scale, ESTIMATE, compile_src),
    fwd,
    cache,
    Figure(STARTUP_S, ALLOWANCE, "to the probe's first step: imports, client, corpus, its build"),
    Figure(SETUP_S, ALLOWANCE, "a run's data and initial state"),
    CHECKPOINT,
  )


def measured(probe, device_kind: str, elapsed_s: float, results: str = RESULTS) -> Figures:
  """The probe's rate and compile (device_probe.Probe), the seconds spent, the committed
  compile ratios."""
  fwd, cache = ratios(results)
  return Figures(
    f"{device_kind}, from the probe's steps on it",
    Figure(
      probe.tokens_per_s, MEASURED, f"the probe: {probe.steps} steps of the first arm's train step"
    ),
    Figure(probe.compile_s, MEASURED, "the probe: its first step (trace, lower, compile, run)"),
    fwd,
    cache,
    Figure(elapsed_s, MEASURED, "seconds from the start to this plan, the probe's included"),
    Figure(
      SETUP_S,
      ALLOWANCE,
      f"a run's data and initial state (the probe's, the process's first, took {probe.setup_s:.1f} s)",
    ),
    CHECKPOINT,
  )
