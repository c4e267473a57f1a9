"""Quickstart MoE training throughput over a dense model with the same active parameters.

Run: python benchmarks/train_step.py [--repeats 5] [--config configs/quickstart.py]
Both models train on the same batches; steps are timed interleaved in one process. Also
prints the first-step (compile) time of each and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min  # noqa: E402

from moejax import sharding, step as step_lib, trainer  # noqa: E402


def load(path: str):
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def jitted_step(c):
  """(step fn closure, compile seconds, active params) for config c."""
  run = trainer.build(c, workdir=None)
  lc = step_lib.LossConfig.from_config(c, n_shards=sharding.data_shards(run.mesh))
  fn = jax.jit(step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule))
  tokens = next(run.data.train_iterator())["tokens"]
  t = time.perf_counter()
  compiled = fn.lower(run.state, tokens, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t
  state = run.state
  return (lambda: compiled(state, tokens, jax.random.key(0))), compile_s, run.n_active


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/quickstart.py")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  moe_cfg = load(args.config)
  dense_cfg = load(args.config)
  m = dense_cfg.model
  dense_cfg.model.d_ff = m.moe.top_k * m.moe.d_expert + m.moe.d_shared
  dense_cfg.model.moe_every = 0
  moe_fn, moe_compile, moe_active = jitted_step(moe_cfg)
  dense_fn, dense_compile, dense_active = jitted_step(dense_cfg)
  t = interleaved_min({"moe": moe_fn, "dense": dense_fn}, args.repeats)
  tokens = moe_cfg.data.batch_size * moe_cfg.data.seq_len
  print(f"backend={jax.default_backend()} tokens/step={tokens}")
  print(f"active params: moe {moe_active:,}  dense {dense_active:,}")
  print(
    f"tokens/s: moe {tokens / t['moe']:,.0f}  dense {tokens / t['dense']:,.0f}  "
    f"ratio moe/dense {t['dense'] / t['moe']:.2f}"
  )
  print(f"first-step compile: moe {moe_compile:.1f} s  dense {dense_compile:.1f} s")
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
  main()
