"""train.profile_steps (moejax.training.profiling): the key's format, and a run's trace in
WORKDIR/profile holding the XLA ops of the trainer's compiled train step."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from failure_helpers import fast_compiles, tiny  # noqa: F401
from runconfig import as_run
from tiers import FULL

from moejax.config import sections
from moejax.errors import UserError
from moejax.training import trainer


def test_profile_steps_are_a_slice_of_step_numbers():
  assert sections.step_range("") is None
  assert sections.step_range("10:13") == (10, 13)
  for bad in ("3", "0:2", "5:5", "6:2", "a:b", "1:2:3"):
    with pytest.raises(UserError, match=rf"train.profile_steps='{bad}' is not allowed; use 'A:B'"):
      sections.TrainConfig(profile_steps=bad)


def trace_op_names(workdir: str) -> set[str]:
  """The names of the events in the run's Perfetto trace (XLA ops among them)."""
  (path,) = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.json.gz"))[:1]
  with gzip.open(path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  return {e["name"] for e in events if "name" in e}


def hlo_instruction_names(run: trainer.Run) -> set[str]:
  """The instruction names of the trainer's train step as XLA compiles it for this run."""
  train_step, _ = trainer.compile_steps(run)
  tokens = jnp.asarray(next(run.data.train_iterator())["tokens"])
  text = train_step.lower(run.state, tokens, jax.random.key(0)).compile().as_text()
  return set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", text, flags=re.MULTILINE))


@FULL
def test_the_trace_holds_the_train_steps_xla_ops(tmp_path):
  c = tiny(train__steps=4, train__profile_steps="2:4")
  logged = []
  trainer.train(as_run(c), str(tmp_path), log=logged.append)
  assert any(f"profile of steps 2..3: {tmp_path}/profile" in line for line in logged)
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  ops = trace_op_names(str(tmp_path)) & hlo_instruction_names(trainer.build(as_run(c), None))
  assert len(ops) >= 10 and any("fusion" in op for op in ops), sorted(ops)
