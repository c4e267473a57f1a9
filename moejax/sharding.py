"""Device mesh and placements: data parallel over (data, fsdp), experts over `expert`.

Parameters are placed by a simple rule and left to GSPMD: stacked expert weights shard
their expert axis over `expert` and their d_model axis over `fsdp`, other matrices their
first axis over `fsdp`; the batch shards over data × fsdp. Optimizer moments follow their
parameters. Collectives are inserted by XLA.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.backend import compat
from moejax.errors import UserError

AXES = ("data", "fsdp", "expert")


def make_mesh(m, devices=None) -> Mesh:
  """Mesh of shape (data, fsdp, expert) over `devices` (default `jax.devices()`; moejax.aot
  passes a TPU topology's compile-only devices)."""
  devices = jax.devices() if devices is None else list(devices)
  return compat.mesh(np.asarray(devices).reshape(mesh_shape(m, len(devices))), AXES)


def mesh_shape(m, n: int) -> tuple[int, int, int]:
  """(data, fsdp, expert) for `n` devices; `mesh.data=-1` takes the remaining devices. `m`:
  the RunConfig's `mesh` (config.sections.MeshConfig, which has checked each axis)."""
  data = m.data if m.data != -1 else n // (m.fsdp * m.expert)
  if data < 1 or data * m.fsdp * m.expert != n:
    raise UserError(
      f"mesh.data×mesh.fsdp×mesh.expert={m.data}×{m.fsdp}×{m.expert} must equal "
      f"the {n} devices (mesh.data=-1 fills in)"
    )
  return data, m.fsdp, m.expert


def data_shards(mesh: Mesh) -> int:
  """How many ways the batch is split (micro-batch balance-loss groups)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(("data", "fsdp")))


# The d_model axis of each stacked expert weight: w_gate_up [E, D, 2F]; w_down [E, F, D].
EXPERT_D_AXIS = {"w_gate_up": 1, "w_down": 2}


def _expert_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  """E over `expert`, and d_model over `fsdp` (the other matrix axis if D does not divide).

  MaxText's rule for the same weights (logical axes `exp, embed_no_exp, mlp`, with
  `embed_no_exp` on fsdp): E stays whole on `expert`, so expert and fsdp shard two
  different axes and compose (E/expert × D/fsdp per device), and the axis the dispatch
  indexes per expert (`w[e]` in the block loop, ragged_dot's group axis) is never split
  over fsdp. GSPMD all-gathers D for compute as for every FSDP matrix."""
  spec = ["expert", None, None]
  d = EXPERT_D_AXIS.get(name, 1)
  for axis in (d, 3 - d):
    if shape[axis] % mesh.shape["fsdp"] == 0:
      spec[axis] = "fsdp"
      break
  return P(*spec)


def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def is_stacked(path, leaf) -> bool:
  """Whether a leaf is a scanned stack's (`.../stacks/...`, `moejax.nn.stack`): its first
  axis is the layer axis."""
  return "stacks" in _names(path) and bool(getattr(leaf, "shape", ()))


def layer_ndim(path, leaf) -> int:
  """The rank of one layer's slice of a leaf (the leaf's own rank when it is not stacked)."""
  return len(getattr(leaf, "shape", ())) - is_stacked(path, leaf)


def _spec(path, leaf, mesh: Mesh) -> P:
  """A leaf's spec; a scanned stack's leaves lead with their layer axis, unsharded, and
  follow the rule for one layer's shape behind it."""
  shape, names = tuple(getattr(leaf, "shape", ())), _names(path)
  if is_stacked(path, leaf):
    return P(None, *_layer_spec(names, shape[1:], mesh))
  return _layer_spec(names, shape, mesh)


def _layer_spec(names: list[str], shape: tuple[int, ...], mesh: Mesh) -> P:
  if "experts" in names and len(shape) == 3 and shape[0] % mesh.shape["expert"] == 0:
    return _expert_spec(next((n for n in names if n in EXPERT_D_AXIS), ""), shape, mesh)
  if len(shape) >= 2 and shape[0] % mesh.shape["fsdp"] == 0:
    return P("fsdp")
  return P()


def state_sharding(state, mesh: Mesh):
  """NamedShardings for a train-state pytree (optimizer moments follow their params)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: NamedSharding(mesh, _spec(path, leaf, mesh)), state
  )


def tracing_mesh(fn, mesh: Mesh):
  """`fn` traced under `mesh` as the context (abstract) mesh, so kernels that GSPMD cannot
  partition (Mosaic: megablox, splash attention) find the batch axes for their shard_map."""

  def traced(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)

  return traced


def batch_axes(n: int) -> tuple[str, ...]:
  """The context mesh's data-parallel axes (data, fsdp) that split a leading axis of `n`,
  or () without a context mesh (`tracing_mesh`) or when they do not divide it: where a
  per-device kernel's shard_map splits its rows."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and mesh.shape[a] > 1)
  return axes if axes and n % math.prod(mesh.shape[a] for a in axes) == 0 else ()
