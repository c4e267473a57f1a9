"""run_grid: every cell of a checkpoint's k1:k2 grid, written to DIR/eval/ (docs/design.md §7).

Without `step` the latest checkpoint is evaluated into DIR/eval/k_grid.{jsonl,md,png}; with
`step=N`, checkpoint N into DIR/eval/step{N}/. Deltas are paired per sequence against the
native k1 = K cell (seeded bootstrap CI, paired t-test). The `gain` cell's scales are fitted
on the held-out windows that follow the evaluated ones (`gain_sequences` of them), so the
calibration split never overlaps the evaluated sequences.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from moejax import distributed, runio
from moejax.config import grid_labels
from moejax.config.run import RunConfig
from moejax.config.sections import EvalConfig
from moejax.data import corpora
from moejax.data.config import DataConfig
from moejax.errors import UserError
from moejax.kgrid import cells as cells_lib
from moejax.kgrid import gain as gain_lib
from moejax.kgrid import report
from moejax.kgrid import rows as rows_lib
from moejax.kgrid.forward import CellForward, CellResult
from moejax.kgrid.loading import load_config, load_run
from moejax.training import tensorboard, tracking


def _batches(windows_NxL1: np.ndarray, batch_size: int) -> list[np.ndarray]:
  return [
    np.ascontiguousarray(windows_NxL1[i : i + batch_size], np.int32)
    for i in range(0, len(windows_NxL1), batch_size)
  ]


def _split(
  windows_NxL1, n_eval: int, n_calib: int, log, fitted: str
) -> tuple[np.ndarray, np.ndarray]:
  """(evaluated, calibration) windows: the first n_eval, then up to n_calib after them for
  the `fitted` cells (the calibrated rescalings)."""
  have = windows_NxL1.shape[0]
  if have < n_eval:
    log(f"held-out split has {have} windows, < the {n_eval} requested; using {have}")
  evaluated, calib = windows_NxL1[:n_eval], windows_NxL1[n_eval : n_eval + n_calib]
  if n_calib and len(calib) == 0:
    raise UserError(
      f"--k2 {fitted} needs calibration windows after the {len(evaluated)} evaluated ones, and "
      f"the held-out split has {have}; lower --sequences or drop {fitted}"
    )
  if n_calib and len(calib) < n_calib:
    log(f"{fitted}: calibration split has {len(calib)} windows (< {n_calib} requested)")
  return evaluated, calib


def _output_dir(workdir: str, step: int | None) -> str:
  return os.path.join(workdir, "eval", *([] if step is None else [f"step{step}"]))


def run_grid(
  workdir: str, ev: EvalConfig | None = None, *, step: int | None = None, log=print
) -> list[dict]:
  """Runs every cell of the grid `ev` (None: the run's saved `eval.*`; the evaluate CLI's
  flags set keys of it) on checkpoint `step` (None: the latest) and writes the grid files;
  returns the rows."""
  rc = load_config(workdir)
  ev = rc.eval if ev is None else ev
  if rc.moe is None:
    raise UserError(f"{workdir} holds a dense model (model.moe_every=0); nothing to route")
  K, E = rc.moe.top_k, rc.moe.n_experts
  k1s = grid_labels.parse_k1(ev.k1, K, E)
  labels = grid_labels.parse_k2(ev.k2, K, E, k1s)
  cells, notes = cells_lib.cells(k1s, labels, K, E, normalizes=rc.rule.norm != "none")
  run = load_run(workdir, rc, step)
  fitted = cells_lib.calibrated(labels)
  n_calib = ev.gain_sequences if fitted else 0
  evaluated, calib = _split(run.heldout_NxL1, ev.sequences, n_calib, log, ",".join(fitted))
  bs = ev.batch_size
  batches = _batches(evaluated, bs)
  log(
    f"k-grid of {workdir} step {run.step}: {len(cells)} cells on {len(evaluated)} held-out "
    f"sequences" + (f", gain fitted on the next {len(calib)}" if n_calib else "")
  )
  fwd = CellForward(run.graphdef, run.params, run.router, run.n_moe_layers)
  results, scales = _run_cells(fwd, cells, batches, _batches(calib, bs), K, run.n_moe_layers)
  ref = results[(K, grid_labels.NATIVE)]
  resamples = ev.bootstrap_resamples
  heldout = heldout_info(rc.data, len(evaluated), len(run.heldout_NxL1))
  rows = [
    dict(
      rows_lib.row(
        cell, results[cell], ref, resamples=resamples, seed=rc.train.seed, scale_M=scales.get(cell)
      ),
      step=run.step,
      heldout=heldout,
    )
    for cell in cells
  ]
  if distributed.is_main():  # every process evaluates; process 0 writes
    _write(rows, rc, notes, _output_dir(workdir, step), workdir)
  return rows


def heldout_info(d: DataConfig, n_sequences: int, n_windows: int) -> dict:
  """The evaluated held-out data, recorded in every row and in k_grid.md's header."""
  return {
    "corpus": d.corpus,
    "paths": corpora.corpus_paths(d),
    "tokenizer": d.tokenizer,
    "holdout_fraction": d.holdout_fraction,
    "sequences": n_sequences,
    "tokens": n_sequences * d.seq_len,  # next-token predictions scored
    "windows_available": n_windows,
  }


def _run_cells(
  fwd: CellForward, cells, batches, calib_batches, K: int, n_moe: int
) -> tuple[dict, dict]:
  """{cell: CellResult} and {cell: scale_M} for the rescaling cells (cells.RESCALINGS)."""
  results: dict[cells_lib.Cell, CellResult] = {}
  scales: dict[cells_lib.Cell, np.ndarray] = {}

  def measure_ms(k1: int, scale_M) -> np.ndarray:
    return fwd.run(calib_batches, k1, scale_M=scale_M).layers["routed_out_rms"]

  target_ms = functools.cache(lambda: measure_ms(K, None))
  for k1, k2 in cells:
    rescaling = cells_lib.RESCALINGS.get(k2)
    scale_M = None
    if rescaling is not None:
      scale_M = rescaling.scale(gain_lib.ScaleInputs(k1, K, n_moe, measure_ms, target_ms))
    int_k2 = k2 if isinstance(k2, int) else None
    results[(k1, k2)] = fwd.run(batches, k1, k2=int_k2, scale_M=scale_M)
    if scale_M is not None:
      scales[(k1, k2)] = scale_M
  return results, scales


def _write(rows: list[dict], rc: RunConfig, notes, out_dir: str, workdir: str) -> None:
  """k_grid.{jsonl,md,png} into `out_dir` (staged locally and uploaded for gs://)."""
  K, E, name = rc.moe.top_k, rc.moe.n_experts, rc.tree["model"]["moe"]["rule"]
  title = f"{name} K={K} E={E} step {rows[0]['step']}: Δ loss vs native k1=K"
  kw = {"title": title, "n_experts": E, "score": rc.rule.score}
  with runio.local_dir(out_dir) as out:
    runio.write_text(os.path.join(out, "k_grid.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    report.write_markdown(
      rows, os.path.join(out, "k_grid.md"), notes=notes, heldout=rows[0].get("heldout"), **kw
    )
    report.write_heatmap(rows, os.path.join(out, "k_grid.png"), **kw)
    _log_wandb(workdir, rc, rows, os.path.join(out, "k_grid.png"))
    _log_tensorboard(workdir, rc, rows[0]["step"], out)


def _log_tensorboard(workdir: str, rc: RunConfig, step: int, out: str) -> None:
  """The grid's table and heatmap into the run's TensorBoard events (`train.tensorboard`)."""
  events = tensorboard.Events(workdir, rc.train.tensorboard)
  try:
    events.grid(
      step, runio.read_text(os.path.join(out, "k_grid.md")), os.path.join(out, "k_grid.png")
    )
  finally:
    events.close()


WANDB_COLUMNS = (
  "k1", "k2", "loss", "accuracy", "delta", "delta_lo", "delta_hi", "p_value", "mass_k1",
  "mass_K", "mass_k2", "coef_sum", "shared_coef", "routed_rms", "gain", "moe_rms", "moe_gain",
)  # fmt: skip


def _log_wandb(workdir: str, rc: RunConfig, rows: list[dict], png: str) -> None:
  """Adds the grid to the training run's wandb (same run id) when wandb is on."""
  run = tracking.resume_run(workdir, rc.wandb)
  if run is None:
    return
  import wandb  # pylint: disable=import-outside-toplevel  (allow-listed: tests/test_imports.py)

  data = []
  for r in rows:
    flat = dict(r, k2=str(r["k2"]), delta_lo=r["delta_ci95"][0], delta_hi=r["delta_ci95"][1])
    data.append([flat[name] for name in WANDB_COLUMNS])
  table = wandb.Table(columns=list(WANDB_COLUMNS), data=data)
  run.log({"eval/k_grid": table, "eval/k_grid_heatmap": wandb.Image(png)})
  K, E = rc.moe.top_k, rc.moe.n_experts
  run.summary.update(cells_lib.quarter_summary(rows, K, E))
  run.finish()
