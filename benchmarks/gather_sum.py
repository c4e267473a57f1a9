"""Combining each token's K expert rows: one [T, K, D] gather then a sum, or K gathers added.

Run: python benchmarks/gather_sum.py [--repeats 21]
The combine and its transpose in `moejax/kernels/fused.py` read, for every token, the K rows its
assignments were written to. Both forms compute the same sum (both directions of the fused
dispatch are such gathers, never differentiated); this times them side by side at the
study shape (K = 8) and quickstart's (K = 2). Writes benchmarks/results/gather_sum.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min, write_result

from moejax.kernels.permute import gather_sum, take_or_zero

CASES = [(2048, 128, 8), (2048, 128, 2)]  # T, D, K


def gather_then_sum(y_RxD, row_TxK):
  return take_or_zero(y_RxD, row_TxK).sum(axis=1)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=21)
  args = p.parse_args()
  print(f"backend={jax.default_backend()}")
  print("| T | D | K | [T,K,D] gather + sum, ms | K gathers added, ms | ratio |")
  print("|---|---|---|---:|---:|---:|")
  rows = []
  for T, D, K in CASES:
    R = T * K + 64
    y = jax.random.normal(jax.random.key(0), (R, D))
    row = jax.random.permutation(jax.random.key(1), R)[: T * K].reshape(T, K)
    jitted = {"sum": jax.jit(gather_then_sum), "added": jax.jit(gather_sum)}
    fns = {k: functools.partial(fn, y, row) for k, fn in jitted.items()}
    t = interleaved_min(fns, args.repeats)
    ratio = t["sum"] / t["added"]
    print(f"| {T} | {D} | {K} | {t['sum'] * 1e3:.2f} | {t['added'] * 1e3:.2f} | {ratio:.2f} |")
    rows.append({
      "T": T, "D": D, "K": K, "gather_then_sum_ms": t["sum"] * 1e3,
      "k_gathers_added_ms": t["added"] * 1e3, "gather_then_sum_over_added": ratio,
    })  # fmt: skip
  write_result("gather_sum", {"rows": rows, "repeats": args.repeats})


if __name__ == "__main__":
  main()
