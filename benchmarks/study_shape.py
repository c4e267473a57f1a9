"""Training throughput at the fine-grained shapes the calibration study uses, vs dense.

Run: python benchmarks/study_shape.py [--repeats 5] [--shapes 64/8/32,32/4/64] [--quickstart]
  [--impls fused,native]
Each shape is `base_config()` with `model.moe.update(rule="qwen3_moe", n_experts=E,
top_k=K, d_expert=f)`, against a dense twin with d_ff = K·f, timed interleaved in one
process (see train_step.py). `--quickstart` adds configs/quickstart.py as a row. `--impls`
times one MoE arm per dispatch impl in the same interleave (default: `fused` and `native`,
the C++ FFI kernel; `--impls ""` times the config's own impl). Pinned to one core:
`taskset -c 0 python benchmarks/study_shape.py ...`. Writes benchmarks/results/study_shape.json
(`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result
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


def rows(name: str, cfg, repeats: int, impls: tuple[str, ...]) -> list[dict]:
  """One row of figures per impl: the MoE config against its dense twin."""
  out = []
  for impl, r in compare(cfg, repeats, impls).items():
    out.append({
      "shape": name, "impl": impl if impls else cfg.model.moe.impl,
      "moe_tokens_per_s": r.tokens_per_s["moe"], "dense_tokens_per_s": r.tokens_per_s["dense"],
      **r.ratios(),
    })  # fmt: skip
  return out


def line(r: dict) -> str:
  return (
    f"| {r['shape']} | {r['impl']} | {r['moe_tokens_per_s']:,.0f} | "
    f"{r['dense_tokens_per_s']:,.0f} | {r['tokens_per_s_moe_over_dense']:.2f}× | "
    f"{r['compile_moe_over_dense']:.2f}× | {r['step_memory_moe_over_dense']:.2f}× | "
    f"{r['activations_moe_over_dense']:.2f}× |"
  )


def cases(shapes: str, quickstart: bool) -> list[tuple[str, object]]:
  """(row name, config) per E/K/f in `shapes`, then configs/quickstart.py's with `quickstart`."""
  out = []
  for shape in filter(None, shapes.split(",")):
    E, K, f = (int(v) for v in shape.split("/"))
    out.append((f"E{E}/K{K}/f{f}", study_config(E, K, f)))
  if quickstart:
    here = os.path.dirname(os.path.abspath(__file__))
    out.append(("quickstart", load(os.path.join(here, "..", "configs", "quickstart.py"))))
  return out


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--shapes", default="64/8/32,32/4/64", help="E/K/f, comma-separated")
  p.add_argument("--quickstart", action="store_true")
  p.add_argument("--impls", default="fused,native", help="dispatch impls to time side by side")
  p.add_argument("--result", default="study_shape", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  impls = tuple(v for v in args.impls.split(",") if v)
  print(f"backend={jax.default_backend()} devices={jax.device_count()}")
  print(HEADER)
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  figures = []
  for name, cfg in cases(args.shapes, args.quickstart):
    new = rows(name, cfg, args.repeats, impls)
    print("\n".join(map(line, new)), flush=True)
    figures += new
  write_result(args.result, {"rows": figures, "repeats": args.repeats})


if __name__ == "__main__":
  main()
