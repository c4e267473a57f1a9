"""optim.schedule (moejax.training.schedules): each shape against its formula written here in
NumPy, cosine bitwise as before issue 53, and the resume across budgets (a WSD run's stable
phase continued into a longer train.steps, bitwise as a run launched with it)."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import optax
import pytest
from failure_helpers import assert_trees_equal, fast_compiles, metric_rows, tiny  # noqa: F401
from runconfig import as_run
from tiers import FULL

from moejax.config import sections
from moejax.errors import UserError
from moejax.training import checkpoint, schedules, trainer, workdir

LR, RATIO, WARMUP = 3e-3, 0.1, 5


def optim(**values) -> sections.OptimConfig:
  return sections.OptimConfig(**{"lr": LR, "min_lr_ratio": RATIO, "warmup_steps": WARMUP, **values})


def reference(steps: int, after) -> np.ndarray:
  """The warmup by hand, then `after(i, rest)` for i counted from the warmup's end."""
  final, out = LR * RATIO, []
  for n in range(steps + 3):  # a few steps past the end: the schedule holds its last value
    if n < WARMUP:
      out.append(LR * n / WARMUP)
    else:
      out.append(after(n - WARMUP, steps - WARMUP, final))
  return np.array(out)


def test_cosine_is_bitwise_the_schedule_before_issue_53():
  steps = 50
  old = optax.warmup_cosine_decay_schedule(  # optim.schedule's code before issue 53
    init_value=0.0, peak_value=LR, warmup_steps=WARMUP, decay_steps=steps, end_value=LR * RATIO
  )
  new = schedules.make(optim(), steps)
  assert np.array_equal(schedules.values(old, steps + 3), schedules.values(new, steps + 3))
  cos = reference(
    steps, lambda i, n, f: f + (LR - f) * 0.5 * (1 + math.cos(math.pi * min(i / n, 1)))
  )
  np.testing.assert_allclose(schedules.values(new, steps + 3), cos, rtol=2e-6, atol=1e-9)


def test_linear_and_constant_follow_their_formulas():
  steps = 40
  line = reference(steps, lambda i, n, f: LR + (f - LR) * min(i / n, 1))
  got = schedules.values(schedules.make(optim(schedule="linear"), steps), steps + 3)
  np.testing.assert_allclose(got, line, rtol=2e-6, atol=1e-9)
  flat = reference(steps, lambda i, n, f: LR)
  got = schedules.values(schedules.make(optim(schedule="constant"), steps), steps + 3)
  np.testing.assert_allclose(got, flat, rtol=2e-6, atol=1e-9)


SHAPES = {
  "linear": lambda t: 1 - t,
  "cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t)),
  "1-sqrt": lambda t: 1 - math.sqrt(t),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_wsd_is_stable_then_decays_over_its_fraction(shape):
  steps, fraction = 40, 0.25  # decay over the last 10 steps: 30..39
  decay = 10

  def after(i, n, final):
    t = min(max(i - (n - decay), 0) / decay, 1)
    return LR if i < n - decay else final + (LR - final) * SHAPES[shape](t)

  o = optim(schedule="wsd", decay_fraction=fraction, decay_shape=shape)
  got = schedules.values(schedules.make(o, steps), steps + 3)
  np.testing.assert_allclose(got, reference(steps, after), rtol=2e-6, atol=1e-9)
  assert np.all(got[WARMUP : steps - decay] == np.float32(LR))  # stable: lr itself, bitwise
  assert got[steps - decay + 1] < LR and math.isclose(got[steps], LR * RATIO, rel_tol=1e-6)


def test_the_registries_are_the_documented_choices():
  assert tuple(schedules.SCHEDULES) == sections.SCHEDULES
  assert tuple(schedules.DECAY_SHAPES) == sections.DECAY_SHAPES
  with pytest.raises(UserError, match="optim.schedule='step' is not allowed"):
    optim(schedule="step")
  with pytest.raises(UserError, match="optim.decay_fraction"):
    optim(decay_fraction=0.0)


def test_trained_steps_match_only_where_the_learning_rates_do():
  wsd = optim(schedule="wsd", decay_fraction=0.2)  # 20 steps: stable to 16; 40: to 32
  short, long = schedules.make(wsd, 20), schedules.make(wsd, 40)
  assert schedules.trained_steps_match(short, long, 17)  # the decay's step 16 (t = 0) is lr
  assert not schedules.trained_steps_match(short, long, 18)  # step 17 decayed in the short run
  cos20, cos40 = schedules.make(optim(), 20), schedules.make(optim(), 40)
  assert schedules.trained_steps_match(cos20, cos40, WARMUP + 1)  # the warmup is shared
  assert not schedules.trained_steps_match(cos20, cos40, WARMUP + 2)


def saved_run(path, steps: int, **optim_values) -> str:
  """A workdir holding only the config.json of a run of `steps` steps."""
  c = tiny(train__steps=steps, **{f"optim__{k}": v for k, v in optim_values.items()})
  (path / "config.json").write_text(json.dumps(c.to_dict()))
  return str(path)


def test_resume_check_refuses_a_changed_budget_under_cosine(tmp_path):
  run = saved_run(tmp_path, 6)
  longer = tiny(train__steps=12)
  with pytest.raises(UserError, match=r"train.steps=12 changes the learning rate .* step 4 .* 6"):
    workdir.check_schedule(run, as_run(longer), 4)
  workdir.check_schedule(run, as_run(longer), 2)  # still in the shared warmup (2 steps): exact
  with pytest.raises(UserError, match=r"optim.lr=0.01 changes the learning rate"):
    workdir.check_schedule(run, as_run(tiny(train__steps=6, optim__lr=0.01)), 4)


def test_resume_check_allows_a_longer_wsd_budget_from_its_stable_phase(tmp_path):
  run = saved_run(tmp_path, 10, schedule="wsd", decay_fraction=0.2)  # stable to step 8
  longer = tiny(train__steps=20, optim__schedule="wsd", optim__decay_fraction=0.2)
  workdir.check_schedule(run, as_run(longer), 9)  # steps 0..8: the decay's first step is still lr
  with pytest.raises(UserError, match="train.steps=20"):
    workdir.check_schedule(run, as_run(longer), 10)


WSD = {"optim__schedule": "wsd", "optim__decay_fraction": 0.2, "train__ckpt_every": 4}
QUIET = {"log": lambda *a: None}


@FULL
def test_a_wsd_run_resumed_with_a_longer_budget_is_bitwise_one_launched_with_it(tmp_path):
  """10 steps (stable to 8), stopped at 4; resumed with train.steps=16, in its workdir and
  in a new one holding its config.json and checkpoint 4 (docs/training.md): as 16 from the
  start."""
  branch, copy, whole = (str(tmp_path / name) for name in ("branch", "copy", "whole"))
  trainer.train(as_run(tiny(train__steps=10, train__stop_at=4, **WSD)), branch, **QUIET)
  os.makedirs(os.path.join(copy, "checkpoints"))
  shutil.copy(os.path.join(branch, "config.json"), copy)
  shutil.copytree(os.path.join(branch, "checkpoints", "4"), os.path.join(copy, "checkpoints", "4"))
  for run_dir in (branch, copy, whole):
    trainer.train(as_run(tiny(train__steps=16, **WSD)), run_dir, **QUIET)
  want = metric_rows(whole)
  assert [r["step"] for r in want] == list(range(1, 17))
  assert want[-1]["lr"] < want[5]["lr"]  # the longer run decayed at its own end
  abstract = trainer.build(as_run(tiny(train__steps=16, **WSD)), None).state
  _, state_b, _ = checkpoint.restore(checkpoint.manager(whole), abstract)
  for run_dir, first in ((branch, 1), (copy, 5)):  # the copy logs from step 5
    got = metric_rows(run_dir)
    assert [r["step"] for r in got] == list(range(first, 17))
    for key in ("loss", "grad_norm", "lr"):
      assert [r[key] for r in got] == [r[key] for r in want[first - 1 :]], key
    _, state_a, _ = checkpoint.restore(checkpoint.manager(run_dir), abstract)
    assert_trees_equal(state_a, state_b, "state")
