"""Per-device bytes of a compiled train step, and whether they fit the target's memory.

The state's bytes are exact from its shardings (`device_bytes`); arguments, outputs,
aliasing, temporaries and code are the compiler's `memory_analysis()`. A TPU program whose
temporaries exceed the HBM is refused by the TPU compiler with RESOURCE_EXHAUSTED, whose
message names both sizes in GiB with two decimals (`parse_oom`); XLA:GPU compiles it and
`memory_analysis()` shows the bytes, which the fit then compares with the pool.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import jax

_OOM = re.compile(
  r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class Footprint(NamedTuple):
  """Per-device bytes of one compiled train step on a target (a `targets.Target`)."""

  target: object  # targets.Target
  impl: str  # the dispatch kernel on the target's platform
  params: int  # exact, from the shardings
  opt_state: int
  router: int
  batch: int
  arguments: int  # the compiler's
  outputs: int
  aliased: int  # outputs written into donated arguments
  temporaries: int
  code: int
  refused: bool  # the TPU compiler ran out of HBM; temporaries from its message
  loops: tuple = ()  # loops.Loop of the compiled program (empty when refused)
  kernels: tuple = ()  # (family, count) of its accelerator kernels (`custom_calls.count`)
  cached: bool = False  # read from an `aot.cache.Store`, not compiled in this process

  @property
  def total(self) -> int:
    """Live at the peak: arguments, outputs not aliased to them, temporaries, code."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  @property
  def fits(self) -> bool:
    return not self.refused and self.total <= self.target.hbm_bytes


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def analysis(ma) -> dict:
  """The Footprint fields of a `CompiledMemoryStats`."""
  return {
    "arguments": ma.argument_size_in_bytes,
    "outputs": ma.output_size_in_bytes,
    "aliased": ma.alias_size_in_bytes,
    "temporaries": ma.temp_size_in_bytes,
    "code": ma.generated_code_size_in_bytes,
  }


def parse_oom(message: str) -> tuple[int, int] | None:
  """(temporaries, available HBM) bytes from the TPU compiler's RESOURCE_EXHAUSTED."""
  m = _OOM.search(message)
  if not m:
    return None
  return (
    int(float(m.group(1)) * _UNITS[m.group(2)]),
    int(float(m.group(3)) * _UNITS[m.group(4)]),
  )


def first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
