"""Checkpoints of the split gate/up layout, converted on restore.

Before `w_gate_up`, a SwiGLU's gate and up were two parameters, `w_gate` and `w_up`
([..., D, F] each, routed experts, the shared expert and dense FFNs alike), and so were
their AdamW moments. Such a checkpoint is read into that layout, sharded as the joined
array would be, and each pair is joined along its last axis (gate in columns [0, F), up in
[F, 2F)), the arrays a run of the current layout holds: a concatenation, so exact. The
next save writes the joined layout; nothing on disk is rewritten.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from moejax.errors import UserError

GATE, UP, JOINED = "w_gate", "w_up", "w_gate_up"


def is_split(tree) -> bool:
  """Whether a saved tree (orbax metadata: nested dicts and lists) holds a gate/up pair."""
  if isinstance(tree, dict):
    return (GATE in tree and UP in tree) or any(is_split(v) for v in tree.values())
  if isinstance(tree, list | tuple):
    return any(is_split(v) for v in tree)
  return False


def saved_tree(mngr: ocp.CheckpointManager, step: int, item: str = "state"):
  """The saved tree of `item` at `step` (dicts, lists and array metadata), None if orbax
  cannot read it (the restore then reports the checkpoint)."""
  try:
    meta = ocp.PyTreeCheckpointHandler().metadata(mngr.directory / str(step) / item)
  except Exception:  # noqa: BLE001  (unreadable metadata: the restore names the checkpoint)
    return None
  return getattr(meta, "tree", meta)


def _name(k) -> str:
  """A jax key path entry as orbax names it in a saved tree."""
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _joined_path(names: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(JOINED if n in (GATE, UP) else n for n in names)


def split_target(saved, target) -> Any:
  """The restore target of a split-layout checkpoint: `saved`'s structure, each array a
  ShapeDtypeStruct with the dtype and sharding of its counterpart in `target` (the current
  layout's, `w_gate_up` for both halves), restricted to the subtrees `target` holds."""
  flat = jax.tree_util.tree_leaves_with_path(target)
  leaves = {tuple(_name(k) for k in path): leaf for path, leaf in flat}
  prefixes = {p[:i] for p in leaves for i in range(len(p) + 1)}

  def walk(node, names: tuple[str, ...]):
    if isinstance(node, dict):  # a partial restore leaves out what the target does not hold
      kept = {
        k: v
        for k, v in node.items()
        if _joined_path((*names, str(k))) in prefixes or not _holds_arrays(v)
      }
      return {k: walk(v, (*names, str(k))) for k, v in kept.items()}
    if isinstance(node, list | tuple):
      return [walk(v, (*names, str(i))) for i, v in enumerate(node)]
    if node is None:
      return None
    want = leaves.get(_joined_path(names))
    if want is None:
      raise UserError(f"the checkpoint's {'.'.join(names)} has no counterpart in this config")
    return jax.ShapeDtypeStruct(tuple(node.shape), want.dtype, sharding=want.sharding)

  return walk(saved, ())


def _holds_arrays(node) -> bool:
  if isinstance(node, dict):
    return any(_holds_arrays(v) for v in node.values())
  if isinstance(node, list | tuple):
    return any(_holds_arrays(v) for v in node)
  return node is not None


def join(tree):
  """`tree` (dicts and lists) with each gate/up pair replaced by their concatenation."""
  if isinstance(tree, list | tuple):
    return [join(v) for v in tree]
  if not isinstance(tree, dict):
    return tree
  pair = GATE in tree and UP in tree
  out = {k: join(v) for k, v in tree.items() if not (pair and k in (GATE, UP))}
  if pair:
    out[JOINED] = jax.tree.map(lambda g, u: jnp.concatenate([g, u], -1), tree[GATE], tree[UP])
  return out


def fill(target, restored):
  """`target`'s structure with each leaf read from `restored` (dicts and lists, as orbax
  saves) at the same path, placed with the target leaf's sharding."""

  def take(path, leaf):
    node = restored
    for k in path:
      node = node[int(_name(k))] if isinstance(node, list) else node.get(_name(k))
      if node is None:
        raise UserError(f"checkpoint holds no {jax.tree_util.keystr(path)} for this config")
    if tuple(node.shape) != tuple(leaf.shape):
      raise UserError(
        f"checkpoint's {jax.tree_util.keystr(path)} has shape {list(node.shape)}; this "
        f"config's is {list(leaf.shape)}"
      )
    return jax.device_put(node.astype(leaf.dtype), getattr(leaf, "sharding", None))

  return jax.tree_util.tree_map_with_path(take, target)


def restore_args(target_split) -> Any:
  """orbax's per-array restore arguments: each array onto its target sharding."""
  return jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target_split)
