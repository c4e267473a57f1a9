"""Training throughput at the fine-grained shapes the calibration study uses, vs dense.

Run: python benchmarks/study_shape.py [--repeats 5] [--shapes 64/8/32,32/4/64] [--quickstart]
Each shape is `base_config()` with `model.moe.update(rule="qwen3_moe", n_experts=E,
top_k=K, d_expert=f)`, against a dense twin with d_ff = K·f, timed interleaved in one
process (see train_step.py). `--quickstart` adds configs/quickstart.py as a row.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
from train_step import compare, load

from moejax.config import base_config

HEADER = "| shape | MoE tok/s | dense tok/s | tokens/s MoE/dense | compile MoE/dense | step memory MoE/dense |"


def study_config(E: int, K: int, f: int):
  c = base_config()
  c.model.moe.update(rule="qwen3_moe", n_experts=E, top_k=K, d_expert=f)
  return c


def row(name: str, cfg, repeats: int) -> str:
  r = compare(cfg, repeats)
  tps = r.tokens_per_s
  return (
    f"| {name} | {tps['moe']:,.0f} | {tps['dense']:,.0f} | {r.ratio('tokens_per_s'):.2f}× | "
    f"{r.ratio('compile_s'):.2f}× | {r.ratio('step_bytes'):.2f}× |"
  )


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--shapes", default="64/8/32,32/4/64", help="E/K/f, comma-separated")
  p.add_argument("--quickstart", action="store_true")
  args = p.parse_args()
  print(f"backend={jax.default_backend()} devices={jax.device_count()}")
  print(HEADER)
  print("|---|---:|---:|---:|---:|---:|")
  for shape in args.shapes.split(","):
    E, K, f = (int(v) for v in shape.split("/"))
    print(row(f"E{E}/K{K}/f{f}", study_config(E, K, f), args.repeats), flush=True)
  if args.quickstart:
    here = os.path.dirname(os.path.abspath(__file__))
    print(
      row("quickstart", load(os.path.join(here, "..", "configs", "quickstart.py")), args.repeats)
    )


if __name__ == "__main__":
  main()
