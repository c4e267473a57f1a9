"""Which accelerator kernels a compiled program holds, read from its optimized HLO text:
each custom call's target, grouped by the kernel family that emits it.

* `tpu`: Mosaic TPU kernels (Pallas on TPU: megablox, splash attention, tokamax's TPU ops),
  `custom_call_target="tpu_custom_call"`;
* `mosaic_gpu`: Mosaic GPU kernels (tokamax's sm90/sm100 ops), `mosaic_gpu...` targets;
* `triton`: Pallas Triton kernels (tokamax's Triton ops), `__gpu$xla.gpu.triton`.

A program compiled for one platform must hold no other platform's kernel: a GPU compile with
a `tpu` kernel is tokamax resolving "mosaic" to its TPU kernel (tokamax 0.0.17 on a host
whose default device is not a GPU), which the GPU cannot run.
"""

from __future__ import annotations

import collections
import re

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
FAMILIES = {
  "tpu": ("tpu_custom_call",),
  "mosaic_gpu": ("mosaic_gpu",),
  "triton": ("__gpu$xla.gpu.triton",),
}
# the kernel families a program compiled for each platform may hold
ALLOWED = {"tpu": ("tpu",), "cuda": ("mosaic_gpu", "triton")}


def family(target: str) -> str | None:
  """The kernel family of one custom call target, or None (cuBLAS, cuDNN, host calls)."""
  for name, prefixes in FAMILIES.items():
    if target.startswith(prefixes):
      return name
  return None


def count(hlo_text: str) -> tuple[tuple[str, int], ...]:
  """(family, number of custom calls) for each kernel family present, sorted by family."""
  found = collections.Counter(family(t) for t in _TARGET.findall(hlo_text))
  return tuple(sorted((f, n) for f, n in found.items() if f is not None))


def foreign(kernels: tuple[tuple[str, int], ...], platform: str) -> tuple[str, ...]:
  """The families in `kernels` a program compiled for `platform` must not hold."""
  allowed = ALLOWED.get(platform, ())
  return tuple(f for f, _ in kernels if f not in allowed)
