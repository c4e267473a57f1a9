"""Is `jax.lax.ragged_dot` expanded on TPU? Compiles it ahead of time for an abstract v5e
chip (no TPU needed; `pip install -e ".[tpu]"`) and prints the TPU compiler's FLOP count
and temporaries for the forward, dx and dW, against megablox's `gmm`/`tgmm` and tokamax's
Mosaic TPU `ragged_dot`.

`JAX_PLATFORMS=cpu python benchmarks/tpu_ragged_dot.py` (figures in README, Dispatch).

`--train-step`: the TPU preset's whole train step (configs/study_calibration.py:tpu) on
v5e:4x4 with `impl=megablox` and `impl=tokamax`: per-device FLOPs, temporaries and custom
calls from the TPU compiler. tokamax picks its Mosaic TPU kernel from JAX's default device,
so both are lowered by `aot.lower_train_step`, which traces on a compile-only v5e chip as
the default device (from a CPU host without it, `impl=tokamax` falls back to
`jax.lax.ragged_dot`).

Writes benchmarks/results/tpu_ragged_dot.json (`--train-step`: tpu_ragged_dot_train_step.json;
`--result NAME` for another name).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from moejax.kernels import megablox, tokamax_ragged

sys.path.insert(0, os.path.dirname(__file__))
from aot_compile_time import _set
from common import write_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled_cost(fn, args) -> tuple[float, int, list[str]]:
  """(FLOPs, temporary bytes, custom-call targets) of `fn` compiled for the args' device."""
  c = jax.jit(fn).lower(*args).compile()
  cost = c.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', c.as_text())))
  return float(cost["flops"]), int(c.memory_analysis().temp_size_in_bytes), targets


def train_steps(topology: str, impls: list[str], result: str, sets: list[str]) -> None:
  """The TPU preset's train step compiled per impl: FLOPs and bytes per device."""
  from moejax import aot, cli  # pylint: disable=import-outside-toplevel  (the tpu extra's)
  from moejax.config import resolve

  target = aot.tpu_target(topology)
  print(f"configs/study_calibration.py:tpu train step on {topology} ({target.hbm_source})")
  print("| impl | compile s | TFLOPs/device | temporaries GiB | arguments GiB | tpu custom calls |")
  print("|---|---:|---:|---:|---:|---:|")
  rows = []
  for impl in impls:
    c = cli.load_file(os.path.join(REPO, "configs/study_calibration.py:tpu"))
    c.model.moe.impl = impl
    for assignment in sets:
      _set(c, assignment)
    t = time.perf_counter()
    compiled = aot.lower_train_step(aot.abstract_run(resolve(c), target), target).compile()
    seconds = time.perf_counter() - t
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    m = compiled.memory_analysis()
    calls = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    print(
      f"| {impl} | {seconds:.0f} | {float(cost['flops']) / 1e12:.2f} | "
      f"{m.temp_size_in_bytes / 2**30:.2f} | {m.argument_size_in_bytes / 2**30:.2f} | {calls} |"
    )
    rows.append({
      "impl": impl, "TFLOPs_per_device": float(cost["flops"]) / 1e12,
      "temporaries_GiB": m.temp_size_in_bytes / 2**30,
      "arguments_GiB": m.argument_size_in_bytes / 2**30, "tpu_custom_calls": calls,
      "compile_s": seconds,
    })  # fmt: skip
  write_result(result, {"rows": rows, "topology": topology, "scan_layers": c.model.scan_layers})


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=4096)
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--d-expert", type=int, default=256)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--train-step", action="store_true", help="the TPU preset's step per impl")
  p.add_argument("--topology", default="v5e:4x4")
  p.add_argument("--impls", default="megablox,tokamax")
  p.add_argument("--result", default="", help="benchmarks/results/<NAME>.json")
  p.add_argument("--set", action="append", default=[], help="--train-step: KEY=VALUE override")
  a = p.parse_args()
  if a.train_step:
    train_steps(a.topology, a.impls.split(","), a.result or "tpu_ragged_dot_train_step", a.set)
    return
  topo = topologies.get_topology_desc(
    platform="tpu", topology_name="v5e:2x2", chips_per_host_bounds=(2, 2, 1)
  )
  s = SingleDeviceSharding(topo.devices[0])
  M, D, F, E = a.rows, a.d_model, a.d_expert, a.experts
  args = (
    jax.ShapeDtypeStruct((M, D), jnp.bfloat16, sharding=s),
    jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=s),
    jax.ShapeDtypeStruct((E,), jnp.int32, sharding=s),
  )
  ragged = lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32).sum()
  gmm = lambda x, w, g: megablox.gmm(x, w, g, 512, False).sum()
  tokamax = lambda x, w, g: tokamax_ragged.gmm(x, w, g, ("mosaic",)).astype(jnp.float32).sum()
  print(f"rows {M}, d_model {D}, d_expert {F}, E {E}; ideal 2·M·D·F = {2 * M * D * F:.3g} FLOPs")
  print("| kernel | pass | FLOPs | / ideal | temp bytes | custom calls |")
  print("|---|---|---:|---:|---:|---|")
  rows = []
  for name, fn in (("ragged_dot", ragged), ("megablox", gmm), ("tokamax", tokamax)):
    for part, f in (("forward", fn), ("dx", jax.grad(fn, 0)), ("dW", jax.grad(fn, 1))):
      with jax.default_device(topo.devices[0]):  # tokamax: its Mosaic TPU kernel
        flops, temp, targets = compiled_cost(f, args)
      ratio = flops / (2 * M * D * F)
      print(f"| {name} | {part} | {flops:.3g} | {ratio:.1f} | {temp:,} | {', '.join(targets)} |")
      rows.append({
        "kernel": name, "pass": part, "FLOPs": flops, "over_ideal": ratio, "temp_bytes": temp,
        "custom_calls": ", ".join(targets),
      })  # fmt: skip
  write_result(a.result or "tpu_ragged_dot", {"rows": rows, "ideal_FLOPs": float(2 * M * D * F)})


if __name__ == "__main__":
  main()
