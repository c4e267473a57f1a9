"""The GPU kernels compiled for one compile-only NVIDIA GPU on a CPU host (no GPU needed):
per-device temporaries, while loops and kernel custom calls of one MoE layer's forward +
backward per dispatch impl, and of causal GQA attention per `model.attention` impl.

Shapes: the TPU preset's (configs/study_calibration.py:tpu) per device on 8 GPUs: 32 × 1024
tokens, d_model 1024, E 64, K 8, d_expert 256, bf16; attention 16 query / 4 kv heads of 64,
sequences of 1024. Capacity mode at capacity_factor 1.25 over all of a device's tokens.

Needs the CUDA jaxlib plugin (the `cuda` extra, `pip install -e '.[cuda]'`), and runs with
the host on the CPU:
  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/gpu_kernels_compile.py \
    [--target h100] [--target-config FILE.txtpb] [--cases moe,capacity,attention] [--out DIR]

`--target-config` is a `GpuTargetConfig` text proto (the target's device description);
without it the script looks for `<target>*.txtpb` in the repository. With `--default-device`
(the default) the compile-only GPU is JAX's default device while tracing, so that tokamax,
which picks its kernel from the default device (`jax.extend.backend.get_default_device`),
traces its Mosaic GPU kernels for sm90/sm100; `--no-default-device` traces as a CPU host does
(tokamax falls back to Triton). Prints a markdown table and writes OUT.json/OUT.md, and
benchmarks/results/gpu_kernels_compile_<target>.json (`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from moejax.kernels import dispatch as dsp  # noqa: E402
from moejax.kernels import plans  # noqa: E402
from moejax.nn.attention import ATTENTION_IMPLS  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, D, E, K, F = 32 * 1024, 1024, 64, 8, 256
B, L, H, G, HD = 32, 1024, 16, 4, 64
CAPACITY_FACTOR = 1.25
MOE_IMPLS = ("fused", "tokamax", "ragged")
CAPACITY_IMPLS = ("fused", "batched")
ATTENTION = ("xla", "dot_product", "tokamax")
WHILE = re.compile(r"\bwhile\(")
TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
CALL = re.compile(r'custom_call_target="([^"]+)"')


def target_text(name: str, path: str) -> str:
  if not path:
    found = sorted(glob.glob(os.path.join(REPO, "**", f"{name}*.txtpb"), recursive=True))
    if not found:
      sys.exit(f"error: no {name}*.txtpb in the repository; pass --target-config FILE")
    path = found[0]
  with open(path) as f:
    return f.read()


def gpu_device(name: str, path: str):
  text = target_text(name, path)
  topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
  return topo.devices[0]


def program_facts(compiled) -> dict:
  """Temporaries and what the compiled HLO holds: while loops (with known trip counts) and
  custom calls by target."""
  text = compiled.as_text()
  m = compiled.memory_analysis()
  loops = [ln for ln in text.splitlines() if WHILE.search(ln) and " = " in ln]
  trips = [int(t.group(1)) if (t := TRIP.search(ln)) else None for ln in loops]
  calls: dict[str, int] = {}
  for c in CALL.findall(text):
    calls[c] = calls.get(c, 0) + 1
  return {
    "temp_bytes": int(m.temp_size_in_bytes),
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "while_loops": len(loops),
    "trip_counts": trips,
    "custom_calls": calls,
    "triton_fusions": text.count('"kind":"__triton'),
  }


def moe_loss(impl: str, mode: str):
  def loss(x, experts, w, wgu, wd, g):
    ex = dsp.ExpertWeights(wgu, wd)
    if mode == "dropless":
      y = dsp.dropless(x, experts, w, ex, impl=impl)
    else:
      cap = plans.capacity(CAPACITY_FACTOR, K, T, E, 4)
      order = plans.drop_order("position", experts, w, None, T)
      y, _ = dsp.capacity_dispatch(x, experts, w, ex, cap=cap, group_size=T, order=order, impl=impl)
    return jnp.sum(g * y.astype(jnp.float32))

  return jax.value_and_grad(loss, argnums=(0, 2, 3, 4))


def attention_loss(impl: str):
  def loss(q, k, v):
    return jnp.sum(ATTENTION_IMPLS[impl](q, k, v).astype(jnp.float32) ** 2)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def compile_case(fn, args) -> dict:
  t = time.perf_counter()
  try:
    compiled = jax.jit(fn).lower(*args).compile()
  except Exception as e:  # noqa: BLE001  (a case that does not compile is reported)
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  return {"compile_s": time.perf_counter() - t, **program_facts(compiled)}


def cases(which: list[str], sds):
  bf16 = jnp.bfloat16
  moe_args = (
    sds((T, D), bf16),
    sds((T, K), jnp.int32),
    sds((T, K), jnp.float32),
    sds((E, D, 2 * F), bf16),
    sds((E, F, D), bf16),
    sds((T, D), jnp.float32),
  )
  if "moe" in which:
    for impl in MOE_IMPLS:
      yield f"dropless {impl}", moe_loss(impl, "dropless"), moe_args
  if "capacity" in which:
    for impl in CAPACITY_IMPLS:
      yield f"capacity {impl}", moe_loss(impl, "capacity"), moe_args
  if "attention" in which:
    qkv = (sds((B, L, H, HD), bf16), sds((B, L, G, HD), bf16), sds((B, L, G, HD), bf16))
    for impl in ATTENTION:
      yield f"attention {impl}", attention_loss(impl), qkv


def _gib(n: int) -> str:
  return f"{n / 2**30:.3f}"


def table(rows: list[dict]) -> str:
  out = [
    "| case | compile s | temporaries GiB | while loops (trip counts) | custom calls |",
    "|---|---:|---:|---|---|",
  ]
  for r in rows:
    if "error" in r:
      out.append(f"| {r['case']} | — | — | — | {r['error']} |")
      continue
    trips = ", ".join("?" if t is None else str(t) for t in r["trip_counts"])
    calls = ", ".join(f"{k} ×{v}" for k, v in sorted(r["custom_calls"].items()))
    out.append(
      f"| {r['case']} | {r['compile_s']:.1f} | {_gib(r['temp_bytes'])} | "
      f"{r['while_loops']}{f' ({trips})' if trips else ''} | {calls or '—'} |"
    )
  return "\n".join(out)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="h100")
  p.add_argument("--target-config", default="")
  p.add_argument("--cases", default="moe,capacity,attention")
  p.add_argument("--default-device", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--out", default="")
  p.add_argument("--result", default="", help="benchmarks/results/<NAME>.json")
  args = p.parse_args()
  dev = gpu_device(args.target, args.target_config)
  sharding = jax.sharding.SingleDeviceSharding(dev)
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  ctx = jax.default_device(dev) if args.default_device else contextlib.nullcontext()
  rows = []
  print(f"{dev.device_kind} (compile-only), default device: {args.default_device}", flush=True)
  with ctx:
    for name, fn, fargs in cases(args.cases.split(","), sds):
      rows.append({"case": name, **compile_case(fn, fargs)})
      print(table(rows[-1:]).splitlines()[-1], flush=True)
  report = {"device_kind": dev.device_kind, "default_device": args.default_device, "rows": rows}
  print(table(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_kernels_compile.json"), "w") as f:
      json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "gpu_kernels_compile.md"), "w") as f:
      f.write(f"# {dev.device_kind}, compile-only\n\n{table(rows)}\n")
  figures = {"rows": [result_row(r) for r in rows], "device_kind": dev.device_kind}
  figures["default_device"] = args.default_device
  write_result(args.result or f"gpu_kernels_compile_{args.target}", figures)


def result_row(r: dict) -> dict:
  """One case as flat figures (a case that did not compile keeps its error)."""
  if "error" in r:
    return {"case": r["case"], "error": r["error"]}
  return {
    "case": r["case"],
    "temporaries_GiB": r["temp_bytes"] / 2**30,
    "while_loops": r["while_loops"],
    "trip_counts": ", ".join("?" if t is None else str(t) for t in r["trip_counts"]),
    "custom_calls": ", ".join(f"{k} ×{v}" for k, v in sorted(r["custom_calls"].items())),
    "compile_s": r["compile_s"],
  }


if __name__ == "__main__":
  main()
