"""Orbax checkpoints of a run: train state (params, router biases, optimizer) + data state.

Layout: `DIR/checkpoints/<step>/{state,data}` (orbax step directories). With
`train.async_checkpoints` (the default) orbax copies the state to host memory and writes it
in a background thread: `save` returns then, the next `save` waits for the one before, and
the loop waits (`wait`) at a stop and at the end. Saving is atomic
(orbax writes to a temporary directory and renames it; on gs://, which has no rename, it
writes the step in place and commits it with commit_success.txt last), so an interrupted
save never hides the previous good checkpoint, and old steps are deleted only after a
newer one is committed. The trainer removes an interrupted save's directory when it
starts (`remove_unfinished_saves`). A committed but unreadable checkpoint (a truncated
file) is moved to `DIR/checkpoints_corrupt/<step>` by `restore_latest_good`, which resumes
from the newest readable one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from moejax import runio
from moejax.errors import UserError
from moejax.training import split_layout


def directory(workdir: str) -> str:
  """`DIR/checkpoints`: absolute on a local disk, as given on gs://."""
  path = os.path.join(workdir, "checkpoints")  # os.path.join keeps gs:// as it is
  return path if "://" in path else os.path.abspath(path)


def manager(workdir: str, keep: int = 3, async_save: bool = False) -> ocp.CheckpointManager:
  """A CheckpointManager on `DIR/checkpoints` keeping the newest `keep` steps, saving in the
  background with `async_save`. It deletes nothing at start (orbax's
  `cleanup_tmp_directories` would, in a background thread that races the run's own reads
  and writes): the trainer calls `remove_unfinished_saves`."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    create=True,
    cleanup_tmp_directories=False,
    enable_async_checkpointing=async_save,
  )
  return ocp.CheckpointManager(directory(workdir), options=options, item_names=("state", "data"))


def remove_unfinished_saves(workdir: str) -> list[str]:
  """Deletes the step directories of saves that never committed (a kill mid-save) and
  returns them: orbax's temporary directories on a local disk, step directories without
  commit_success.txt on gs://. Synchronous, before any manager reads the directory;
  process 0 only (the others wait for it at the train step's first collective).

  A directory an object store listed but that holds nothing by the time it is deleted
  (gcsfs: FileNotFoundError, "nothing got deleted") is gone already, which is the goal; a
  second pass takes what a directory placeholder object kept (as orbax's gcs_utils.rmtree)."""
  root = runio.path(directory(workdir))
  if jax.process_index() != 0 or not root.exists():
    return []
  removed = [tmp.get() for tmp in ocp.path.step.all_temporary_paths(root)]
  for path in removed:
    for _ in range(2):
      with contextlib.suppress(FileNotFoundError):
        path.rmtree()
      if not path.exists():
        break
  return [str(path) for path in removed]


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict) -> None:
  """Saves `step` once the previous save has finished; with an async manager it returns
  when the state is in host memory (the caller may then donate it), before it is written."""
  mngr.save(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
    force=True,
  )


def wait(mngr: ocp.CheckpointManager) -> None:
  """Blocks until every save has been written and committed (raising a save's error)."""
  mngr.wait_until_finished()


@contextlib.contextmanager
def _native_stderr_muted_on_failure():
  """When orbax fails to read one array, its other in-flight reads fail later on a closed
  event loop and tensorstore prints their tracebacks from C++ straight to fd 2, burying
  the one-line error. During a restore fd 2 goes to /dev/null; on success it is put
  back, on failure it stays muted and Python's sys.stderr writes to the real stderr."""
  sys.stderr.flush()
  try:  # after an earlier failure fd 2 is muted and sys.stderr holds the real one
    real_fd = os.dup(sys.stderr.fileno())
  except (AttributeError, OSError, ValueError):  # a replaced sys.stderr (pytest capture)
    real_fd = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)
  try:
    yield
  except BaseException:
    sys.stderr = os.fdopen(real_fd, "w", buffering=1)
    logging.getLogger("concurrent.futures").setLevel(logging.CRITICAL)
    threading.excepthook = lambda args: None
    sys.unraisablehook = lambda unraisable: None
    raise
  os.dup2(real_fd, 2)
  os.close(real_fd)


def _pick_step(mngr: ocp.CheckpointManager, step: int | None) -> int:
  """`step`, or the latest with None; a UserError naming the directory when there is none."""
  steps = mngr.all_steps()
  if not steps:
    raise UserError(f"no checkpoint in {mngr.directory}")
  step = max(steps) if step is None else step
  if step not in steps:
    raise UserError(
      f"no checkpoint for step {step} in {mngr.directory}; "
      f"available: {', '.join(map(str, sorted(steps)))}"
    )
  return step


def _restore_or_fail(mngr: ocp.CheckpointManager, step: int, args: ocp.args.Composite):
  """mngr.restore, any orbax failure (truncated or foreign files) as one UserError line."""
  try:
    with _native_stderr_muted_on_failure():
      return mngr.restore(step, args=args)
  except Exception as e:  # orbax raises many types for truncated or foreign files
    reason = " ".join(str(e).split())[:200]
    raise UserError(
      f"checkpoint {mngr.directory}/{step} is unreadable or does not match this "
      f"config ({type(e).__name__}: {reason})"
    ) from None


def restore(
  mngr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None
) -> tuple[int, Any, dict]:
  """Restores (step, state, data_state); `step=None` takes the latest.

  A missing or unreadable checkpoint raises a one-line `UserError` naming the directory. A
  checkpoint of the split gate/up layout is converted (`split_layout`).
  """
  step = _pick_step(mngr, step)
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
  saved = split_layout.saved_tree(mngr, step)
  if saved is not None and split_layout.is_split(saved):
    state, data = _restore_split(mngr, step, saved, target, data=True)
    return step, state, data
  args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
  out = _restore_or_fail(mngr, step, args)
  return step, out.state, out.data


def _restore_split(mngr: ocp.CheckpointManager, step: int, saved, target, data: bool):
  """(state, data state or None) of a split gate/up checkpoint, in `target`'s layout."""
  try:
    split = split_layout.split_target(saved, target)
  except UserError as e:
    raise UserError(f"checkpoint {mngr.directory}/{step} does not match this config: {e}") from None
  if data:  # the trainer's restore: the whole state, with the handler its manager saves with
    items = {"state": ocp.args.StandardRestore(split), "data": ocp.args.JsonRestore()}
  else:
    restore_args = split_layout.restore_args(split)
    items = {
      "state": ocp.args.PyTreeRestore(item=split, restore_args=restore_args, partial_restore=True)
    }
  out = _restore_or_fail(mngr, step, ocp.args.Composite(**items))
  try:
    state = split_layout.fill(target, split_layout.join(out.state))
  except UserError as e:
    raise UserError(f"checkpoint {mngr.directory}/{step} does not match this config: {e}") from None
  return state, (out.data if data else None)


def restore_params(
  mngr: ocp.CheckpointManager, abstract: dict[str, Any], step: int | None = None
) -> tuple[int, dict[str, Any]]:
  """(step, {"params", "router"}) of a training checkpoint, without its optimizer state or
  data state: `abstract` holds only the `params` and `router` trees (shapes and dtypes), and
  every array lands on this process's first device. `step=None` takes the latest."""
  step = _pick_step(mngr, step)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  saved = split_layout.saved_tree(mngr, step)
  if saved is not None and split_layout.is_split(saved):
    state = _restore_split(mngr, step, saved, target, data=False)[0]
    return step, {name: state[name] for name in abstract}
  restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=device), target)
  partial = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
  out = _restore_or_fail(mngr, step, ocp.args.Composite(state=partial))
  return step, {name: out.state[name] for name in abstract}


def restore_latest_good(
  workdir: str, mngr: ocp.CheckpointManager, abstract_state: Any, log
) -> tuple[ocp.CheckpointManager, tuple[int, Any, dict] | None]:
  """(manager, restored) from the newest readable checkpoint, None when there is none.

  Each unreadable newer checkpoint is reported by name and moved to
  `DIR/checkpoints_corrupt/<step>` (so training can save that step again); with
  checkpoints but none readable, a UserError lists them and nothing is moved."""
  failures = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      restored = restore(mngr, abstract_state, step)
    except UserError as e:
      failures.append((step, str(e)))
      continue
    for bad, why in failures:
      dest = _move_aside(workdir, mngr.directory, bad)
      log(f"warning: {why}; moved to {dest}; resuming from the previous checkpoint")
    if failures:
      mngr.close()
      options = mngr._options  # pylint: disable=protected-access
      mngr = manager(workdir, options.max_to_keep, options.enable_async_checkpointing)
    return mngr, restored
  if failures:
    raise UserError(
      "no readable checkpoint: "
      + "; ".join(why for _, why in failures)
      + "; remove them or use a new --workdir"
    )
  return mngr, None


def _move_aside(workdir: str, directory, step: int) -> str:
  """Moves `checkpoints/<step>` to `checkpoints_corrupt/<step>[.n]`; returns the new path."""
  root = os.path.join(workdir, "checkpoints_corrupt")
  dest, n = os.path.join(root, str(step)), 1
  while runio.exists(dest):
    dest, n = os.path.join(root, f"{step}.{n}"), n + 1
  runio.move_dir(os.path.join(str(directory), str(step)), dest)
  return dest
