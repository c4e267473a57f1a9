"""Temporaries of the trainer's compiled step, scanned against unrolled, on 8 CPU devices.

Run: python benchmarks/scan_memory.py
A bf16 MoE (d_model 256, 4 layers, E 16 of width 128, top-4, batch 32 x 128) with FSDP over
8 host devices, compiled by the trainer's own `compile_steps`, for each `model.remat`
policy in both layouts. XLA:CPU's memory_analysis() is exact for that program; it is the
cheap stand-in for the TPU/GPU compiles (benchmarks/aot_compile_time.py --layouts). Writes
benchmarks/results/scan_memory.json.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax

from moejax.config import resolve
from moejax import config as config_lib
from moejax import sharding
from moejax.training import trainer

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result


def temporaries_mib(scan: bool, remat: str) -> float:
  c = config_lib.base_config()
  c.model.update(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, dtype="bfloat16")
  c.model.update(remat=remat, scan_layers=scan)
  c.model.moe.update(n_experts=16, top_k=4, d_expert=128, impl="fused")
  c.data.update(corpus="synthetic", synthetic_docs=200, batch_size=32, seq_len=128)
  c.mesh.update(data=1, fsdp=8)
  c.wandb.mode = "disabled"
  run = trainer.build(resolve(c), None)
  train_step, _ = trainer.compile_steps(run)
  tokens = jax.ShapeDtypeStruct(
    (32, 129), jax.numpy.int32, sharding=sharding.batch_sharding(run.mesh)
  )
  compiled = train_step.lower(run.state, tokens, jax.random.key(0)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
  argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
  print("| remat | unrolled MiB | scanned MiB | scanned/unrolled |")
  print("|---|---:|---:|---:|")
  rows = []
  for remat in ("none", "full", "minimal"):
    u, s = temporaries_mib(False, remat), temporaries_mib(True, remat)
    print(f"| {remat} | {u:.1f} | {s:.1f} | {s / u:.2f} |")
    row = {"remat": remat, "unrolled_MiB": u, "scanned_MiB": s}
    rows.append({**row, "scanned_over_unrolled": s / u})
  write_result("scan_memory", {"rows": rows})


if __name__ == "__main__":
  main()
