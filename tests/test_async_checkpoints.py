"""Async checkpoints (`train.async_checkpoints`): the loop waits for a save only before the
next save, at a stop and at the end, so the steps after a save run while it is written;
an async manager's save is restorable once waited for. The kill -9 / SIGTERM / corrupt /
bitwise-resume tests (test_failures, test_preemption, test_train) run with it on (default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config.sections import TrainConfig
from moejax.training import checkpoint, loop


class Manager:
  """An orbax CheckpointManager's calls, recorded in `events`."""

  directory = "ckpt"

  def __init__(self, events: list):
    self.events = events

  def save(self, step, args, force):
    self.events.append(f"save {step}")

  def wait_until_finished(self):
    self.events.append("wait")

  def reached_preemption(self, step):
    return False


class Stop:
  def __init__(self, at: int | None):
    self.at, self.signal_name = at, None

  def requested(self, mngr, step):
    if step == self.at:
      self.signal_name = "SIGTERM"
    return step == self.at


class Bar:
  def update(self, n):
    pass

  def set_postfix(self, **kw):
    pass


def run(events: list, end: int, stop_at: int | None = None) -> loop.LoopResult:
  def step_fn(state, tokens, rng):
    events.append(f"step {state + 1}")
    return state + 1, {"loss": jnp.float32(1.0), "nonfinite": jnp.int32(0)}

  setup = loop.LoopSetup(
    config=TrainConfig(
      log_every=100, eval_every=100, ckpt_every=2, on_nonfinite="stop", max_skips=0
    ),
    step_fn=step_fn,
    evaluate=lambda state: 0.0,
    next_tokens=lambda: None,
    data_state=dict,
    mngr=Manager(events),
    write_row=lambda row: None,
    rng=np.zeros((), np.uint32),
    moe_layers=[],
    tokens_per_step=1,
    log=lambda line: None,
    progress=Bar(),
  )
  return loop.Loop(setup, 0, end).run(0, Stop(stop_at))


@pytest.fixture(autouse=True)
def plain_rng(monkeypatch):
  monkeypatch.setattr(loop.jax.random, "fold_in", lambda key, i: i)


def test_the_loop_waits_before_the_next_save_and_at_the_end_only():
  events = []
  run(events, 5)
  assert events == [
    "step 1", "step 2", "wait", "save 2", "step 3", "step 4", "wait", "save 4",
    "step 5", "wait", "save 5", "wait",
  ]  # fmt: skip


def test_a_stop_waits_for_its_save():
  events = []
  result = run(events, 6, stop_at=3)
  assert result.stopped_by == "SIGTERM" and result.step == 3
  assert events == ["step 1", "step 2", "wait", "save 2", "step 3", "wait", "save 3", "wait"]


def test_an_async_managers_save_is_restorable_once_waited_for(tmp_path):
  w = np.arange(2**18, dtype=np.float32).reshape(256, 1024)  # 1 MiB
  state = {"w": jnp.asarray(w), "step": jnp.int32(4)}
  mngr = checkpoint.manager(str(tmp_path), async_save=True)
  checkpoint.save(mngr, 4, state, {"pos": 4})
  bump = jax.jit(lambda st: {k: v * 0 + 99 for k, v in st.items()}, donate_argnums=0)
  state = jax.block_until_ready(bump(state))  # the next step takes the saved buffers
  checkpoint.wait(mngr)
  step, got, data = checkpoint.restore(mngr, state)
  mngr.close()
  assert step == 4 and data == {"pos": 4}
  np.testing.assert_array_equal(got["w"], w)
  assert int(got["step"]) == 4
