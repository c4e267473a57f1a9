"""run_task_grid: every (k1, k2) cell of a run on lm-eval tasks, paired per item against the
native k1 = K cell (docs/kgrid.md "Downstream tasks").

Per task, DIR/eval/tasks/<task>/k_grid.{jsonl,md,png} and each cell's per-item outcomes
(`doc_id`, `filter`, `metric`, `correct`, `prompt_hash`, and `loglik_gold` or `response`).
Row keys: `k1`, `k2`, `metric`, `filter`, `accuracy`, `delta_points`, `flips_to_wrong`,
`flips_to_right`, `mcnemar_p` (exact), `delta_ci95` (paired bootstrap over items, points),
`p_holm` (Holm across the grid's cells but the reference), `n_items` (`rows`). Every cell's
few-shot draws are seeded alike (`fewshot`), and cells pair only on identical prompts.
Everything is checked (tasks, cells, tokenizer on every item) before a file is written.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
from flax import nnx
from lm_eval import evaluator

from moejax import distributed
from moejax.config import grid_labels
from moejax.config.run import RunConfig
from moejax.decode.generator import Generator
from moejax.downstream import chat as chat_lib
from moejax.downstream import fewshot, report, scoring
from moejax.downstream import tasks as tasks_lib
from moejax.downstream.lm import MoejaxLM
from moejax.downstream.loading import imported_from, load_task_model
from moejax.downstream.rows import ROW_KEYS, check_paired, outcomes, task_rows
from moejax.errors import UserError
from moejax.kgrid import cells as cells_lib
from moejax.kgrid import gain as gain_lib
from moejax.kgrid.forward import CellForward
from moejax.kgrid.loading import load_config
from moejax.training import tracking


def _scales(tm, cells, K: int, n_calib: int, batch_size: int) -> dict:
  """{cell: scale_M} of the rescaling cells (`sqrt`; `gain` fitted on held-out windows)."""
  wanted = [c for c in cells if c[1] in cells_lib.RESCALINGS]
  if not wanted:
    return {}
  run = tm.run
  fwd = CellForward(run.graphdef, run.params, run.router, run.n_moe_layers)
  calib = run.heldout_NxL1[:n_calib]
  batches = [
    np.asarray(calib[i : i + batch_size], np.int32) for i in range(0, len(calib), batch_size)
  ]

  def measure_ms(k1: int, scale_M):
    return fwd.run(batches, k1, scale_M=scale_M).layers["routed_out_rms"]

  target = functools.cache(lambda: measure_ms(K, None))
  inputs = lambda k1: gain_lib.ScaleInputs(k1, K, run.n_moe_layers, measure_ms, target)
  return {(k1, k2): cells_lib.RESCALINGS[k2].scale(inputs(k1)) for k1, k2 in wanted}


def generator(tm, batch_size: int) -> Generator:
  """The task model's generator: its scorer's parameters (and dtype) and context length,
  stopping at the tokenizer's EOS."""
  s = tm.scorer
  cfg = nnx.merge(s.graphdef, s.params, s.router).cfg
  eos = (int(tm.tokenizer.eos_id),)
  return Generator(cfg, s.params, s.router, max_length=s.seq_len, batch_size=batch_size,
                   eos_ids=eos)  # fmt: skip


def _cells(rc: RunConfig, k1: str, k2: str) -> tuple[list, list[str]]:
  """The grid's cells (arguments win over the run's eval.k1/k2), the reference first."""
  K, E = rc.moe.top_k, rc.moe.n_experts
  k1s = grid_labels.parse_k1(k1 or rc.eval.k1, K, E)
  labels = grid_labels.parse_k2(k2 or rc.eval.k2, K, E, k1s)
  return cells_lib.cells(k1s, labels, K, E, normalizes=rc.rule.norm != "none")


def _evaluate(lm, name: str, task, limit, fewshot_seed: int, chat: bool) -> list[dict]:
  """lm-eval's per-item samples of one task at the scorer's current cell, its few-shot
  sampler seeded first (every cell draws the same shots: `fewshot`)."""
  fewshot.seed({name: task}, fewshot_seed)
  results = evaluator.evaluate(
    lm, {"tasks": {name: task}}, limit=limit, log_samples=True, bootstrap_iters=0,
    apply_chat_template=chat,
  )  # fmt: skip
  return results["samples"][name]


def run_task_grid(
  workdir: str,
  tasks: str,
  *,
  include_path: str | None = None,
  limit: int | None = None,
  k1: str = "",
  k2: str = "",
  step: int | None = None,
  dtype: str = "float32",
  batch_size: int | None = None,
  resamples: int | None = None,
  num_fewshot: int | None = None,
  fewshot_seed: int = fewshot.FEWSHOT_SEED,
  apply_chat_template: bool = False,
  log=print,
) -> dict[str, list[dict]]:
  """Runs every cell on every task; writes each task's files; returns {task: rows}."""
  if distributed.env_processes() is not None or jax.process_count() > 1:
    raise UserError("--tasks runs in one process; unset JAX_NUM_PROCESSES and launch it once")
  if limit is not None and limit < 1:
    raise UserError(f"--limit={limit} is not allowed; use an int >= 1")
  logging.getLogger("lm_eval").setLevel(logging.ERROR)
  rc = load_config(workdir)
  if rc.moe is None:
    raise UserError(f"{workdir} holds a dense model (model.moe_every=0); nothing to route")
  task_objs = tasks_lib.load_tasks(tasks, include_path)
  fewshot.set_num_fewshot(task_objs, num_fewshot)
  rule, ev = rc.rule, rc.eval
  K, E = rc.moe.top_k, rc.moe.n_experts
  cells, notes = _cells(rc, k1, k2)
  bs = batch_size or ev.batch_size
  tm = load_task_model(workdir, rc, step=step, dtype=dtype, batch_size=bs)
  scales = _scales(tm, cells, K, ev.gain_sequences, bs)
  chat = chat_lib.renderer(imported_from(workdir)) if apply_chat_template else None
  lm = MoejaxLM(tm.scorer, tm.tokenizer, tm.encoding, generator=generator(tm, bs), chat=chat)
  resamples = resamples or ev.bootstrap_resamples
  out = {}
  for name, task in task_objs.items():
    log(f"task {name}: {len(cells)} cells of {workdir} step {tm.run.step}")
    items = {}
    for k1_, k2_ in cells:
      int_k2 = k2_ if isinstance(k2_, int) else None
      tm.scorer.cell = scoring.Cell(k1_, int_k2, scales.get((k1_, k2_)))
      samples = _evaluate(lm, name, task, limit, fewshot_seed, apply_chat_template)
      items[(k1_, k2_)] = outcomes(samples)
    check_paired(cells, items, name)
    out[name] = (task_rows(cells, items, resamples=resamples, seed=rc.train.seed), items)
  rule_name = rc.tree["model"]["moe"]["rule"]
  for name, (rows, items) in out.items():  # every task ran: now write
    title = f"{name}: {rule_name} K={K} E={E} step {tm.run.step}, Δ accuracy vs native k1=K"
    kw = {"title": title, "n_experts": E, "score": rule.score}
    report.write(report.task_dir(workdir, name), rows, items, **kw)
    log(report.markdown(rows, **kw))
    _log_wandb(workdir, rc, name, rows)
  for n in notes:
    log(f"note: {n}")
  return {name: rows for name, (rows, _) in out.items()}


def _log_wandb(workdir: str, rc: RunConfig, task: str, rows: list[dict]) -> None:
  """The task's table into the training run's wandb (same run id), as the loss grid does."""
  run = tracking.resume_run(workdir, rc.wandb)
  if run is None:
    return
  import wandb  # pylint: disable=import-outside-toplevel  (allow-listed: tests/test_imports.py)

  cols = [k for k in ROW_KEYS if k != "delta_ci95"] + ["delta_lo", "delta_hi"]
  data = [[dict(r, k2=str(r["k2"]), delta_lo=r["delta_ci95"][0], delta_hi=r["delta_ci95"][1])[k]
           for k in cols] for r in rows]  # fmt: skip
  run.log({f"eval/tasks/{task}/k_grid": wandb.Table(columns=cols, data=data)})
  run.finish()
