"""Run tracking on process 0 only: `DIR/metrics.jsonl` always, wandb when enabled, and
TensorBoard events (moejax.training.tensorboard) with `train.tensorboard`.

A local metrics.jsonl is appended row by row. On an object store (gs://), where an append
rewrites the object, rows are kept in memory and the object is written at each checkpoint
(`sync`, which the loop calls after a save) and at the end, so the run's writes grow
linearly with its checkpoints and every row up to a checkpoint is stored with it.

`wandb.mode=auto` logs online when an API key is configured and offline otherwise (then
`wandb sync DIR/wandb/offline-run-*` uploads later). The run id is kept in
`DIR/wandb_run_id` so a resumed run continues the same wandb run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
from typing import Any

import jax

from moejax import runio
from moejax.training import tensorboard


def git_commit() -> str:
  """The source tree's git commit, or "unknown" outside a checkout."""
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(
      ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
    )
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return out.stdout.strip() if out.returncode == 0 else "unknown"


def wandb_mode(mode: str) -> str:
  """`auto`: the WANDB_MODE environment variable if set, else online when logged in."""
  if mode != "auto":
    return mode
  if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
    return os.environ["WANDB_MODE"]
  try:
    import wandb  # pylint: disable=import-outside-toplevel

    return "online" if wandb.login(prompt=False, verify=False) else "offline"
  except Exception:  # no key store, no network: offline is always safe
    return "offline"


def resume_run(workdir: str, w):
  """The training run's wandb run (`DIR/wandb_run_id`) reopened, to add evaluation results
  to it (the k-grid, the task grids); None when wandb is off (`w`: the run's `wandb`
  section) or the run never logged to wandb."""
  id_path = runio.path(workdir, "wandb_run_id")
  mode = wandb_mode(w.mode)
  if mode == "disabled" or not id_path.exists():
    return None
  import wandb  # pylint: disable=import-outside-toplevel

  return wandb.init(
    project=w.project,
    entity=w.entity or None,
    dir=wandb_dir(workdir),
    id=runio.read_text(id_path).strip(),
    resume="allow",
    mode=mode,
  )


def wandb_dir(workdir: str) -> str:
  """Where wandb keeps its files: the workdir, or a local folder for a remote (gs://) one."""
  if not runio.is_remote(workdir):
    return workdir
  name = workdir.split("://", 1)[1].strip("/").replace("/", "_")
  local = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "wandb", name)
  os.makedirs(local, exist_ok=True)
  return local


def _jsonable(v: Any) -> Any:
  v = float(v) if hasattr(v, "dtype") or isinstance(v, float) else v
  return None if isinstance(v, float) and not math.isfinite(v) else v


class Tracker:
  """Appends metric rows to metrics.jsonl and mirrors them to wandb."""

  def __init__(
    self,
    workdir: str,
    config: dict,
    *,
    mode: str,
    project: str,
    entity: str = "",
    name: str = "",
    tags: str = "",
    events: bool = False,
    start: int = 0,
  ):
    self.path = str(runio.path(workdir, "metrics.jsonl"))
    self.run = None
    self.note = ""
    self.events = tensorboard.Events(workdir, events, start)  # no-op off process 0
    self.buffer = _RemoteLines(self.path) if runio.is_remote(workdir) else None
    if jax.process_index() != 0:
      return
    mode = wandb_mode(mode)
    if mode == "disabled":
      return
    import wandb  # pylint: disable=import-outside-toplevel

    id_path = runio.path(workdir, "wandb_run_id")
    run_id = runio.read_text(id_path).strip() if id_path.exists() else secrets.token_hex(4)
    self.run = wandb.init(
      project=project,
      entity=entity or None,
      name=name or None,
      tags=[t for t in tags.split(",") if t] or None,
      group=config.get("wandb", {}).get("group") or None,  # a sweep's runs share one group
      config=config,
      dir=wandb_dir(workdir),
      id=run_id,
      resume="allow",
      mode=mode,
    )
    runio.write_text(id_path, run_id)
    if mode == "offline":
      where = wandb_dir(workdir)
      self.note = f"wandb is offline; upload with: wandb sync {where}/wandb/offline-run-*"

  def log(self, row: dict[str, Any]) -> None:
    """Writes one row (must contain `step`)."""
    if jax.process_index() != 0:
      return
    row = {k: _jsonable(v) for k, v in row.items()}
    if self.buffer is not None:
      self.buffer.append(json.dumps(row))
    else:
      runio.append_lines(self.path, [json.dumps(row)])
    self.events.scalars(row)
    if self.run is not None:
      self.run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

  def sync(self) -> None:
    """Stores what is buffered (gs:// metrics rows, TensorBoard events): at a checkpoint."""
    if jax.process_index() != 0:
      return
    if self.buffer is not None:
      self.buffer.flush()
    self.events.sync()

  def finish(self) -> None:
    self.sync()
    self.events.close()
    if self.run is not None:
      self.run.finish()


class _RemoteLines:
  """An object-store file's lines, read once, appended in memory, written at `flush`."""

  def __init__(self, path: str):
    self.path = path
    p = runio.path(path)
    self.chunks = [runio.read_text(p)] if jax.process_index() == 0 and p.exists() else []
    self.dirty = False

  def append(self, line: str) -> None:
    self.chunks.append(line + "\n")
    self.dirty = True

  def flush(self) -> None:
    if self.dirty:
      self.chunks = ["".join(self.chunks)]
      runio.write_text(self.path, self.chunks[0])
      self.dirty = False
