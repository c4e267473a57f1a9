"""Which platform a traced program lowers for, and `platform_dependent` on that knowledge.

`jax.lax.platform_dependent` traces (and differentiates) every branch, because a trace does
not know the platform it will be lowered for; only the lowering drops the other branches.
For the MoE kernels that is every accelerator's kernel traced on every host
(docs/performance.md, "Where the MoE step's extra CPU compile goes"). The trainer traces
its steps under a context mesh over the devices they run on (`sharding.tracing_mesh`), and
an AOT target's mesh is over its compile-only devices: that mesh's abstract device names
the platform, so the branches no lowering of this trace can take are left untraced.
Without a context mesh, or one without a device (`jax.export` for another platform), every
branch is kept.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# `AbstractDevice.platform` -> the `platform_dependent` names a lowering for it may take:
# JAX names both CUDA and ROCm devices "gpu".
_LOWERINGS = {"cpu": ("cpu",), "tpu": ("tpu",), "gpu": ("cuda", "rocm")}


def _context_device():
  """The context mesh's abstract device; None without a context mesh or one without a
  device."""
  return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def context_platforms() -> tuple[str, ...] | None:
  """The `platform_dependent` names the program traced now can be lowered for, from the
  context mesh's device; None when no context mesh names one."""
  device = _context_device()
  return None if device is None else _LOWERINGS.get(device.platform)


def lowering_platform() -> str:
  """The platform the program traced now lowers for: the context mesh's device's ("cpu",
  "tpu", "gpu"), else the default backend's (a trace with no context mesh, as the k-grid's
  forwards, lowers for it)."""
  device = _context_device()
  return jax.default_backend() if device is None else device.platform


def platform_dependent(*args, default: Callable | None = None, **branches: Callable):
  """`jax.lax.platform_dependent(*args, default=..., **branches)` with only the branches
  the context's platforms (`context_platforms`) can take traced; one branch left is called
  directly, with no `platform_dependent` at all."""
  known = context_platforms()
  if known is None:
    return jax.lax.platform_dependent(*args, default=default, **branches)
  kept = {p: branches[p] for p in known if p in branches}
  if default is not None and len(kept) < len(known):
    kept["default"] = default
  if not kept:  # the platform has no branch and there is no default: JAX's own error
    return jax.lax.platform_dependent(*args, default=default, **branches)
  fns = list(dict.fromkeys(kept.values()))
  if len(fns) == 1:
    return fns[0](*args)
  default = kept.pop("default", None)
  return jax.lax.platform_dependent(*args, default=default, **kept)
