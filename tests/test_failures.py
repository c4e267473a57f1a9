"""Failures in-process: cadences, determinism, stale metrics, corrupt checkpoints, a full
disk, non-finite steps, resume guards (docs/failures.md).

One 12-step config (log 5, eval 7, checkpoint 4) serves every run, so the train step
compiles once (persistent XLA cache, cheap compiles, as in test_train.py).
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failure_helpers import (  # fast_compiles: autouse for this module
  assert_trees_equal,
  fast_compiles,  # noqa: F401
  metric_rows,
  override,
  same_rows,
  tiny,
)
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from moejax.config import base_config
from moejax.errors import UserError
from moejax.kgrid.run import run_grid
from moejax.training import checkpoint, loop, nonfinite, trainer
from moejax.training import workdir as workdir_lib
from runconfig import as_run, saved_eval

STEPS, LOG, EVAL, CKPT = 12, 5, 7, 4
CONFIG = tiny(
  train__steps=STEPS,
  train__log_every=LOG,
  train__eval_every=EVAL,
  train__ckpt_every=CKPT,
  train__keep_checkpoints=5,
)


class Log(list):
  def __call__(self, line):
    self.append(line)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run: (workdir, summary, log lines, abstract state)."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  log = Log()
  summary = trainer.train(as_run(CONFIG), workdir, log=log)
  return workdir, summary, log, trainer.build(as_run(CONFIG), None).state


def final_state(workdir, abstract, step=None):
  return checkpoint.restore(checkpoint.manager(workdir), abstract, step)


def copy_run(src: str, dst) -> str:
  dst = str(dst)
  shutil.copytree(src, dst)
  return dst


def truncate_state(workdir: str, step: int, every_file: bool = False) -> str:
  """Cuts the biggest array file of checkpoint `step` (or every file) in half; returns the
  step dir."""
  step_dir = os.path.join(workdir, "checkpoints", str(step))
  files = [f for f in glob.glob(f"{step_dir}/state/**/*", recursive=True) if os.path.isfile(f)]
  for path in files if every_file else [max(files, key=os.path.getsize)]:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  return step_dir


# ---------------------------------------------------------------- cadences, determinism


def test_log_eval_and_checkpoint_fire_on_their_own_cadence(reference):
  workdir = reference[0]
  rows = metric_rows(workdir)
  logged = [s for s in range(1, STEPS + 1) if s % LOG == 0 or s % EVAL == 0 or s == STEPS]
  evaluated = [s for s in range(1, STEPS + 1) if s % EVAL == 0 or s == STEPS]
  assert [r["step"] for r in rows] == logged  # 5, 7 (eval only), 10, 12
  assert [r["step"] for r in rows if "eval_loss" in r] == evaluated
  saved = [s for s in range(1, STEPS + 1) if s % CKPT == 0 or s == STEPS]
  assert list(checkpoint.manager(workdir).all_steps()) == saved


def test_same_config_and_seed_is_bitwise_identical_and_stale_metrics_are_dropped(
  reference, tmp_path
):
  """A second run in a workdir left with metric rows but no checkpoint (a kill before the
  first save): the stale rows and a half-written line go, and every number repeats."""
  workdir = str(tmp_path / "again")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(f'{{"step": {s}, "loss": 9.0}}\n' for s in range(1, 11))
    f.write('{"step": 11, "lo')
  trainer.train(as_run(CONFIG), workdir, log=Log())
  same_rows(metric_rows(workdir), metric_rows(reference[0]))
  a, b = final_state(workdir, reference[3]), final_state(reference[0], reference[3])
  assert a[0] == b[0] == STEPS and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "final state")


def test_final_heldout_loss_is_the_grids_native_cell(reference):
  workdir, summary, log, _ = reference
  rows = run_grid(
    workdir, saved_eval(workdir, k1="2", k2="native", bootstrap_resamples=1000), log=Log()
  )
  (native,) = [r for r in rows if r["k1"] == 2 and r["k2"] == "native"]
  assert native["loss"] == pytest.approx(summary["eval_loss"], rel=1e-6, abs=1e-6)
  assert any("held-out loss" in line and "eval.sequences" in line for line in log), log


# ---------------------------------------------------------------- corrupt checkpoints


def test_truncated_latest_is_named_and_the_run_resumes_from_the_previous(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "corrupt")
  bad_dir = truncate_state(workdir, STEPS)
  log = Log()
  trainer.train(as_run(CONFIG), workdir, log=log)
  warning = [line for line in log if "unreadable" in line]
  assert warning and bad_dir in warning[0], log
  assert any(f"resumed from {workdir}/checkpoints/{STEPS - CKPT}" in line for line in log), log
  assert os.path.isdir(os.path.join(workdir, "checkpoints_corrupt", str(STEPS)))
  a, b = final_state(workdir, reference[3]), final_state(reference[0], reference[3])
  assert a[0] == STEPS
  assert_trees_equal(a[1], b[1], "state after resuming from the previous checkpoint")
  same_rows(metric_rows(workdir), metric_rows(reference[0]))


def test_an_unfinished_save_is_removed_and_committed_steps_are_kept(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "unfinished")
  ckpt = os.path.join(workdir, "checkpoints")
  committed = sorted(os.listdir(ckpt))
  unfinished = os.path.join(ckpt, f"{STEPS + CKPT}.orbax-checkpoint-tmp-1764892800000000")
  shutil.copytree(os.path.join(ckpt, str(STEPS)), unfinished)  # what a kill mid-save leaves
  assert checkpoint.remove_unfinished_saves(workdir) == [unfinished]
  assert sorted(os.listdir(ckpt)) == committed
  assert checkpoint.remove_unfinished_saves(workdir) == []


def test_no_readable_checkpoint_is_a_clear_error_naming_each(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "all_bad")
  bad = [truncate_state(workdir, s) for s in checkpoint.manager(workdir).all_steps()]
  with pytest.raises(UserError) as info:
    trainer.train(as_run(CONFIG), workdir, log=Log())
  message = str(info.value)
  assert "\n" not in message and "no readable checkpoint" in message
  for step_dir in bad:
    assert step_dir in message and os.path.isdir(step_dir)  # named, nothing moved
  # the evaluator restores params only, so a cut optimizer file would not bother it: cut all
  truncate_state(workdir, CKPT, every_file=True)
  with pytest.raises(UserError) as info:  # the evaluator's --step names it the same way
    run_grid(workdir, saved_eval(workdir, k1="2", k2="native"), step=CKPT, log=Log())
  assert f"checkpoint {workdir}/checkpoints/{CKPT} is unreadable" in str(info.value)


def test_full_disk_during_a_save_keeps_the_last_good_checkpoint(reference, tmp_path, monkeypatch):
  """keep_checkpoints=1 and the save of step 8 fails with ENOSPC: step 4 stays, restorable,
  and rerunning once there is space again finishes with the uninterrupted run's state."""
  c = override(CONFIG, {"train.keep_checkpoints": 1})
  workdir = str(tmp_path / "full")
  real = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def full_disk(self, x, directory):
    if f"/{2 * CKPT}." in str(directory) or str(directory).endswith(f"/{2 * CKPT}/data"):
      raise OSError(errno.ENOSPC, "No space left on device")
    return await real(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full_disk)
  with pytest.raises(trainer.SaveFailed) as info:
    trainer.train(as_run(c), workdir, log=Log())
  monkeypatch.undo()
  message = str(info.value)
  assert f"checkpoints/{2 * CKPT}" in message and f"checkpoints/{CKPT}" in message, message
  assert list(checkpoint.manager(workdir).all_steps()) == [CKPT]
  assert final_state(workdir, reference[3])[0] == CKPT
  trainer.train(as_run(c), workdir, log=Log())
  assert_trees_equal(
    final_state(workdir, reference[3])[1], final_state(reference[0], reference[3])[1], "state"
  )


# ---------------------------------------------------------------- non-finite steps


def poison_router(layer: int):
  """A checkpoint.restore that returns NaN router weights in `layer`: row `layer` of the
  scanned stack (CONFIG's 2 MoE layers are one stack of one block, rows = layers)."""
  real = checkpoint.restore

  def restore(*args, **kwargs):
    step, state, data = real(*args, **kwargs)
    target = "['stacks'][0]['blocks'][0]['mlp']['router']['kernel']"

    def poison(path, x):
      return x.at[layer].multiply(jnp.nan) if target in jax.tree_util.keystr(path) else x

    params = jax.tree_util.tree_map_with_path(poison, state["params"])
    return step, {**state, "params": params}, data

  return restore


def resumable_at_8(reference, dst) -> str:
  workdir = copy_run(reference[0], dst)
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))
  return workdir


def test_nonfinite_stop_names_step_quantity_and_good_checkpoint(reference, tmp_path, monkeypatch):
  workdir = resumable_at_8(reference, tmp_path / "nan")
  monkeypatch.setattr(checkpoint, "restore", poison_router(1))
  with pytest.raises(trainer.Diverged) as info:
    trainer.train(as_run(CONFIG), workdir, log=Log())
  monkeypatch.undo()
  message = str(info.value)
  start = 2 * CKPT
  assert f"non-finite router logits of layer 1 at step {start + 1}" in message, message
  assert f"{workdir}/checkpoints/{start}" in message, message
  assert list(checkpoint.manager(workdir).all_steps()) == [CKPT, start]


def test_nonfinite_skip_counts_and_stops_after_max_skips(reference, tmp_path, monkeypatch):
  workdir = resumable_at_8(reference, tmp_path / "skip")
  c = override(CONFIG, {"train.on_nonfinite": "skip", "train.max_skips": 2})
  monkeypatch.setattr(checkpoint, "restore", poison_router(0))
  with pytest.raises(trainer.Diverged) as info:
    trainer.train(as_run(c), workdir, log=Log())
  monkeypatch.undo()
  message = str(info.value)
  assert "router logits of layer 0 at step 11" in message, message  # 9, 10, 11 skipped
  assert "3 steps in a row" in message and "train.max_skips=2" in message, message
  row10 = [r for r in metric_rows(workdir) if r["step"] == 10]
  assert row10 and row10[0]["skipped_steps"] == 2.0


def test_first_nonfinite_is_in_forward_order():
  values = [1.0, jnp.inf, 2.0, jnp.nan]
  assert int(nonfinite.first_nonfinite(values)) == 2
  assert int(nonfinite.first_nonfinite([1.0, 2.0])) == 0
  assert nonfinite.describe(2, [0, 1]) == "router logits of layer 1"
  assert nonfinite.describe(3, [0, 1]) == "loss"


def test_skip_keeps_the_old_state_and_advances_the_step():
  def step_fn(state, tokens, rng):
    loss = jnp.where(tokens.sum() > 0, jnp.nan, 1.0)
    new = {**state, "step": state["step"] + 1, "params": state["params"] + 1.0}
    return new, {"loss": loss, "grad_norm": jnp.float32(1.0)}

  guarded = jax.jit(nonfinite.guard(step_fn, [], "skip"))
  state = {"step": jnp.int32(0), "params": jnp.zeros(3), "opt_state": jnp.ones(2)}
  bad, m_bad = guarded(state, jnp.ones(2), None)
  good, m_good = guarded(state, jnp.zeros(2), None)
  assert int(bad["step"]) == 1 and np.array_equal(bad["params"], np.zeros(3))
  assert int(m_bad["skipped"]) == 1
  assert nonfinite.describe(int(m_bad["nonfinite"]), []) == "loss"  # no MoE layers here
  assert np.array_equal(good["params"], np.ones(3)) and int(m_good["skipped"]) == 0


# ---------------------------------------------------------------- resume guards, workdir


def test_steps_below_the_checkpoint_is_an_error_and_config_json_is_kept(reference):
  workdir = reference[0]
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    before = f.read()
  with pytest.raises(UserError, match=r"train.steps=10 is below the checkpoint step 12"):
    trainer.train(as_run(override(CONFIG, {"train.steps": 10})), workdir, log=Log())
  with open(path) as f:
    assert f.read() == before


def test_changed_moe_key_on_resume_is_named_in_one_short_line(reference):
  with pytest.raises(UserError) as info:
    workdir_lib.check_resume_config(reference[0], as_run(override(CONFIG, {"model.moe.top_k": 1})))
  message = str(info.value)
  assert message.startswith("model.moe.top_k=1 differs") and len(message) < 200, message


def test_vocab_size_below_the_tokenizers_is_an_error():
  with pytest.raises(UserError, match=r"model.vocab_size=100 .* tokenizer's 257"):
    trainer.build(as_run(override(CONFIG, {"model.vocab_size": 100})), None)


def test_workdir_that_is_a_file_or_unwritable(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for workdir in (str(a_file), str(a_file / "run")):
    with pytest.raises(UserError, match="is a file"):
      workdir_lib.prepare(workdir)
  with pytest.raises(UserError, match="not writable"):
    workdir_lib.prepare("/proc/moejax_run")


def test_divergence_before_any_checkpoint_names_none():
  fields = {f.name: None for f in dataclasses.fields(loop.LoopSetup)}
  cfg = dataclasses.replace(as_run(CONFIG).train, on_nonfinite="stop", max_skips=0)
  setup = loop.LoopSetup(**{**fields, "config": cfg, "moe_layers": [0]})
  with pytest.raises(trainer.Diverged) as info:
    loop.Loop(setup, 0, STEPS).check(3, {"nonfinite": 2})
  message = str(info.value)
  assert "non-finite loss at step 3" in message and "no checkpoint was saved" in message
  assert "checkpoints/" not in message


def test_training_on_an_imported_run_is_refused(tmp_path):
  """A run written by `moejax.hf import` (resolved.hf_import) is for evaluation and export:
  the resume guard refuses it before anything is built or written."""
  saved = base_config().to_dict()
  saved["resolved"] = {"hf_import": {"source": "allenai/OLMoE-1B-7B-0924"}}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(UserError, match="imported from allenai/OLMoE-1B-7B-0924.*not training"):
    workdir_lib.check_resume_config(str(tmp_path), as_run(base_config()))
