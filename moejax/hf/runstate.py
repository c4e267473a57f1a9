"""An imported run's orbax state: step, params and router biases — what evaluation reads.

An imported run holds no optimizer state (AdamW's zero moments would double the write and
the disk); `moejax.evaluate` and `export` read it with `checkpoint.restore_params`, which
restores `params` and `router` of trained and imported runs alike (the trainer's full
restore would not find `opt_state`; `guard.py` refuses training with a clear line).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from moejax import build
from moejax.nn.model import ModelConfig
from moejax.training import checkpoint
from moejax.training import step as step_lib

Path = tuple
# Each array is written as zarr chunks of at most this many bytes. Orbax writes every array
# of the tree at once, and unchunked each one is a single chunk that tensorstore compresses
# whole, so the compressed copies of the largest stacks were most of the write's memory
# (the before/after peaks: benchmarks/results/hf_import_memory.json). Restores read any
# chunking.
CHUNK_BYTES = 4 * 2**20


def _key(k) -> Any:
  return k.key if hasattr(k, "key") else getattr(k, "name", getattr(k, "idx", k))


def param_path(keypath) -> Path:
  """A jax key path inside an nnx.State as a moejax parameter path (no `.value`)."""
  return tuple(_key(k) for k in keypath if _key(k) != "value")


def abstract(mc: ModelConfig) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, {"params", "router"} of ShapeDtypeStructs), built without allocating weights."""
  graphdef, params, router = step_lib.split_model(build.abstract_transformer(mc))
  return graphdef, {"params": params, "router": router}


def shapes(state: dict) -> dict[Path, tuple[int, ...]]:
  """Parameter path → shape of every trainable parameter."""
  flat = jax.tree_util.tree_leaves_with_path(state["params"])
  return {param_path(p): tuple(leaf.shape) for p, leaf in flat}


def router_shapes(state: dict) -> dict[Path, tuple[int, ...]]:
  """Parameter path → shape of every router bias (`…mlp.router.bias`: state, not a
  parameter; no path is both)."""
  flat = jax.tree_util.tree_leaves_with_path(state["router"])
  return {param_path(p): tuple(leaf.shape) for p, leaf in flat}


def fill(state: dict, arrays: dict[Path, np.ndarray]) -> dict:
  """Step 0's state: `arrays` as params and router biases (not copied); a router bias
  `arrays` lacks is zero."""

  def router(p, leaf):
    got = arrays.get(param_path(p))
    return np.zeros(leaf.shape, leaf.dtype) if got is None else got

  params = jax.tree_util.tree_map_with_path(lambda p, _: arrays[param_path(p)], state["params"])
  biases = jax.tree_util.tree_map_with_path(router, state["router"])
  return {"step": np.zeros((), np.int32), "params": params, "router": biases}


def _writer(workdir: str) -> ocp.CheckpointManager:
  """`checkpoint.manager`'s layout, written without a second copy of the model: orbax's
  default NumpyHandler deep-copies every host array before its async write, and OCDBT
  buffers the compressed data of the whole tree (each a large fraction of the model:
  benchmarks/results/hf_import_memory.json, docs/decisions.md). Per-array zarr files, compressed in chunks of `CHUNK_BYTES`, keep the
  write's own memory small; orbax restores either format."""
  registry = ocp.type_handlers.create_type_handler_registry(
    (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
    (jax.Array, ocp.type_handlers.ArrayHandler()),
  )
  return ocp.CheckpointManager(
    checkpoint.directory(workdir),
    options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
    item_handlers={
      "state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_ocdbt=False),
      "data": ocp.JsonCheckpointHandler(),
    },
  )


def save(workdir: str, state: dict, data_state: dict) -> None:
  """Writes the state (numpy leaves only) as step 0 of `DIR/checkpoints`."""
  mngr = _writer(workdir)
  absl_logger, level = logging.getLogger("absl"), logging.getLogger("absl").level
  absl_logger.setLevel(logging.ERROR)  # "Skipping merge of OCDBT checkpoints": none to merge
  try:
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
    args = ocp.args.Composite(
      state=ocp.args.PyTreeSave(state, save_args=chunked), data=ocp.args.JsonSave(data_state)
    )
    mngr.save(0, args=args, force=True)
    mngr.wait_until_finished()
  finally:
    mngr.close()
    absl_logger.setLevel(level)


def restore(workdir: str, state: dict, step: int | None = None) -> tuple[int, dict]:
  """(step, {"params", "router"}) of a trained or imported run, without optimizer state."""
  mngr = checkpoint.manager(workdir, keep=1_000_000)
  try:
    return checkpoint.restore_params(mngr, state, step)
  finally:
    mngr.close()


def restore_params(
  workdir: str, state: dict, step: int | None = None, router: bool = False
) -> dict[Path, np.ndarray]:
  """Parameter path → float32 numpy array, from the run's checkpoint; with `router`, the
  router biases too (export's `e_score_correction_bias`)."""
  restored = restore(workdir, state, step)[1]
  flat = jax.tree_util.tree_leaves_with_path(restored["params"])
  if router:
    flat += jax.tree_util.tree_leaves_with_path(restored["router"])
  return {param_path(p): np.asarray(leaf, np.float32) for p, leaf in flat}
