"""MoE training throughput over a dense model with the same active parameters.

Run: python benchmarks/train_step.py [--repeats 5] [--config configs/quickstart.py]
Both models train on the same batches; steps are timed interleaved in one process. Also
prints the compile time of each, XLA's peak-memory estimate of one step compiled as the
trainer runs it, with the state donated (arguments + outputs + temporaries − aliased, so it
is per step, not per process), its activations alone (temporaries: what dispatch controls;
the MoE's extra parameters and optimizer state are in the total) and the process's peak
RSS. Writes benchmarks/results/train_step.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import time
from typing import NamedTuple

import jax

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min, write_result

from moejax.config import resolve
from moejax import sharding
from moejax.training import step as step_lib
from moejax.training import trainer


class Comparison(NamedTuple):
  """One MoE config against its dense twin, measured in the same process."""

  tokens_per_s: dict[str, float]
  compile_s: dict[str, float]
  step_bytes: dict[str, int]
  temp_bytes: dict[str, int]
  active: dict[str, int]

  def ratio(self, field: str) -> float:
    d = getattr(self, field)
    return d["moe"] / d["dense"]

  def ratios(self) -> dict[str, float]:
    """MoE/dense of each printed ratio, named as benchmarks/results/ name them."""
    return {f"{name}_moe_over_dense": self.ratio(field) for name, field in RATIOS.items()}


# The ratios printed: their names in benchmarks/results/ and the Comparison field of each.
RATIOS = {
  "tokens_per_s": "tokens_per_s",
  "compile": "compile_s",
  "step_memory": "step_bytes",
  "activations": "temp_bytes",
}


def load(path: str):
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def dense_twin(c):
  """The same config with dense FFNs of width K·d_expert + d_shared (equal active params)."""
  d = c.copy_and_resolve_references()
  m = d.model
  d.model.d_ff = m.moe.top_k * m.moe.d_expert + m.moe.d_shared
  d.model.moe_every = 0
  return d


class Built(NamedTuple):
  step: object  # () -> step outputs, on a state that is not donated (repeatable)
  compile_s: float
  step_bytes: int
  temp_bytes: int
  active: int


def _memory(fn, *args) -> tuple[int, int]:
  """(step bytes, temporaries) of `fn` compiled with its state donated, as the trainer runs
  it; (0, 0) where the backend reports no memory analysis."""
  m = jax.jit(fn, donate_argnums=0).lower(*args).compile().memory_analysis()
  if m is None:
    return 0, 0
  used = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  return used - m.alias_size_in_bytes, m.temp_size_in_bytes


def step_and_args(c) -> tuple:
  """(run, train step, its arguments) of config `c`, built fresh: the step moejax.train
  runs, on the first batch, traced under the run's mesh as the trainer traces it
  (`sharding.tracing_mesh`: kernels are traced for the mesh's platform only)."""
  run = trainer.build(resolve(c), workdir=None)
  lc = resolve(c).with_shards(sharding.data_shards(run.mesh)).loss
  step_fn = step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule)
  step_fn = sharding.tracing_mesh(step_fn, run.mesh)
  return run, step_fn, (run.state, next(run.data.train_iterator())["tokens"], jax.random.key(0))


def jitted_step(c) -> Built:
  run, step_fn, args = step_and_args(c)
  t = time.perf_counter()
  compiled = jax.jit(step_fn).lower(*args).compile()
  compile_s = time.perf_counter() - t
  return Built(lambda: compiled(*args), compile_s, *_memory(step_fn, *args), run.n_active)


def compare(moe_cfg, repeats: int, impls: tuple[str, ...] = ()) -> dict[str, Comparison]:
  """Times a train step of `moe_cfg` and of its dense twin, interleaved. With `impls`, one
  MoE arm per dispatch impl (model.moe.impl), all in the same interleave; the result is
  keyed by impl ("moe" when `impls` is empty), each against the same dense run."""
  arms = {"dense": dense_twin(moe_cfg)}
  for impl in impls or ("moe",):
    arms[impl] = moe_cfg.copy_and_resolve_references()
    if impls:
      arms[impl].model.moe.impl = impl
  built = {k: jitted_step(c) for k, c in arms.items()}
  t = interleaved_min({k: v.step for k, v in built.items()}, repeats)
  tokens = moe_cfg.data.batch_size * moe_cfg.data.seq_len
  out = {}
  for k in built:
    if k != "dense":
      pick = lambda d, k=k: {"moe": d[k], "dense": d["dense"]}
      out[k] = Comparison(
        tokens_per_s=pick({a: tokens / t[a] for a in t}),
        compile_s=pick({a: v.compile_s for a, v in built.items()}),
        step_bytes=pick({a: v.step_bytes for a, v in built.items()}),
        temp_bytes=pick({a: v.temp_bytes for a, v in built.items()}),
        active=pick({a: v.active for a, v in built.items()}),
      )
  return out


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/quickstart.py")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--result", default="train_step", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  moe_cfg = load(args.config)
  r = compare(moe_cfg, args.repeats)["moe"]
  tps, cs, mb = r.tokens_per_s, r.compile_s, {k: v / 2**20 for k, v in r.step_bytes.items()}
  print(
    f"backend={jax.default_backend()} tokens/step={moe_cfg.data.batch_size * moe_cfg.data.seq_len}"
  )
  print(f"active params: moe {r.active['moe']:,}  dense {r.active['dense']:,}")
  print(
    f"tokens/s: moe {tps['moe']:,.0f}  dense {tps['dense']:,.0f}  "
    f"ratio moe/dense {r.ratio('tokens_per_s'):.2f}"
  )
  print(
    f"compile: moe {cs['moe']:.1f} s  dense {cs['dense']:.1f} s  ratio {r.ratio('compile_s'):.2f}"
  )
  print(
    f"step memory: moe {mb['moe']:.0f} MiB  dense {mb['dense']:.0f} MiB  "
    f"ratio {r.ratio('step_bytes'):.2f} (activations alone {r.ratio('temp_bytes'):.2f})"
  )
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"peak RSS {rss:.0f} MiB")
  run = {"config": args.config, "repeats": args.repeats, "peak_RSS_MiB": rss}
  write_result(args.result, {"rows": result_rows(r), **r.ratios(), **run})


def result_rows(r: Comparison) -> list[dict]:
  """One row per arm (moe, dense): the figures main() prints."""
  return [
    {
      "arm": arm,
      "active_params": r.active[arm],
      "tokens_per_s": r.tokens_per_s[arm],
      "compile_s": r.compile_s[arm],
      "step_MiB": r.step_bytes[arm] / 2**20,
      "activations_MiB": r.temp_bytes[arm] / 2**20,
    }
    for arm in ("moe", "dense")
  ]


if __name__ == "__main__":
  main()
