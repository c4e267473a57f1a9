"""A run's orbax state without training: the abstract layout, filled from arrays or read back.

The layout is exactly what `moejax.trainer.build` restores ({"step", "params", "router",
"opt_state"} under `DIR/checkpoints/<step>/state`), so `moejax.evaluate` grids an imported
run like a trained one. An imported run's optimizer state is AdamW's fresh state (zeros),
allocated lazily by `np.zeros`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from moejax import checkpoint, optim
from moejax import step as step_lib
from moejax.model import ModelConfig, Transformer

Path = tuple


def _key(k) -> Any:
  return k.key if hasattr(k, "key") else getattr(k, "name", getattr(k, "idx", k))


def param_path(keypath) -> Path:
  """A jax key path inside an nnx.State as a moejax parameter path (no `.value`)."""
  return tuple(_key(k) for k in keypath if _key(k) != "value")


def abstract(c, mc: ModelConfig) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, state of ShapeDtypeStructs) of a run, built without allocating weights."""
  model = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0)))
  graphdef, params, router = step_lib.split_model(model)
  tx, _ = optim.optimizer(c)
  opt_state = jax.eval_shape(tx.init, params)
  step = jax.ShapeDtypeStruct((), np.int32)
  return graphdef, {"step": step, "params": params, "router": router, "opt_state": opt_state}


def shapes(state: dict) -> dict[Path, tuple[int, ...]]:
  """Parameter path → shape of every trainable parameter."""
  flat = jax.tree_util.tree_leaves_with_path(state["params"])
  return {param_path(p): tuple(leaf.shape) for p, leaf in flat}


def fill(state: dict, arrays: dict[Path, np.ndarray]) -> dict:
  """The abstract state with `arrays` as params, zero router biases and optimizer state."""

  def zeros(leaf):
    return np.zeros(leaf.shape, leaf.dtype)

  params = jax.tree_util.tree_map_with_path(lambda p, _: arrays[param_path(p)], state["params"])
  return {
    "step": np.zeros((), np.int32),
    "params": params,
    "router": jax.tree.map(zeros, state["router"]),
    "opt_state": jax.tree.map(zeros, state["opt_state"]),
  }


def save(workdir: str, state: dict, data_state: dict) -> None:
  """Writes the state as step 0 of `DIR/checkpoints`."""
  mngr = checkpoint.manager(workdir, keep=1)
  try:
    checkpoint.save(mngr, 0, state, data_state)
  finally:
    mngr.close()


def restore(workdir: str, state: dict, step: int | None = None) -> dict:
  """The run's checkpointed state (host arrays on the first CPU device)."""
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), state)
  mngr = checkpoint.manager(workdir, keep=1_000_000)
  try:
    _, restored, _ = checkpoint.restore(mngr, target, step)
  finally:
    mngr.close()
  return restored


def restore_params(workdir: str, state: dict, step: int | None = None) -> dict[Path, np.ndarray]:
  """Parameter path → float32 numpy array, from the run's checkpoint."""
  flat = jax.tree_util.tree_leaves_with_path(restore(workdir, state, step)["params"])
  return {param_path(p): np.asarray(leaf, np.float32) for p, leaf in flat}


def load_model(workdir: str, c, mc: ModelConfig, step: int | None = None) -> Transformer:
  """The run's Transformer with its checkpointed weights (for tests and inspection)."""
  graphdef, state = abstract(c, mc)
  restored = restore(workdir, state, step)
  return nnx.merge(graphdef, restored["params"], restored["router"])
