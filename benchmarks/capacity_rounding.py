"""How far `batched` is from `fused` in capacity mode on XLA:CPU, next to how far one batched
matmul is from the same matmuls done block by block, with no MoE code at all.

`batched` (moejax/kernels/batched.py) runs each projection as one einsum over every
expert's capacity slots; `fused` runs the same [C, D] x [D, F] products one block at a time
in a while loop, and its backward pass is a custom VJP that accumulates dW block by block.
The kept assignments are the same bit for bit (tests/test_capacity_batched.py); the values
differ by float32 rounding because the backend sums in a different order. The second table
shows that order changing with nothing but the batching of a plain matmul.

  JAX_PLATFORMS=cpu python benchmarks/capacity_rounding.py

Writes the counts to benchmarks/results/capacity_rounding.json.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

CASES = [("position", 2, 16, 1.25, False), ("position", 1, 32, 1.0, False)]
NAMES = ("y", "dx", "dW_gate", "dW_up", "dW_down", "d_weights")


FIGURES: list[dict] = []  # every row printed, for the result file


def _row(name, a, b, case: str = "") -> str:
  a, b = np.asarray(a), np.asarray(b)
  rel = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
  FIGURES.append({
    "case": case, "tensor": name, "shape": str(a.shape), "not_bitwise_equal": int((a != b).sum()),
    "elements": int(a.size), "max_abs_diff_over_max_abs": float(rel),
  })  # fmt: skip
  return f"| {name} | {a.shape} | {(a != b).sum()} of {a.size} | {rel:.2e} |"


def moe_rows() -> list[str]:
  import test_capacity_batched as t  # pylint: disable=import-outside-toplevel

  rows = ["| case | tensor | shape | elements not bitwise equal | max abs diff / max abs |",
          "|---|---|---|---:|---:|"]  # fmt: skip
  for case in CASES:
    args = t._args(case[1])
    (_, (y0, kept0)), g0 = t._compiled("fused", case)(*args)
    (_, (y1, kept1)), g1 = t._compiled("batched", case)(*args)
    assert np.array_equal(kept0, kept1)
    label = f"{case[0]} K={case[1]} group={case[2]} factor={case[3]}"
    for name, a, b in zip(NAMES, (y1, *jax.tree.leaves(g1)), (y0, *jax.tree.leaves(g0))):
      rows.append(f"| {label} " + _row(name, a, b, label))
  return rows


def matmul_rows() -> list[str]:
  """One einsum 'gecd,edf->gecf' against the same [C, D] x [D, F] dot per (g, e) block."""
  r = np.random.default_rng(0)
  G, E, C, D, F = 4, 8, 4, 8, 6
  x = r.normal(size=(G, E, C, D)).astype(np.float32)
  w = r.normal(size=(E, D, F)).astype(np.float32)
  batched = jax.jit(lambda x, w: jnp.einsum("gecd,edf->gecf", x, w))(x, w)
  dot = jax.jit(lambda a, b: a @ b)
  blocks = np.stack([np.stack([dot(x[g, e], w[e]) for e in range(E)]) for g in range(G)])
  return ["| | shape | elements not bitwise equal | max abs diff / max abs |", "|---|---|---:|---:|",
          _row("einsum vs per-block dot", batched, blocks, "no MoE code")]  # fmt: skip


def main() -> None:
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
  print("\n".join(moe_rows()))
  print()
  print("\n".join(matmul_rows()))
  write_result("capacity_rounding", {"rows": FIGURES})


if __name__ == "__main__":
  main()
