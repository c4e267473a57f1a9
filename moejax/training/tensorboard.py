"""TensorBoard events beside metrics.jsonl (`train.tensorboard`), through tensorboardX, on
process 0: each metric row's numbers as scalars, and the k-grid's table (text) and heatmap
(image) at its step. Events go to `WORKDIR/tensorboard/`; for a gs:// workdir they are
written to a local folder and copied there at each checkpoint and at the end (`sync`).
`tensorboard --logdir WORKDIR/tensorboard` shows them.

A resumed run's writer purges the steps after the checkpoint it resumed from (TensorBoard's
`purge_step`), as `workdir.reset_metrics` drops them from metrics.jsonl.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import jax
import numpy as np
from PIL import Image

from moejax import runio


def directory(workdir: str) -> str:
  return os.path.join(workdir, "tensorboard")  # os.path.join keeps gs:// as it is


def _summary_writer(logdir: str, purge_step: int | None):
  # tensorboardX imports torch when it is installed (seconds): only when events are on.
  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

  return SummaryWriter(logdir=logdir, purge_step=purge_step, flush_secs=30)


class Events:
  """A run's event writer; every method is a no-op when off or off process 0."""

  def __init__(self, workdir: str, enabled: bool, start: int = 0):
    self.writer, self.remote = None, None
    if not enabled or jax.process_index() != 0:
      return
    logdir = directory(workdir)
    if runio.is_remote(logdir):
      self.remote, logdir = logdir, tempfile.mkdtemp(prefix="moejax-tb-")
    self.local = logdir
    self.writer = _summary_writer(logdir, start if start > 0 else None)

  def scalars(self, row: dict) -> None:
    """The finite numbers of a metric row (which holds `step`), one scalar each."""
    if self.writer is None:
      return
    for name, value in row.items():
      if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
        self.writer.add_scalar(name, value, int(row["step"]))

  def grid(self, step: int, markdown: str, png: str) -> None:
    """The k-grid at `step`: its table (k_grid.md) as text, its heatmap as an image."""
    if self.writer is None:
      return
    self.writer.add_text("eval/k_grid", markdown, step)
    with Image.open(png) as image:
      pixels = np.asarray(image.convert("RGB"))
    self.writer.add_image("eval/k_grid_heatmap", pixels, step, dataformats="HWC")

  def sync(self) -> None:
    """Flushes the events; for gs://, copies the local event files there."""
    if self.writer is None:
      return
    self.writer.flush()
    if self.remote is not None:
      for name in sorted(os.listdir(self.local)):
        (runio.path(self.remote) / name).write_bytes(runio.path(self.local, name).read_bytes())

  def close(self) -> None:
    if self.writer is None:
      return
    self.sync()
    self.writer.close()
    if self.remote is not None:
      shutil.rmtree(self.local, ignore_errors=True)
    self.writer = None
