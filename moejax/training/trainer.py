"""Training setup: build everything from a config, resume, then hand over to moejax.training.loop."""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax import build as build_lib
from moejax import distributed, sharding
from moejax.backend import compile_options
from moejax.config import checks
from moejax.config.run import RunConfig
from moejax.data.pipeline import Data, make_data
from moejax.errors import UserError
from moejax.nn import model as model_lib
from moejax.sizing import flops, worksheet
from moejax.training import (
  checkpoint,
  compile_cache,
  loop,
  nonfinite,
  optim,
  profiling,
  stopping,
  tracking,
)
from moejax.training import step as step_lib
from moejax.training import workdir as workdir_lib
from moejax.training.loop import Diverged, SaveFailed  # noqa: F401  (public: the CLI catches them)


@dataclasses.dataclass
class Run:
  """Everything a run is built from; shared by the trainer and the evaluator. `config` has
  the tokenizer's vocabulary and the mesh's shard count resolved."""

  config: RunConfig
  data: Data
  graphdef: nnx.GraphDef
  state: dict
  mesh: jax.sharding.Mesh
  n_params: int
  n_active: int
  tx: optax.GradientTransformation
  schedule: optax.Schedule


def check_config(rc: RunConfig, mesh=None) -> jax.sharding.Mesh:
  """The whole config checked before any data loading or compilation; returns the mesh
  (`mesh`: a target's own, e.g. moejax.aot's; default: over this host's devices)."""
  mesh = sharding.make_mesh(rc.mesh) if mesh is None else mesh
  d, t = rc.data, rc.train
  if d.batch_size % (sharding.data_shards(mesh) * t.grad_accum):
    raise UserError(
      f"data.batch_size={d.batch_size} must divide by mesh data×fsdp "
      f"({sharding.data_shards(mesh)}) × train.grad_accum ({t.grad_accum})"
    )
  return mesh


def build(rc: RunConfig, workdir: str | None, mesh=None) -> Run:
  """Data, model, optimizer state and mesh from a config (no checkpoint yet); `mesh`:
  check_config's, when the caller has checked the config already."""
  mesh = check_config(rc) if mesh is None else mesh
  data = make_data(rc.data, seed=rc.train.seed, workdir=workdir)
  rc = rc.with_vocab(data.tokenizer.vocab_size).with_shards(sharding.data_shards(mesh))
  mc = rc.model
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # kernels of the mesh's platform
    model = build_lib.transformer(mc, rc.train.seed)
  graphdef, params, router = step_lib.split_model(model)
  tx, schedule = optim.optimizer(rc.optim, rc.train.steps)
  state = {
    "step": jnp.zeros((), jnp.int32),
    "params": params,
    "router": router,
    "opt_state": tx.init(params),
  }
  state = jax.device_put(state, sharding.state_sharding(state, mesh))
  n_params, n_active = build_lib.count_params(params, mc.moe)
  return Run(rc, data, graphdef, state, mesh, n_params, n_active, tx, schedule)


def resolved_config(run: Run) -> dict:
  """config.json: the full config plus what the run resolved (vocab, corpus, versions)."""
  rc = run.config
  out = dict(rc.tree)
  out["resolved"] = {
    "vocab_size": run.data.tokenizer.vocab_size,
    "vocab_multiple": rc.model.vocab_multiple,  # the embedding's rows: model vocab rounded up
    "padded_vocab_size": rc.model.padded_vocab,
    "data": run.data.describe(),
    "n_params": run.n_params,
    "n_active_params": run.n_active,
    "rule": rc.resolved_rule(),
    "python": sys.version.split()[0],
    "jax": jax.__version__,
    "git_commit": tracking.git_commit(),
    "devices": jax.device_count(),
    "backend": jax.default_backend(),
    "worksheet": worksheet.worksheet(rc).to_dict(),
  }
  return out


def moe_layers(run: Run) -> list[int]:
  """Indices of the MoE layers (their router logits are checked every step)."""
  return model_lib.moe_layers(run.config.model)


def compile_steps(run: Run, layers: list[int] | None = None):
  """(jitted guarded train step, jitted eval step); `layers`: `moe_layers(run)`, if known."""
  rc = run.config
  step_fn = nonfinite.guard(
    step_lib.make_train_step(run.graphdef, run.tx, rc.loss, run.schedule),
    moe_layers(run) if layers is None else layers,
    rc.train.on_nonfinite,
  )
  train_step = compile_options.jit(
    sharding.tracing_mesh(step_fn, run.mesh),
    donate_argnums=0,
    out_shardings=(sharding.state_sharding(run.state, run.mesh), None),
  )
  eval_step = sharding.tracing_mesh(step_lib.make_eval_step(run.graphdef), run.mesh)
  return train_step, compile_options.jit(eval_step)


def heldout_loss(run: Run, eval_step, state, n_sequences: int) -> float:
  """Mean loss over the first `n_sequences` held-out windows (the grid's when
  `n_sequences = eval.sequences`: same windows, same batches)."""
  batches = run.data.eval_batches(n_sequences, run.config.eval.batch_size)
  return loop.mean_loss(step_lib.evaluate_batches(eval_step, state, batches)["loss_N"])


def resume(run: Run, workdir: str, it, log):
  """(manager, start step, state): the newest readable checkpoint, or step 0."""
  t = run.config.train
  for path in checkpoint.remove_unfinished_saves(workdir):
    log(f"removed {path}: a checkpoint save that did not finish (the run was killed mid-save)")
  mngr = checkpoint.manager(workdir, t.keep_checkpoints, t.async_checkpoints)
  mngr, restored = checkpoint.restore_latest_good(workdir, mngr, run.state, log)
  if restored is None:
    return mngr, 0, run.state
  start, state, data_state = restored
  workdir_lib.check_steps(workdir, t.steps, start)
  workdir_lib.check_schedule(workdir, run.config, start)
  it.set_state(data_state)
  log(f"resumed from {mngr.directory}/{start}")
  return mngr, start, state


def prepare_run(rc: RunConfig, workdir: str, mesh, log):
  """(run, train iterator, manager, start step, state): every check passed (the resume
  guards included), the run built and its newest readable checkpoint restored. Nothing of
  the run's own is written yet (config.json, metrics.jsonl): a refusal leaves them as they
  were, and removes a workdir made here."""
  created = workdir_lib.prepare(workdir)
  try:
    workdir_lib.check_output_dirs(workdir, rc.train)
    workdir_lib.check_resume_config(workdir, rc)
    rc = workdir_lib.with_saved_vocab(workdir, rc)  # a run saved unpadded resumes unpadded
    run = build(rc, workdir, mesh)
    batch_sharding = sharding.batch_sharding(run.mesh)
    shard = distributed.process_shard(batch_sharding, rc.data.batch_size)
    it = run.data.train_iterator(shard)
    mngr, step, state = resume(run, workdir, it, log)
  except UserError:
    if created:
      workdir_lib.remove_created(workdir)
    raise
  return run, it, mngr, step, state


def train(rc: RunConfig, workdir: str, *, log=print) -> dict:
  """Trains (resuming from the newest readable checkpoint in `workdir`); returns a summary."""
  t0 = time.time()
  mesh = check_config(rc)
  compile_cache.enable(rc.train.compile_cache)  # before the first compile
  run, it, mngr, start, state = prepare_run(rc, workdir, mesh, log)
  rc, t, d = run.config, rc.train, rc.data
  batch_sharding = sharding.batch_sharding(run.mesh)
  end = max(t.stop_at or t.steps, start)  # stop_at below a checkpoint: done
  resolved = resolved_config(run)
  workdir_lib.reset_metrics(workdir, start)  # the first writes: every check has passed
  workdir_lib.write_config_json(workdir, resolved)
  w = rc.wandb
  tracker = tracking.Tracker(
    workdir,
    resolved,
    mode=w.mode,
    project=w.project,
    entity=w.entity,
    name=w.name,
    tags=w.tags,
    events=t.tensorboard,
    start=start,
  )
  prepared = f" (prepared: {run.data.prepared})" if run.data.prepared else ""
  log(
    f"model: {run.n_params:,} params, {run.n_active:,} active per token; "
    f"data: {run.data.corpus.name}, {run.data.train_tokens:,} train tokens{prepared}; "
    f"unigram baseline {run.data.unigram_entropy:.3f} nats/token"
  )
  if tracker.note:
    log(tracker.note)
  for line in checks.warnings(rc):
    log(line)
  layers = moe_layers(run)
  train_step, eval_step = compile_steps(run, layers)
  bar = _progress(start, end, t.progress)
  setup = loop.LoopSetup(
    config=t,
    step_fn=train_step,
    evaluate=lambda st: heldout_loss(run, eval_step, st, t.eval_sequences),
    next_tokens=lambda: distributed.global_batch(next(it)["tokens"], batch_sharding, d.batch_size),
    data_state=it.get_state,
    mngr=mngr,
    write_row=tracker.log,
    synced=tracker.sync,
    rng=jax.random.key(t.seed),
    moe_layers=layers,
    tokens_per_step=d.batch_size * d.seq_len,
    log=log,
    progress=bar,
    perf=flops.Perf.for_run(rc.model, d.seq_len),
    profiler=profiling.Profiler(t.profile_steps, workdir, log),
  )
  try:
    with stopping.StopRequest().installed() as stop:
      result = loop.Loop(setup, start, end).run(state, stop)
  finally:  # also on Diverged / errors: no orbax or wandb threads left behind
    setup.profiler.stop()
    bar.close()
    mngr.close()
    tracker.finish()
  return _summarize(run, workdir, eval_step, result, start, t0, log)


def _summarize(run: Run, workdir: str, eval_step, result: loop.LoopResult, start, t0, log):
  """The end-of-training held-out loss, on the grid's sequences (eval.sequences)."""
  rc = run.config
  eval_loss = None
  if result.stopped_by is None and result.step > start:
    eval_loss = heldout_loss(run, eval_step, result.state, rc.eval.sequences)
    n = min(rc.eval.sequences, run.data.heldout_windows.shape[0])
    log(
      f"held-out loss {eval_loss:.3f} nats/token on {n} held-out sequences (eval.sequences: "
      f"the grid's native k1=K cell uses the same ones) vs unigram baseline "
      f"{run.data.unigram_entropy:.3f} ({time.time() - t0:.0f} s)"
    )
  elif result.step == start and result.stopped_by is None:
    log(f"already trained to step {start}; nothing to do")
  if result.skipped:
    log(f"skipped {result.skipped} non-finite steps (train.on_nonfinite=skip)")
  log(f"outputs: {workdir}/config.json, {workdir}/metrics.jsonl, {workdir}/checkpoints/")
  return {
    "workdir": workdir,
    "steps": rc.train.steps,
    "step": result.step,
    "eval_loss": eval_loss,
    "stopped_by": result.stopped_by,
    "skipped": result.skipped,
    "unigram_entropy": run.data.unigram_entropy,
    "seconds": time.time() - t0,
  }


def _progress(start: int, total: int, enabled: bool):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel

  return tqdm(
    total=total,
    initial=start,
    disable=not enabled,
    dynamic_ncols=True,
    desc="train",
    file=sys.stderr,
  )
