"""Why the CPU expert loop is slower than a dense FFN: one dot's rate inside a while loop.

Run: python benchmarks/loop_dot.py [--repeats 9]
Multiplies R = 16384 rows of width d = 128 by a [128, 64] expert matrix (the study shape's
gate/up projection), as one large dot, as a batched einsum over 64 equal experts (no
padding: a perfectly balanced router), and as a `fori_loop` over blocks of B rows each with
its own expert (what `moejax/kernels/grouped.py` does), printing GFLOP/s of each, measured
interleaved in one process. Writes benchmarks/results/loop_dot.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min, write_result

R, D, N, E = 16384, 128, 64, 64


def one_dot(x_RxD, w_ExDxN):
  return x_RxD @ w_ExDxN[0]


def batched(x_RxD, w_ExDxN):
  return jnp.einsum("ecd,edn->ecn", x_RxD.reshape(E, R // E, D), w_ExDxN).reshape(R, N)


def block_loop(B: int):
  def fn(x_RxD, w_ExDxN):
    def body(i, y_RxN):
      x_BxD = jax.lax.dynamic_slice_in_dim(x_RxD, i * B, B)
      return jax.lax.dynamic_update_slice_in_dim(y_RxN, x_BxD @ w_ExDxN[i % E], i * B, 0)

    return jax.lax.fori_loop(0, R // B, body, jnp.zeros((R, N), x_RxD.dtype))

  return fn


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--result", default="loop_dot", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  x = jax.random.normal(jax.random.key(0), (R, D))
  w = jax.random.normal(jax.random.key(1), (E, D, N))
  fns = {"one dot": one_dot, "batched einsum": batched}
  fns |= {f"loop, B={b}": block_loop(b) for b in (32, 64, 128, 256, 512)}
  jitted = {k: jax.jit(f) for k, f in fns.items()}
  t = interleaved_min({k: (lambda f=f: f(x, w)) for k, f in jitted.items()}, args.repeats)
  flops = 2 * R * D * N
  print(f"backend={jax.default_backend()} R={R} d={D} n={N} E={E}")
  print("| computation | ms | GFLOP/s |\n|---|---:|---:|")
  rows = [{"computation": k, "ms": v * 1e3, "GFLOP_per_s": flops / v / 1e9} for k, v in t.items()]
  for r in rows:
    print(f"| {r['computation']} | {r['ms']:.2f} | {r['GFLOP_per_s']:.1f} |")
  write_result(args.result, {"rows": rows, "R": R, "d": D, "n": N, "E": E, "repeats": args.repeats})


if __name__ == "__main__":
  main()
