"""Is `jax.lax.ragged_dot` expanded on TPU? Compiles it ahead of time for an abstract v5e
chip (no TPU needed; `pip install -e ".[tpu]"`) and prints the TPU compiler's FLOP count
and temporaries for the forward, dx and dW, against megablox's `gmm`/`tgmm`.

`JAX_PLATFORMS=cpu python benchmarks/tpu_ragged_dot.py` (figures in README, Dispatch).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from moejax.kernels import megablox


def compiled_cost(fn, args) -> tuple[float, int, list[str]]:
  """(FLOPs, temporary bytes, custom-call targets) of `fn` compiled for the args' device."""
  c = jax.jit(fn).lower(*args).compile()
  cost = c.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', c.as_text())))
  return float(cost["flops"]), int(c.memory_analysis().temp_size_in_bytes), targets


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=4096)
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--d-expert", type=int, default=256)
  p.add_argument("--experts", type=int, default=64)
  a = p.parse_args()
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
  print(f"rows {M}, d_model {D}, d_expert {F}, E {E}; ideal 2·M·D·F = {2 * M * D * F:.3g} FLOPs")
  print("| kernel | pass | FLOPs | / ideal | temp bytes | custom calls |")
  print("|---|---|---:|---:|---:|---|")
  for name, fn in (("ragged_dot", ragged), ("megablox", gmm)):
    for part, f in (("forward", fn), ("dx", jax.grad(fn, 0)), ("dW", jax.grad(fn, 1))):
      flops, temp, targets = compiled_cost(f, args)
      ratio = flops / (2 * M * D * F)
      print(f"| {name} | {part} | {flops:.3g} | {ratio:.1f} | {temp:,} | {', '.join(targets)} |")


if __name__ == "__main__":
  main()
