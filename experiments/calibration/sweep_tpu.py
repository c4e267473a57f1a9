"""The calibration study at the TPU preset: the same runs and factors as `sweep.py`, on
`configs/study_calibration.py:tpu`, each as a SkyPilot managed job on spot TPU v5e-16.

    python -m launch.sweep experiments/calibration/sweep_tpu.py --backend sky \
        --root gs://BUCKET/moejax [--dry-run]

`DATA` must name the training text (text, JSONL or ArrayRecord files, e.g. on gs://); set
MOEJAX_CALIBRATION_DATA before launching. Every run trains on its prepared copy, `PREPARED`
(MOEJAX_CALIBRATION_PREPARED, default `prepared-bpe32k-seq1024/` beside the data): the sky
backend's first job, `prepare.yaml`, tokenizes it once for the whole sweep

    python -m moejax.prepare --config configs/study_calibration.py:tpu \
        --out "$MOEJAX_CALIBRATION_PREPARED" --config.data.paths="$MOEJAX_CALIBRATION_DATA"

and the runs read its shards (`data.prepared`) instead of tokenizing 1.05B tokens each.
"""

import dataclasses
import os
import pathlib
import posixpath
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sweep as cpu_sweep

from launch.spec import Sweep

DATA = os.environ.get("MOEJAX_CALIBRATION_DATA", "gs://YOUR_BUCKET/corpus/*.jsonl")
PREPARED = os.environ.get(
  "MOEJAX_CALIBRATION_PREPARED", posixpath.join(posixpath.dirname(DATA), "prepared-bpe32k-seq1024")
)
TPU_STEPS = 4000  # configs/study_calibration.py:tpu train.steps (checkpoints every 1000)
# Width-dependent overrides at the TPU shape (d_model 1024, experts of width 256).
TPU_VALUES = {"model.moe.d_shared": 512, "model.moe.expert_init_std": round(1024**-0.5, 6)}


# Factor F varies width and length around the CPU shape; the TPU preset is itself a point
# further along that trend, so F is not mirrored here.
CPU_ONLY = ("F",)


def _at_tpu_scale(overrides: dict) -> dict:
  out = {k: TPU_VALUES.get(k, v) for k, v in overrides.items()}
  if "model.moe.d_expert" in out:  # factor D's second shape keeps its 2x wider experts
    out["model.moe.d_expert"] = 512
  return {**out, "data.paths": DATA, "data.prepared": PREPARED}


def get_sweep() -> Sweep:
  runs = [
    dataclasses.replace(
      r,
      config=f"{cpu_sweep.CONFIG}:tpu",
      overrides=_at_tpu_scale(r.overrides),
      compute="tpu",
      grid_steps=tuple(TPU_STEPS * s // cpu_sweep.STEPS for s in r.grid_steps),
    )
    for r in cpu_sweep.get_sweep().runs
    if r.factors["factor"] not in CPU_ONLY
  ]
  return Sweep(
    name="calibration_tpu",
    runs=runs,
    compute={"tpu": {"accelerators": "tpu-v5e-16", "use_spot": True}},
  )
