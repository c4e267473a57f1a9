"""The calibration study at the GPU preset: the runs and factors of `sweep_tpu.py` (A-E at
the TPU preset's model and tokens per step), on `configs/study_calibration.py:gpu`, each as
a SkyPilot managed job on one node of 8 H100s.

    python -m launch.sweep experiments/calibration/sweep_gpu.py --backend sky \
        --root gs://BUCKET/moejax [--dry-run]

The data (MOEJAX_CALIBRATION_DATA) and its prepared copy (MOEJAX_CALIBRATION_PREPARED) are
`sweep_tpu.py`'s. The precheck compiles each distinct program for 8 compile-only H100s
(`h100:8`, the `cuda` extra) and refuses a run that does not fit 0.75 of the 80 GB.
"""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sweep_tpu

from launch.spec import Sweep

ACCELERATORS = "H100:8"


def get_sweep() -> Sweep:
  tpu = sweep_tpu.get_sweep()
  runs = [
    dataclasses.replace(r, config=r.config.replace(":tpu", ":gpu"), compute="gpu") for r in tpu.runs
  ]
  return Sweep(
    name="calibration_gpu",
    runs=runs,
    compute={"gpu": {"accelerators": ACCELERATORS, "use_spot": True}},
  )
