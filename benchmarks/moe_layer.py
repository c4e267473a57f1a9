"""MoEBlock forward+backward time over a dense SwiGLU FFN of width K·f on the same tokens.

Run: python benchmarks/moe_layer.py [--repeats 7] [--block 32] [--impls fused,native]
(pinned to one core: `taskset -c 0 python benchmarks/moe_layer.py ...`).
Prints one row per (T, d, f, E, K) and dispatch impl with the ratios dropless/dense,
capacity(1.25)/dense and, when torch and transformers are installed
(`pip install -e .[bench]`), dropless over transformers' OLMoE sparse block on the same
shape (below 1: ours is faster), all timed interleaved in the same process. The MoE arms do
the dense arm's GEMM FLOPs (T·K rows of width f against T rows of width K·f), so 1/ratio is
the fraction of the dense FFN's GEMM rate an impl reaches. `native` is the C++ FFI kernel
(moejax/kernels/native; `fused` where it is not built). Writes benchmarks/results/moe_layer.json
(`--result NAME` for another name, e.g. a pinned run's).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import hf_olmoe
from common import interleaved_min, write_result

from moejax.nn.layers import DenseFFN
from moejax.nn.moe import MoEBlock, MoEConfig

CASES = [(4096, 256, 256, 16, 4), (8192, 256, 128, 64, 8)]


def cotangent(T: int, d: int) -> jax.Array:
  """The fixed random dL/dy every arm is differentiated with. (A loss of sum(y) would make
  dy a constant that XLA folds into the backward pass, flattering every arm unequally.)"""
  return jax.random.normal(jax.random.key(1), (T, d), jnp.float32)


def fwd_bwd(module: nnx.Module, x_TxD: jax.Array, is_moe: bool):
  """A jitted closure computing grads of sum(y · g) w.r.t. params and x, g = cotangent."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  g_TxD = cotangent(*x_TxD.shape)

  def loss(params, x):
    y = nnx.merge(graphdef, params, rest)(x)
    y = y[0] if is_moe else y
    return jnp.sum(y.astype(jnp.float32) * g_TxD)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return lambda: grad(params, x_TxD)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--block", type=int, default=32)
  p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
  p.add_argument("--impls", default="fused,native", help="dispatch impls to time side by side")
  p.add_argument("--result", default="moe_layer", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  hf = hf_olmoe.available() and not args.no_hf
  print(f"backend={jax.default_backend()} devices={jax.device_count()} block={args.block}")
  impls = args.impls.split(",")
  print(
    "| T | d | f | E | K | impl | dense ms | dropless/dense | capacity1.25/dense | dropless/OLMoE |"
  )
  print("|---|---|---|---|---|---|---:|---:|---:|---:|")
  rows = []
  for T, d, f, E, K in CASES:
    x = jax.random.normal(jax.random.key(0), (T, d), jnp.float32)
    rngs = nnx.Rngs(0)
    fns = {"dense": fwd_bwd(DenseFFN(d, K * f, rngs=rngs), x, False)}
    for impl, mode in ((i, m) for i in impls for m in ("dropless", "capacity")):
      cfg = MoEConfig(
        impl=impl,
        d_model=d,
        n_experts=E,
        top_k=K,
        d_expert=f,
        dispatch=mode,
        capacity_factor=1.25,
        eval_capacity_factor=1.25,
        block_size=args.block,
      )
      fns[impl, mode] = fwd_bwd(MoEBlock(cfg, rngs=rngs), x, True)
    label = "not measured (no torch/transformers)"
    if hf:
      fns["olmoe"], label = hf_olmoe.fwd_bwd(T, d, f, E, K, cotangent(T, d))
    t = interleaved_min(fns, args.repeats)
    for impl in impls:
      drop, cap = t[impl, "dropless"], t[impl, "capacity"]
      vs_hf = f"{drop / t['olmoe']:.2f}" if hf else "-"
      print(
        f"| {T} | {d} | {f} | {E} | {K} | {impl} | {t['dense'] * 1e3:.1f} | "
        f"{drop / t['dense']:.2f} | {cap / t['dense']:.2f} | {vs_hf} |",
        flush=True,
      )
      rows.append({
        "T": T, "d": d, "f": f, "E": E, "K": K, "impl": impl,
        "dense_ms": t["dense"] * 1e3,
        "dropless_ms": drop * 1e3,
        "capacity1.25_ms": cap * 1e3,
        "dropless_over_dense": drop / t["dense"],
        "capacity1.25_over_dense": cap / t["dense"],
        "dropless_over_olmoe": drop / t["olmoe"] if hf else None,
      })  # fmt: skip
  print(f"OLMoE block: {label}")
  write_result(args.result, {"rows": rows, "olmoe_block": label, "block": args.block,
                             "repeats": args.repeats})  # fmt: skip


if __name__ == "__main__":
  main()
