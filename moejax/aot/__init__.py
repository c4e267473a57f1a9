"""Ahead-of-time: the train step compiled for devices this machine does not have, and sized.

* `targets`: compile-only devices of a TPU topology (`v5e:4x4`, libtpu: the `tpu` extra) or
  of GPU nodes (`h100:8`, `h100:2x8`; jax's CUDA plugin: the `cuda` extra, with the
  GpuTargetConfig protos shipped in `moejax/aot/gpu/`), and each device's usable memory.
* `programs`: the trainer's Run with abstract state on a target's mesh, its jitted train
  step, the k-grid's forward; `footprint` compiles the step and sizes it.
* `memory`: per-device bytes (`Footprint`): the state exact from its shardings, the rest
  the compiler's `memory_analysis()`, and the fit.
* `cache`: compiled answers on disk, keyed by the lowered program, target and compilers
  (the sweep precheck's: a dry run and its launch compile once).
* `custom_calls`: the accelerator kernels a compiled program holds, by family.
* `loops`: the compiled program's while loops, their trip counts and what each iteration
  runs (`describe` prints them).
* `fit`: the smallest slice of a family (`tpu-v5e`, `h100`) the train step fits
  (`describe --fit`).

Both compilers run on a CPU host with `JAX_PLATFORMS=cpu` set, so the host backend stays the
CPU's: XLA:TPU and XLA:GPU run their whole pipelines for the target (XLA:GPU: Triton GEMM
fusions, collectives, cuDNN). Neither exposes an estimated step time for a deviceless
compile (`cost_analysis()` is None on GPU), so nothing here is timed.
"""

from moejax.aot import cache, fit, loops  # noqa: F401
from moejax.aot.loops import Loop, format_loops  # noqa: F401
from moejax.aot.memory import Footprint, device_bytes, parse_oom  # noqa: F401
from moejax.aot.programs import (  # noqa: F401
  Abstract,
  abstract_run,
  export_gpu,
  footprint,
  grid_forward,
  impl_on,
  lower_train_step,
  train_step,
)
from moejax.aot.targets import (  # noqa: F401
  CUDA_INSTALL,
  GPUS,
  TPU_INSTALL,
  Target,
  cuda_available,
  gpu_devices,
  gpu_of_accelerator,
  gpu_target,
  libtpu_available,
  parse_gpu,
  topology_of_accelerator,
  tpu_devices,
  tpu_target,
)
