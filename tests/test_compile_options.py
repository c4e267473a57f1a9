"""moejax.backend.compile_options: the XLA options of each platform, and the compiles that take them
(the compile-only GPU target's are checked with XLA:GPU in tests/test_accelerators.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from failure_helpers import override

from moejax import cli
from moejax.backend import compile_options
from moejax.training import trainer
from runconfig import as_run

ZERO_INIT = "xla_gpu_enable_dus_accumulator_zero_init_elimination"
SHAPE = {
  "model.n_layers": 2,
  "model.d_model": 32,
  "model.d_ff": 64,
  "model.moe.d_expert": 32,
  "data.batch_size": 2,
  "data.seq_len": 16,
  "wandb.mode": "disabled",
}


def test_every_gpu_platform_name_takes_the_zero_init_elimination(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  for platform in ("gpu", "cuda", "rocm"):  # jax.default_backend()'s name, and the targets'
    assert compile_options.options(platform) == {ZERO_INIT: True}, platform
  assert compile_options.options("cpu") == compile_options.options("tpu") == {}


def test_an_option_xla_flags_sets_is_left_to_xla_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"--xla_gpu_autotune_level=0 --{ZERO_INIT}=false")
  assert compile_options.options("cuda") == {}
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
  assert compile_options.options("cuda") == {ZERO_INIT: True}


def test_the_trainers_steps_compile_with_the_backends_options(monkeypatch, tmp_path):
  """An option for this host's backend reaches XLA in both of the trainer's steps: XLA
  writes its dumps where the option says (a CPU option that can be seen from here)."""
  dumps = tmp_path / "xla"
  monkeypatch.setitem(compile_options.OPTIONS, "cpu", {"xla_dump_to": str(dumps)})
  run = trainer.build(as_run(override(cli.load_file("configs/quickstart.py"), SHAPE)), None)
  train_step, eval_step = trainer.compile_steps(run)
  tokens = jnp.zeros((2, 17), jnp.int32)
  modules = set()
  for name, fn, args in (
    ("train", train_step, (run.state, tokens, jax.random.key(0))),
    ("eval", eval_step, (run.state["params"], run.state["router"], tokens)),
  ):
    fn.lower(*args).compile()
    now = {p.name.split(".")[0] for p in dumps.glob("*after_optimizations.txt")}
    assert now - modules, f"the {name} step's compile wrote no dump"
    modules |= now
