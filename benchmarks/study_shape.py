"""Training throughput at the fine-grained shapes the calibration study uses, vs dense.

Run: python benchmarks/study_shape.py [--repeats 5] [--shapes 64/8/32,32/4/64] [--quickstart]
  [--impls fused,native]
Each shape is `base_config()` with `model.moe.update(rule="qwen3_moe", n_experts=E,
top_k=K, d_expert=f)`, against a dense twin with d_ff = K·f, timed interleaved in one
process (see train_step.py). `--quickstart` adds configs/quickstart.py as a row. `--impls`
times one MoE arm per dispatch impl in the same interleave (default: `fused` and `native`,
the C++ FFI kernel; `--impls ""` times the config's own impl). Pinned to one core:
`taskset -c 0 python benchmarks/study_shape.py ...`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
from train_step import compare, load

from moejax.config import base_config

HEADER = (
  "| shape | impl | MoE tok/s | dense tok/s | tokens/s MoE/dense | compile MoE/dense "
  "| step memory MoE/dense | activations MoE/dense |"
)


def study_config(E: int, K: int, f: int):
  c = base_config()
  c.model.moe.update(rule="qwen3_moe", n_experts=E, top_k=K, d_expert=f)
  return c


def rows(name: str, cfg, repeats: int, impls: tuple[str, ...]) -> str:
  lines = []
  for impl, r in compare(cfg, repeats, impls).items():
    tps = r.tokens_per_s
    lines.append(
      f"| {name} | {impl if impls else cfg.model.moe.impl} | {tps['moe']:,.0f} | "
      f"{tps['dense']:,.0f} | {r.ratio('tokens_per_s'):.2f}× | {r.ratio('compile_s'):.2f}× | "
      f"{r.ratio('step_bytes'):.2f}× | {r.ratio('temp_bytes'):.2f}× |"
    )
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--shapes", default="64/8/32,32/4/64", help="E/K/f, comma-separated")
  p.add_argument("--quickstart", action="store_true")
  p.add_argument("--impls", default="fused,native", help="dispatch impls to time side by side")
  args = p.parse_args()
  impls = tuple(v for v in args.impls.split(",") if v)
  print(f"backend={jax.default_backend()} devices={jax.device_count()}")
  print(HEADER)
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  for shape in filter(None, args.shapes.split(",")):
    E, K, f = (int(v) for v in shape.split("/"))
    print(rows(f"E{E}/K{K}/f{f}", study_config(E, K, f), args.repeats, impls), flush=True)
  if args.quickstart:
    here = os.path.dirname(os.path.abspath(__file__))
    qs = load(os.path.join(here, "..", "configs", "quickstart.py"))
    print(rows("quickstart", qs, args.repeats, impls))


if __name__ == "__main__":
  main()
