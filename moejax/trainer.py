"""The training loop: build everything from a config, resume, train, evaluate, checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from moejax import checkpoint, distributed, optim, runio, sharding, tracking
from moejax import config as config_lib
from moejax import step as step_lib
from moejax.data import Data, make_data
from moejax.errors import UserError
from moejax.model import Transformer

# Config sections that must match the workdir's config.json to resume.
FROZEN_SECTIONS = ("model", "data")


class Diverged(RuntimeError):
  """The loss became NaN or inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class Run:
  """Everything a run is built from; shared by the trainer and the evaluator."""

  config: ml_collections.ConfigDict
  data: Data
  graphdef: nnx.GraphDef
  state: dict
  mesh: jax.sharding.Mesh
  n_params: int
  n_active: int
  tx: optax.GradientTransformation
  schedule: optax.Schedule


def count_params(params, moe_cfg) -> tuple[int, int]:
  """(total, active per token): routed experts count K/E of their weights as active."""
  total = active = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = [str(getattr(k, "key", k)) for k in path]
    total += leaf.size
    share = moe_cfg.top_k / moe_cfg.n_experts if moe_cfg and "experts" in names else 1.0
    active += int(leaf.size * share)
  return total, active


def build(c: ml_collections.ConfigDict, workdir: str | None) -> Run:
  """Data, model, optimizer state and mesh from a validated config (no checkpoint yet)."""
  config_lib.validate(c)
  mesh = sharding.make_mesh(c.mesh)
  if c.data.batch_size % (sharding.data_shards(mesh) * c.train.grad_accum):
    raise UserError(
      f"data.batch_size={c.data.batch_size} must divide by mesh data×fsdp "
      f"({sharding.data_shards(mesh)}) × train.grad_accum ({c.train.grad_accum})"
    )
  data = make_data(c.data, seed=c.train.seed, workdir=workdir)
  mc = config_lib.model_config(c, data.tokenizer.vocab_size)
  model = Transformer(mc, rngs=nnx.Rngs(c.train.seed))
  graphdef, params, router = step_lib.split_model(model)
  tx, schedule = optim.optimizer(c)
  state = {
    "step": jnp.zeros((), jnp.int32),
    "params": params,
    "router": router,
    "opt_state": tx.init(params),
  }
  state = jax.device_put(state, sharding.state_sharding(state, mesh))
  n_params, n_active = count_params(params, mc.moe)
  return Run(c, data, graphdef, state, mesh, n_params, n_active, tx, schedule)


def resolved_config(run: Run) -> dict:
  """config.json: the full config plus what the run resolved (vocab, corpus, versions)."""
  out = run.config.to_dict()
  out["resolved"] = {
    "vocab_size": run.data.tokenizer.vocab_size,
    "data": run.data.describe(),
    "n_params": run.n_params,
    "n_active_params": run.n_active,
    "python": sys.version.split()[0],
    "jax": jax.__version__,
    "git_commit": tracking.git_commit(),
    "devices": jax.device_count(),
    "backend": jax.default_backend(),
  }
  return out


def check_resume_config(workdir: str, c: ml_collections.ConfigDict) -> None:
  """Resuming with a different model or data config would silently change the run."""
  saved = config_lib.read_saved(workdir)
  if saved is None:
    return
  path = os.path.join(workdir, "config.json")
  for section in FROZEN_SECTIONS:
    for key, value in c[section].to_dict().items():
      if saved.get(section, {}).get(key, value) != value:
        raise UserError(
          f"{section}.{key}={value!r} differs from {path} "
          f"({saved[section][key]!r}); resume with the same value or use a new "
          f"--workdir"
        )


def train(c: ml_collections.ConfigDict, workdir: str, *, log=print) -> dict:
  """Trains (resuming from the latest checkpoint in `workdir`) and returns a summary."""
  runio.path(workdir).mkdir(parents=True, exist_ok=True)
  check_resume_config(workdir, c)
  run = build(c, workdir)
  mngr = checkpoint.manager(workdir, c.train.keep_checkpoints)
  batch_sharding = sharding.batch_sharding(run.mesh)
  it = run.data.train_iterator(distributed.process_shard(batch_sharding, c.data.batch_size))
  state, start = run.state, 0
  if mngr.latest_step() is not None:
    start, state, data_state = checkpoint.restore(mngr, run.state)
    it.set_state(data_state)
    tracking.truncate_metrics(workdir, start)
    log(f"resumed from {workdir}/checkpoints/{start}")
  resolved = resolved_config(run)
  if distributed.is_main():
    runio.write_text(runio.path(workdir, "config.json"), json.dumps(resolved, indent=2))

  lc = step_lib.LossConfig.from_config(c, n_shards=sharding.data_shards(run.mesh))
  state_shardings = sharding.state_sharding(state, run.mesh)
  train_step = jax.jit(
    step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule),
    donate_argnums=0,
    out_shardings=(state_shardings, None),
  )
  eval_step = jax.jit(step_lib.make_eval_step(run.graphdef))
  eval_batches = run.data.eval_batches(c.train.eval_sequences, c.eval.batch_size)
  tracker = tracking.Tracker(
    workdir,
    resolved,
    mode=c.wandb.mode,
    project=c.wandb.project,
    entity=c.wandb.entity,
    name=c.wandb.name,
    tags=c.wandb.tags,
  )
  log(
    f"model: {run.n_params:,} params, {run.n_active:,} active per token; "
    f"data: {run.data.corpus.name}, {run.data.train_tokens:,} train tokens; "
    f"unigram baseline {run.data.unigram_entropy:.3f} nats/token"
  )
  if tracker.note:
    log(tracker.note)

  rng = jax.random.key(c.train.seed)
  tokens_per_step = c.data.batch_size * c.data.seq_len
  bar = _progress(start, c.train.stop_at or c.train.steps, c.train.progress)
  last_saved, t0, t_last, step_last = start, time.time(), time.time(), start
  eval_loss = None
  end = c.train.stop_at or c.train.steps
  try:
    for step in range(start, end):
      tokens = distributed.global_batch(next(it)["tokens"], batch_sharding, c.data.batch_size)
      state, metrics = train_step(state, tokens, jax.random.fold_in(rng, step))
      done = step + 1
      is_last = done == end
      if done % c.train.log_every == 0 or done % c.train.ckpt_every == 0 or is_last:
        row = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not (np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"])):
          raise Diverged(
            f"loss {row['loss']}, grad norm {row['grad_norm']} at step {done}; stopped. The "
            f"last good checkpoint is {workdir}/checkpoints/{last_saved}"
          )
        now = time.time()
        row["tokens_per_sec"] = (done - step_last) * tokens_per_step / max(now - t_last, 1e-9)
        t_last, step_last = now, done
        if done % c.train.eval_every == 0 or is_last:
          held_out = step_lib.evaluate_batches(eval_step, state, eval_batches)["loss_N"]
          eval_loss = row["eval_loss"] = float(np.mean(held_out, dtype=np.float64))
        if done % c.train.log_every == 0 or is_last:
          tracker.log({"step": done, **row})
          bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_sec']:.0f}")
        if done % c.train.ckpt_every == 0 or is_last:
          checkpoint.save(mngr, done, state, it.get_state())
          last_saved = done
      bar.update(1)
  finally:  # also on Diverged / Ctrl-C: no orbax or wandb threads left behind
    bar.close()
    mngr.close()
    tracker.finish()
  summary = {
    "workdir": workdir,
    "steps": c.train.steps,
    "eval_loss": eval_loss,
    "unigram_entropy": run.data.unigram_entropy,
    "seconds": time.time() - t0,
  }
  if eval_loss is not None:
    log(
      f"held-out loss {eval_loss:.3f} nats/token vs unigram baseline "
      f"{run.data.unigram_entropy:.3f} ({time.time() - t0:.0f} s)"
    )
  log(f"outputs: {workdir}/config.json, {workdir}/metrics.jsonl, {workdir}/checkpoints/")
  return summary


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
