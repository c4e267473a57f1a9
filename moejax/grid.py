"""Runs the k1:k2 grid of a training run's checkpoint and writes DIR/eval/ (DESIGN.md §7).

Deltas are paired per sequence against the native k1 = K cell: a seeded percentile
bootstrap CI of the mean difference and a two-sided paired t-test p-value.
"""

from __future__ import annotations

import json
import os

from moejax.errors import UserError


def load_config(workdir: str):
  """The run's saved config, with defaults for keys added since (config.from_saved)."""
  from moejax import config  # pylint: disable=import-outside-toplevel

  saved = config.read_saved(workdir)
  if saved is None:
    raise UserError(
      f"{os.path.join(workdir, 'config.json')} not found; --workdir must be a moejax training run"
    )
  return config.from_saved(saved)


def run_grid(
  workdir: str,
  *,
  step: int | None = None,
  k1: str = "",
  k2: str = "",
  sequences: int | None = None,
  batch_size: int | None = None,
  resamples: int | None = None,
  log=print,
) -> list[dict]:
  """Runs every cell and writes the grid files; returns the rows."""
  from moejax import checkpoint, distributed, grid_report, kgrid, runio, trainer  # pylint: disable=import-outside-toplevel

  c = load_config(workdir)
  c.mesh.data = -1  # evaluate on whatever devices this machine has
  c.mesh.fsdp = c.mesh.expert = 1
  for name, value, minimum in (
    ("--sequences", sequences, 1),
    ("--batch_size", batch_size, 1),
    ("--resamples", resamples, 1000),
  ):
    if value is not None and value < minimum:
      raise UserError(f"{name}={value} is not allowed; use an int >= {minimum}")
  if c.model.moe_every == 0:
    raise UserError(f"{workdir} holds a dense model (model.moe_every=0); nothing to route")
  K, E = c.model.moe.top_k, c.model.moe.n_experts
  k1s = kgrid.parse_k1(k1 or c.eval.k1, K, E)  # arguments win over the run's eval.k1/k2
  cells = kgrid.cells(k1s, kgrid.parse_k2(k2 or c.eval.k2, K, E, k1s), K, E)
  mngr = checkpoint.manager(workdir, c.train.keep_checkpoints)
  if mngr.latest_step() is None:
    raise UserError(f"no checkpoint in {workdir}/checkpoints; train first")
  run = trainer.build(c, workdir)
  step, state, _ = checkpoint.restore(mngr, run.state, step)
  batches = run.data.eval_batches(sequences or c.eval.sequences, batch_size or c.eval.batch_size)
  resamples = resamples or c.eval.bootstrap_resamples
  log(
    f"k-grid of {workdir} step {step}: {len(cells)} cells on "
    f"{sum(b.shape[0] for b in batches)} held-out sequences"
  )
  results = {cell: kgrid.evaluate_cell(run.graphdef, state, batches, *cell) for cell in cells}
  ref = results[(K, "native")]
  rows = [
    dict(kgrid.row(cell, results[cell], ref, resamples=resamples, seed=c.train.seed), step=step)
    for cell in cells
  ]
  if not distributed.is_main():  # every process evaluates; process 0 writes
    return rows
  title = f"{c.model.moe.rule} K={K} E={E} step {step}: Δ loss vs native k1=K"
  with runio.local_dir(os.path.join(workdir, "eval")) as out:  # gs://: written on exit
    runio.write_text(os.path.join(out, "k_grid.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    grid_report.write_markdown(rows, os.path.join(out, "k_grid.md"), title=title)
    grid_report.write_heatmap(rows, os.path.join(out, "k_grid.png"), title=title)
    _log_wandb(workdir, c, rows, os.path.join(out, "k_grid.png"))
  return rows


def _log_wandb(workdir: str, c, rows: list[dict], png: str) -> None:
  """Adds the grid to the training run's wandb (same run id) when wandb is on."""
  from moejax import runio  # pylint: disable=import-outside-toplevel
  from moejax.tracking import wandb_dir, wandb_mode  # pylint: disable=import-outside-toplevel

  id_path = runio.path(workdir, "wandb_run_id")
  mode = wandb_mode(c.wandb.mode)
  if mode == "disabled" or not id_path.exists():
    return
  import wandb  # pylint: disable=import-outside-toplevel

  run = wandb.init(
    project=c.wandb.project,
    entity=c.wandb.entity or None,
    dir=wandb_dir(workdir),
    id=runio.read_text(id_path).strip(),
    resume="allow",
    mode=mode,
  )
  columns = [
    "k1",
    "k2",
    "loss",
    "accuracy",
    "delta",
    "delta_lo",
    "delta_hi",
    "p_value",
    "routed_mass",
    "gain",
  ]
  table = wandb.Table(
    columns=columns,
    data=[
      [
        r["k1"],
        str(r["k2"]),
        r["loss"],
        r["accuracy"],
        r["delta"],
        *r["delta_ci95"],
        r["p_value"],
        r["routed_mass"],
        r["gain"],
      ]
      for r in rows
    ],
  )
  run.log({"eval/k_grid": table, "eval/k_grid_heatmap": wandb.Image(png)})
  run.finish()
