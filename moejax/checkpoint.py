"""Orbax checkpoints of a run: train state (params, router biases, optimizer) + data state.

Layout: `DIR/checkpoints/<step>/{state,data}` (orbax step directories). Saving is atomic
(orbax writes to a temporary directory and renames), so an interrupted save never hides
the previous good checkpoint.
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

from moejax.errors import UserError


def manager(workdir: str, keep: int = 3) -> ocp.CheckpointManager:
  """A CheckpointManager on `DIR/checkpoints` keeping the newest `keep` steps."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  directory = os.path.join(workdir, "checkpoints")
  return ocp.CheckpointManager(
    directory if "://" in directory else os.path.abspath(directory),
    options=options,
    item_names=("state", "data"),
  )


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict) -> None:
  """Saves and waits, so a checkpoint reported as written is on disk."""
  mngr.save(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
    force=True,
  )
  mngr.wait_until_finished()


@contextlib.contextmanager
def _native_stderr_muted_on_failure():
  """When orbax fails to read one array, its other in-flight reads fail later on a closed
  event loop and tensorstore prints their tracebacks from C++ straight to fd 2, burying
  the one-line error. During a restore fd 2 goes to /dev/null; on success it is put
  back, on failure it stays muted and Python's sys.stderr writes to the real stderr."""
  sys.stderr.flush()
  real_fd, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
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


def restore(
  mngr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None
) -> tuple[int, Any, dict]:
  """Restores (step, state, data_state); `step=None` takes the latest.

  A missing or unreadable checkpoint raises a one-line `UserError` naming the directory.
  """
  directory = mngr.directory
  steps = mngr.all_steps()
  if not steps:
    raise UserError(f"no checkpoint in {directory}")
  step = max(steps) if step is None else step
  if step not in steps:
    raise UserError(
      f"no checkpoint for step {step} in {directory}; "
      f"available: {', '.join(map(str, sorted(steps)))}"
    )
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
  try:
    with _native_stderr_muted_on_failure():
      out = mngr.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
        ),
      )
  except Exception as e:  # orbax raises many types for truncated or foreign files
    reason = " ".join(str(e).split())[:200]
    raise UserError(
      f"checkpoint {directory}/{step} is unreadable or does not match this "
      f"config ({type(e).__name__}: {reason})"
    ) from None
  return step, out.state, out.data
