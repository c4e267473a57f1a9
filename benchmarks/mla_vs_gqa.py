"""CPU training throughput of a mixer (MLA, or the Gated DeltaNet hybrid) against its GQA twin
of (nearly) equal parameters.

Run: python benchmarks/mla_vs_gqa.py [--config configs/deepseek_v2_lite.py] [--repeats 5]
     python benchmarks/mla_vs_gqa.py --config configs/qwen3_5_moe.py --seq_len 2048 \
       --batch_size 4 --result hybrid_vs_gqa   # issue 58: the hybrid at sequence 2k
The twin is the same config with `model.mixers=gqa` (head_dim d_model / n_heads) and the
n_kv_heads, among the divisors of n_heads, whose total parameter count is closest to the MLA
model's (counted on the abstract models, nothing allocated). Both train steps are built as
the trainer builds them (benchmarks/train_step.py) and timed interleaved in one process,
min of `--repeats`. Prints and writes tokens/s of each and their ratio MLA/GQA, the compile
times, XLA's step-memory estimates, both parameter counts and the load average before and
after (the machine is shared), to benchmarks/results/mla_vs_gqa.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min, write_result
from train_step import jitted_step, load

from moejax import build
from moejax.config import resolve


def total_params(c) -> int:
  """Every parameter of config `c`'s model (vocabulary as the config sets it, else 257)."""
  mc = resolve(c).with_vocab(c.model.vocab_size or 257).model
  return build.count_params(build.abstract_params(mc), mc.moe).total


def gqa_twin(c):
  """`c` with GQA attention: the n_kv_heads (a divisor of n_heads) closest in parameters."""
  twins = []
  for g in (g for g in range(1, c.model.n_heads + 1) if c.model.n_heads % g == 0):
    t = c.copy_and_resolve_references()
    t.model.mixers, t.model.n_kv_heads, t.model.head_dim = "gqa", g, 0
    twins.append(t)
  target = total_params(c)
  return min(twins, key=lambda t: abs(total_params(t) - target))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/deepseek_v2_lite.py")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--seq_len", type=int, default=0, help="data.seq_len (0: the config's)")
  p.add_argument("--batch_size", type=int, default=0, help="data.batch_size (0: the config's)")
  p.add_argument("--result", default="mla_vs_gqa", help="benchmarks/results/<name>.json")
  args = p.parse_args()
  load_before = os.getloadavg()
  arms = {"mla": load(args.config)}  # "mla": the config's own mixers (MLA or the hybrid)
  if arms["mla"].model.mixers == "gqa":
    raise SystemExit(f"{args.config}: model.mixers='gqa'; need another mixer to compare")
  if args.seq_len:
    arms["mla"].data.seq_len = args.seq_len
  if args.batch_size:
    arms["mla"].data.batch_size = args.batch_size
  arms["gqa"] = gqa_twin(arms["mla"])
  params = {k: total_params(c) for k, c in arms.items()}
  built = {k: jitted_step(c) for k, c in arms.items()}
  t = interleaved_min({k: b.step for k, b in built.items()}, args.repeats)
  tokens = arms["mla"].data.batch_size * arms["mla"].data.seq_len
  tps = {k: tokens / t[k] for k in arms}
  load_after = os.getloadavg()
  print(f"backend={jax.default_backend()} tokens/step={tokens} config={args.config}")
  print(f"params: mla {params['mla']:,}  gqa {params['gqa']:,} "
        f"(n_kv_heads {arms['gqa'].model.n_kv_heads} of {arms['gqa'].model.n_heads})")  # fmt: skip
  print(f"tokens/s: mla {tps['mla']:,.0f}  gqa {tps['gqa']:,.0f}  "
        f"ratio mla/gqa {tps['mla'] / tps['gqa']:.3f}")  # fmt: skip
  print(f"compile: mla {built['mla'].compile_s:.1f} s  gqa {built['gqa'].compile_s:.1f} s")
  print(f"load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f}")
  rows = [
    {
      "arm": k,
      "params": params[k],
      "n_kv_heads": arms[k].model.n_kv_heads,
      "tokens_per_s": tps[k],
      "compile_s": built[k].compile_s,
      "step_MiB": built[k].step_bytes / 2**20,
    }
    for k in arms
  ]
  write_result(
    args.result,
    {
      "mixers": arms["mla"].model.mixers,
      "seq_len": arms["mla"].data.seq_len,
      "batch_size": arms["mla"].data.batch_size,
      "rows": rows,
      "tokens_per_s_mla_over_gqa": tps["mla"] / tps["gqa"],
      "params_mla_over_gqa": params["mla"] / params["gqa"],
      "config": args.config,
      "repeats": args.repeats,
      "load_average_1min_before": load_before[0],
      "load_average_1min_after": load_after[0],
    },
  )


if __name__ == "__main__":
  main()
