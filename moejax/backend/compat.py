"""What moejax does differently on the jax lines it supports: jax 0.10.x (Python 3.11, whose
newest jax is 0.10.2) and jax 0.11.x-0.12.x (Python 3.12+; 0.12 needs no branch of its own).
Code that depends on the line goes through here and nowhere else (README "Tests" says which
line CI runs what on).

* Mesh axis types. `AbstractMesh(shape, names)` defaults to Explicit axes on jax 0.11 (Auto
  on 0.10): moejax shards with GSPMD's Auto axes everywhere, so its meshes say so.
* The GPU a Pallas Triton kernel is lowered for. jax 0.11's Triton lowering reads the target
  GPU from the context mesh's `AbstractDevice` (or a GPU default device) and refuses a host
  without either; 0.10 fell back to sm90. A function lowered for CUDA on a host without a
  GPU (an export, the tests) is traced under `gpu_target()`; jax 0.10 accepts the same
  context, so both lines run one code path.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh

# The GPU a CUDA lowering targets when no GPU is JAX's default device (the device kind a real
# H100 SXM reports: jax's pallas/triton/gpu_info.py registry)
DEFAULT_GPU_KIND = "NVIDIA H100 80GB HBM3"


def auto_axes(n: int) -> tuple[AxisType, ...]:
  """GSPMD-partitioned (Auto) axis types for a mesh of `n` axes."""
  return (AxisType.Auto,) * n


def mesh(devices, names: tuple[str, ...]) -> Mesh:
  """A concrete mesh over an ndarray of devices, every axis Auto."""
  return Mesh(devices, names, axis_types=auto_axes(len(names)))


def abstract_mesh(
  shape: tuple[int, ...], names: tuple[str, ...], gpu_kind: str | None = None
) -> AbstractMesh:
  """A mesh without devices, every axis Auto; with `gpu_kind` it also names the GPU that
  Pallas Triton kernels traced under it are lowered for."""
  device = AbstractDevice(gpu_kind, None, "gpu") if gpu_kind else None
  return AbstractMesh(tuple(shape), tuple(names), auto_axes(len(names)), abstract_device=device)


def gpu_target(gpu_kind: str = DEFAULT_GPU_KIND):
  """The context to trace a function in that is lowered for CUDA from a host whose default
  device is not a GPU (jax.jit(...).trace(...).lower(lowering_platforms=("cuda",)),
  jax.export): an empty context mesh naming `gpu_kind`. Inside a context mesh already
  (the trainer's `sharding.tracing_mesh`), that mesh carries the GPU instead
  (`abstract_mesh(..., gpu_kind)`)."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(abstract_mesh((), (), gpu_kind))


def lowering_for(platforms: tuple[str, ...]):
  """The context to trace a function in that is lowered for `platforms` on this host:
  `gpu_target()` when they include cuda, else nothing."""
  return gpu_target() if "cuda" in platforms else contextlib.nullcontext()
