"""Train-step tokens/s against the k a step uses (elastic-k), side by side in one process.

Run: python benchmarks/elastic_k.py [--config configs/study_calibration.py] [--repeats 5]
Arms: fixed K, and `train_k=schedule` held at one k (`0:k`) for k = K, K/2, ..., 1, plus
`uniform` (mean k (K+1)/2 with k_min = 1). All are the same compiled shapes: unused ranks
leave the dispatch plan, so the fused block loop visits fewer blocks at small k. Writes
benchmarks/results/elastic_k.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min, write_result
from train_step import jitted_step, load


def arms(c) -> dict[str, object]:
  K = c.model.moe.top_k
  out = {"fixed K": c}
  k = K
  while k >= 1:
    a = c.copy_and_resolve_references()
    a.model.moe.update(train_k="schedule", train_k_schedule=f"0:{k}")
    out[f"k = {k}"] = a
    k //= 2
  u = c.copy_and_resolve_references()
  u.model.moe.update(train_k="uniform", train_k_min=1, train_k_scope="layer")
  out[f"uniform 1..{K} (mean {(K + 1) / 2:g})"] = u
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/study_calibration.py")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--result", default="elastic_k", help="benchmarks/results/<NAME>.json")
  a = p.parse_args()
  c = load(a.config)
  built = {name: jitted_step(cfg) for name, cfg in arms(c).items()}
  t = interleaved_min({name: b.step for name, b in built.items()}, a.repeats)
  tokens = c.data.batch_size * c.data.seq_len
  print(f"{a.config}: E {c.model.moe.n_experts}, K {c.model.moe.top_k}, {tokens} tokens/step")
  print("| arm | tokens/s | vs fixed K |\n|---|---:|---:|")
  rows = [{"arm": n, "tokens_per_s": tokens / t[n], "over_fixed_K": t["fixed K"] / t[n]} for n in t]
  for r in rows:
    print(f"| {r['arm']} | {r['tokens_per_s']:,.0f} | {r['over_fixed_K']:.2f}x |")
  shape = {"E": c.model.moe.n_experts, "K": c.model.moe.top_k, "tokens_per_step": tokens}
  write_result(a.result, {"rows": rows, "config": a.config, **shape, "repeats": a.repeats})


if __name__ == "__main__":
  main()
