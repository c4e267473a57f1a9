"""Compile-only devices of a TPU topology or of GPU nodes, and the memory each device has.

* TPU: `jax.experimental.topologies.get_topology_desc(platform="tpu")` builds the devices from
  libtpu (the `tpu` extra) on a CPU host; the usable HBM is read from the TPU compiler itself
  (`hbm`: the RESOURCE_EXHAUSTED of a probe that cannot fit).
* GPU: `get_topology_desc(platform="cuda", target_config=...)` builds compile-only CUDA devices
  from a `GpuTargetConfig` text proto (jax's CUDA plugin, the `cuda` extra; jax-ml/jax#28376,
  openxla/xla#16913). The protos are shipped in `moejax/aot/gpu/`, each figure with its
  public source. A descriptor `h100:8` is one node of 8 GPUs, `h100:2x8` two such nodes
  (topology "2x1x8": NVLink inside a node, the network between). The usable memory is the
  proto's `device_memory_size` times the fraction JAX's GPU client takes for its pool
  (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 unless set; JAX's "GPU memory allocation" docs):
  the rest is left to the CUDA context, cuBLAS/cuDNN workspaces and NCCL.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import math
import os
import pathlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.backend import compat, compile_options
from moejax.aot import memory
from moejax.errors import UserError

GIB = 1 << 30
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e")
# One JAX device per chip on v4 and v5p (megacore), as on a real slice; v2/v3 have one per
# core and v5e/v6e one core per chip.
_MEGACORE = ("v4", "v5p")
_SKY_NAMES = {"v5litepod": "v5e", "v6e": "v6e"}  # GCP accelerator-type names
_CORES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
CUDA_INSTALL = 'pip install -e ".[cuda]"'
TPU_INSTALL = 'pip install -e ".[tpu]"'
GPU_DIR = pathlib.Path(__file__).resolve().parent / "gpu"
# JAX's GPU client preallocates this fraction of device memory for XLA's buffers (JAX docs,
# "GPU memory allocation"); XLA_PYTHON_CLIENT_MEM_FRACTION changes it.
JAX_MEM_FRACTION = 0.75


class Target(NamedTuple):
  """Where a program is compiled for: a TPU topology's or GPU nodes' compile-only devices."""

  name: str  # "v5e:4x4", "h100:8"
  platform: str  # "tpu" | "cuda"
  devices: tuple  # compile-only devices
  n_devices: int
  hbm_bytes: int  # usable per device
  hbm_source: str
  # XLA options for each compile (`Lowered.compile(compiler_options)`), as (name, value):
  # the platform's `compile_options.options`, as the run's own compiles have them
  compiler_options: tuple[tuple[str, bool | int | str], ...] = ()

  def compile(self, lowered):
    """`lowered` compiled with this target's `compiler_options`."""
    return lowered.compile(dict(self.compiler_options) or None)


class GpuKind(NamedTuple):
  """A GPU model with a shipped target config (`moejax/aot/gpu/<proto>`)."""

  proto: str
  sky: tuple[str, ...]  # SkyPilot accelerator names (`H100:8`)
  description: str


GPUS: dict[str, GpuKind] = {
  "a100": GpuKind("a100_sxm_80.txtpb", ("A100-80GB",), "A100-SXM4-80GB, sm80"),
  "h100": GpuKind("h100_sxm.txtpb", ("H100", "H100-SXM"), "H100 80GB HBM3 (SXM5), sm90"),
  "h200": GpuKind("h200_sxm.txtpb", ("H200",), "H200 141GB HBM3e (SXM), sm90"),
  "b200": GpuKind("b200.txtpb", ("B200",), "B200 180GB HBM3e (HGX), sm100"),
}
_GPU_DESCRIPTOR = re.compile(r"([a-z0-9]+):(?:(\d+)x)?(\d+)")


# ------------------------------------------------------------------------------------- TPU


def _quiet_libtpu() -> None:
  """Environment for a compile-only libtpu on a host without TPUs: no lockfile (another
  process, e.g. a JAX without JAX_PLATFORMS=cpu, may hold /tmp/libtpu_lockfile) and no
  'could not determine TPU accelerator type / worker hostnames' warnings."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if not (glob.glob("/dev/accel*") or os.path.exists("/dev/vfio")):
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def libtpu_available() -> bool:
  """Whether the TPU compiler (libtpu, the `tpu` extra) is installed."""
  return importlib.util.find_spec("libtpu") is not None


CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")  # jax[cuda12], jax[cuda13]


def cuda_available() -> bool:
  """Whether a GPU compiler (jax's CUDA plugin: the `cuda` extra's cuda12 here, cuda13 on
  newer GPU images) is installed."""
  try:
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False


def cuda_extra_missing() -> list[str]:
  """What of the `cuda` extra a GPU compile needs and this host lacks: the GPU compiler and
  tokamax (the GPU kernels, which the GPU presets' `impl=auto` and attention run)."""
  out = [] if cuda_available() else ["jax's CUDA plugin, the GPU compiler"]
  if importlib.util.find_spec("tokamax") is None:
    out.append("tokamax, the GPU kernels")
  return out


def topology_of_accelerator(accelerators: str) -> str | None:
  """'tpu-v5e-16' / 'tpu-v5litepod-16' -> 'v5e:4x4', 'tpu-v4-8' -> 'v4:2x2x1'; None for a
  non-TPU accelerator. The GCP number counts TensorCores on v2-v4 and v5p (2 per chip)
  and chips on v5e/v6e; slices grow by doubling the last of their smallest dimensions."""
  m = re.fullmatch(r"tpu-(v\d+[a-z]*)-(\d+)", accelerators.strip().lower())
  if not m:
    return None
  gen = _SKY_NAMES.get(m.group(1), m.group(1))
  if gen not in _CORES_PER_CHIP:
    raise UserError(f"accelerator {accelerators}: unknown TPU generation; known: {TPU_GENERATIONS}")
  chips = max(int(m.group(2)) // _CORES_PER_CHIP[gen], 1)
  if chips & (chips - 1):
    raise UserError(f"accelerator {accelerators}: {chips} chips is not a power of two")
  dims = [1, 1] if gen in ("v5e", "v6e") else [2, 2, 1] if chips >= 4 else [1, 1, 1]
  while math.prod(dims) < chips:
    smallest = min(dims)
    dims[max(i for i, d in enumerate(dims) if d == smallest)] *= 2
  return f"{gen}:{'x'.join(map(str, dims))}"


@functools.cache
def tpu_devices(topology: str) -> tuple:
  """Compile-only devices of a TPU topology such as 'v5e:4x4' or 'v4:2x2x1'."""
  gen, _, shape = topology.partition(":")
  try:
    dims = [int(d) for d in shape.split("x")]
  except ValueError:
    dims = []
  if gen not in TPU_GENERATIONS or len(dims) not in (2, 3) or min(dims) < 1:
    raise UserError(
      f"--topology {topology} is not allowed; use GENERATION:AxB[xC] with GENERATION one of "
      f"{', '.join(TPU_GENERATIONS)}, e.g. v5e:4x4 or v4:2x2x1"
    )
  if not libtpu_available():
    raise UserError(f"--topology {topology} needs libtpu, the TPU compiler: {TPU_INSTALL}")
  _quiet_libtpu()
  bounds = (min(dims[0], 2), min(dims[1], 2), 1)
  chip = {"chip_config_name": "megacore"} if gen in _MEGACORE else {}
  try:
    topo = topologies.get_topology_desc(
      platform="tpu", topology_name=topology, chips_per_host_bounds=bounds, **chip
    )
  except jax.errors.JaxRuntimeError as e:
    raise UserError(f"--topology {topology}: libtpu refused it ({memory.first_line(e)})") from None
  return tuple(topo.devices)


@functools.cache
def hbm(device_kind: str, device) -> int:
  """Usable HBM bytes of one TPU device, read from the TPU compiler: a 512 GiB temporary is
  refused with 'exceeds available HBM (15.75G)' on v5e (16 GiB chips, Cloud TPU docs)."""
  mesh = compat.mesh(np.asarray([device]), ("x",))

  def probe(x):
    big = x * jax.lax.broadcasted_iota(jnp.float32, (1 << 18, 1 << 18), 1)
    return jnp.sort(big, axis=1)[:, 0]

  arg = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
  try:
    jax.jit(probe).lower(arg).compile()
  except jax.errors.JaxRuntimeError as e:
    parsed = memory.parse_oom(str(e))
    if parsed:
      return parsed[1]
    raise
  raise RuntimeError(f"{device_kind}: a 512 GiB temporary compiled; cannot read its HBM")


def tpu_target(topology: str) -> Target:
  devices = tpu_devices(topology)
  kind = devices[0].device_kind
  size = hbm(kind, devices[0])
  options = tuple(compile_options.options("tpu").items())
  return Target(topology, "tpu", devices, len(devices), size, f"{kind}: TPU compiler", options)


# ------------------------------------------------------------------------------------- GPU


def parse_gpu(descriptor: str) -> tuple[str, int, int]:
  """'h100:8' -> ('h100', 1, 8); 'h100:2x8' -> ('h100', 2, 8): kind, nodes, GPUs per node."""
  m = _GPU_DESCRIPTOR.fullmatch(descriptor.strip().lower())
  if not m or m.group(1) not in GPUS or int(m.group(3)) < 1 or int(m.group(2) or 1) < 1:
    raise UserError(
      f"--gpu {descriptor} is not allowed; use KIND:GPUS or KIND:NODESxGPUS with KIND one of "
      f"{', '.join(GPUS)}, e.g. h100:8 (one node) or h100:2x8 (two nodes)"
    )
  return m.group(1), int(m.group(2) or 1), int(m.group(3))


def gpu_of_accelerator(accelerators: str, num_nodes: int = 1) -> str | None:
  """SkyPilot's 'H100:8' with num_nodes 2 -> 'h100:2x8'; None for a GPU without a shipped
  target config (or a TPU)."""
  name, _, count = accelerators.strip().partition(":")
  kind = next((k for k, g in GPUS.items() if name.upper() in g.sky), None)
  if kind is None:
    return None
  try:
    per_node = int(count) if count else 1
  except ValueError:
    raise UserError(f"accelerators {accelerators!r}: use NAME or NAME:COUNT") from None
  return f"{kind}:{num_nodes}x{per_node}" if num_nodes > 1 else f"{kind}:{per_node}"


def target_config(kind: str) -> str:
  """The GpuTargetConfig text proto of a GPU kind (comments name each figure's source)."""
  return (GPU_DIR / GPUS[kind].proto).read_text()


def _proto_int(text: str, field: str) -> int:
  return int(re.search(rf"^\s*{field}:\s*(\d+)", text, re.MULTILINE).group(1))


def mem_fraction() -> float:
  return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION))


@functools.cache
def gpu_devices(descriptor: str) -> tuple:
  """Compile-only CUDA devices of `descriptor`, built by jax's CUDA plugin on this host."""
  kind, nodes, per_node = parse_gpu(descriptor)
  if missing := cuda_extra_missing():
    raise UserError(
      f"--gpu {descriptor} needs the cuda extra ({' and '.join(missing)}): {CUDA_INSTALL}"
    )
  try:
    topo = topologies.get_topology_desc(
      platform="cuda", target_config=target_config(kind), topology=f"{nodes}x1x{per_node}"
    )
  except Exception as e:  # noqa: BLE001  the plugin's refusal, whatever its type
    raise UserError(
      f"--gpu {descriptor}: the CUDA plugin refused it ({memory.first_line(e)})"
    ) from None
  return tuple(topo.devices)


def gpu_target(descriptor: str) -> Target:
  """The compile-only GPUs of `descriptor` ('h100:8'), with the memory JAX's pool gets."""
  kind, _, _ = parse_gpu(descriptor)
  devices = gpu_devices(descriptor)
  total = _proto_int(target_config(kind), "device_memory_size")
  fraction = mem_fraction()
  source = (
    f"{devices[0].device_kind}: {total / GIB:.2f} GiB x {fraction:g}, JAX's pool "
    "(XLA_PYTHON_CLIENT_MEM_FRACTION)"
  )
  options = tuple(compile_options.options("cuda").items())
  return Target(descriptor, "cuda", devices, len(devices), int(total * fraction), source, options)
