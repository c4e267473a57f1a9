"""`describe --fit FAMILY`: the smallest slice of an accelerator family the train step fits.

`FAMILIES` lists each family's sizes, smallest first: the v5e / v6e slices GCP sells
(v5litepod-1 to -256: libtpu's compile-only topologies stop at 16x16) and GPU nodes of 1,
2, 4 and 8 GPUs, then up to 64 nodes of 8. `search` walks them in that order and stops at
the first that fits; each size is, in order:

1. Meshed by `fit_mesh`: a config whose mesh is explicit (`mesh.data` not -1) and covers
   exactly that many devices keeps it; otherwise FSDP fills the slice (MaxText's
   `ici_fsdp_parallelism=-1`): data 1, expert the config's when it divides the devices
   (else their greatest common divisor), fsdp the rest. Data parallelism replicates the
   state, so scaling it never makes a larger model fit; FSDP shards every matrix.
2. Skipped, with the reason, when `data.batch_size` does not divide by data × fsdp ×
   `train.grad_accum` there (the batch is never changed).
3. Skipped when the state alone does not fit (`state_bytes`: parameters, optimizer and
   router state, batch and rng per device, exact from the shardings, no compile). They are
   the step's arguments, live at its peak, so this is a lower bound on the compiled total
   and a skipped size cannot fit: the compiles start at the first size that might.
4. Compiled by `moejax.aot.footprint`, as `describe --topology` / `--gpu` compile, and
   judged by `Footprint.fits`.

The search is linear: per-device memory falls with the slice under FSDP, so after the
lower bound the first or second compile usually fits. The k-grid forward that `--topology`
adds is not compiled (it runs on one device, whatever the slice), nor is the aot cache read.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from typing import NamedTuple

from moejax import sharding
from moejax.aot import memory, programs, targets
from moejax.config.run import RunConfig
from moejax.config.sections import MeshConfig
from moejax.errors import UserError

_V5E_TOPOLOGIES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_NODES = ("1", "2", "4", "8", "2x8", "4x8", "8x8", "16x8", "32x8", "64x8")


class Family(NamedTuple):
  """An accelerator family: its platform and its sizes, smallest first (`--topology` /
  `--gpu` descriptors)."""

  platform: str  # "tpu" | "cuda"
  sizes: tuple[str, ...]


FAMILIES: dict[str, Family] = {
  "tpu-v5e": Family("tpu", tuple(f"v5e:{t}" for t in _V5E_TOPOLOGIES)),
  "tpu-v6e": Family("tpu", tuple(f"v6e:{t}" for t in _V5E_TOPOLOGIES)),
  **{kind: Family("cuda", tuple(f"{kind}:{n}" for n in _NODES)) for kind in targets.GPUS},
}


class Tried(NamedTuple):
  """One size of the search: what was decided there and, when compiled, its footprint."""

  name: str  # "v5e:4x4"
  n_devices: int
  mesh: tuple[int, int, int]  # (data, fsdp, expert)
  hbm_bytes: int  # usable per device
  skipped: str  # why it was not compiled; "" when it was
  footprint: memory.Footprint | None
  config: RunConfig  # the config with this size's mesh
  seconds: float  # lowering and compile

  @property
  def fits(self) -> bool:
    return self.footprint is not None and self.footprint.fits


def family(name: str) -> Family:
  """The `FAMILIES` entry of `--fit NAME`, or a UserError naming the allowed ones."""
  if name not in FAMILIES:
    raise UserError(f"--fit {name} is not allowed; use one of {', '.join(FAMILIES)}")
  return FAMILIES[name]


_NEEDS = {
  "tpu": ("libtpu, the TPU compiler", targets.TPU_INSTALL),
  "cuda": ("the GPU compiler (jax's CUDA plugin)", targets.CUDA_INSTALL),
}


def check(name: str) -> Family:
  """The family of `--fit NAME`, refused before anything compiles when the name is unknown
  or its compiler is not installed."""
  fam = family(name)
  have = targets.libtpu_available() if fam.platform == "tpu" else targets.cuda_available()
  if not have:
    what, install = _NEEDS[fam.platform]
    raise UserError(f"--fit {name} needs {what}: {install}")
  return fam


def target(platform: str, name: str) -> targets.Target:
  """The compile-only devices of one size ('v5e:4x4' on "tpu", 'h100:2x8' on "cuda")."""
  return targets.tpu_target(name) if platform == "tpu" else targets.gpu_target(name)


def fit_mesh(m: MeshConfig, n: int) -> tuple[int, int, int]:
  """(data, fsdp, expert) of a config's mesh `m` on `n` devices (the module docstring, 1)."""
  if m.data != -1 and m.data * m.fsdp * m.expert == n:
    return m.data, m.fsdp, m.expert
  expert = math.gcd(max(m.expert, 1), n)
  return 1, n // expert, expert


def on_mesh(rc: RunConfig, mesh: tuple[int, int, int]) -> RunConfig:
  """`rc` with `mesh` as its data, fsdp and expert."""
  return dataclasses.replace(rc, mesh=MeshConfig(**dict(zip(sharding.AXES, mesh))))


def batch_reason(rc: RunConfig, mesh: tuple[int, int, int]) -> str:
  """Why `rc`'s batch cannot run on `mesh` ("" when it can): it must divide by data × fsdp
  × grad_accum (`trainer.check_config`)."""
  shards = mesh[0] * mesh[1] * rc.train.grad_accum
  if rc.data.batch_size % shards == 0:
    return ""
  return f"batch {rc.data.batch_size} does not divide by {shards}"


def state_bytes(rc: RunConfig, t: targets.Target) -> int:
  """Per-device bytes of the train step's arguments on `t` with `c`'s mesh: the state,
  the batch and the rng, exact from their shardings (nothing compiles; a lower bound on
  `Footprint.total`)."""
  a = programs.abstract_run(rc, t)
  return memory.device_bytes((a.run.state, a.tokens, a.rng))


def try_size(rc: RunConfig, platform: str, name: str) -> Tried:
  """One size of the search: meshed, checked and, unless skipped, compiled."""
  t = target(platform, name)
  mesh = fit_mesh(rc.mesh, t.n_devices)
  sized = on_mesh(rc, mesh)
  row = Tried(name, t.n_devices, mesh, t.hbm_bytes, "", None, sized, 0.0)
  reason = batch_reason(rc, mesh)
  if reason:
    return row._replace(skipped=reason)
  state = state_bytes(sized, t)
  if state > t.hbm_bytes:
    return row._replace(skipped=f"state alone needs {state / 2**30:.2f} GiB/device")
  start = time.perf_counter()
  fp = programs.footprint(sized, t, f"--fit {name}")
  return row._replace(footprint=fp, seconds=time.perf_counter() - start)


def search(rc: RunConfig, name: str) -> Iterator[Tried]:
  """Each size of family `name` tried in order, up to the first that fits."""
  fam = family(name)
  for size in fam.sizes:
    tried = try_size(rc, fam.platform, size)
    yield tried
    if tried.fits:
      return


# ---------------------------------------------------------------------------------- text

_COLUMNS = ("slice", "devices", "mesh", "per device", "compile", "verdict")


def _devices(n: int, platform: str) -> str:
  """'16 chips', '1 chip', '8 GPUs'."""
  unit = "chip" if platform == "tpu" else "GPU"
  return f"{n} {unit}{'s' * (n != 1)}"


def format_intro(rc: RunConfig, name: str) -> str:
  """The lines above the table: the family, the mesh rule in effect and the columns."""
  fam = family(name)
  m = rc.mesh
  given = f"{m.data}×{m.fsdp}×{m.expert}"
  rule = f"FSDP fills each slice (the config's: {given})"
  if m.data != -1:
    rule = f"the config's {given} on {m.data * m.fsdp * m.expert} devices, else FSDP fills it"
  sizes = f"{fam.sizes[0]} up to {fam.sizes[-1]}"
  return "\n".join(
    [
      f"fit search: the smallest {name} slice the train step fits, {sizes};",
      f"  mesh data×fsdp×expert: {rule};",
      "  the batch must divide by data×fsdp×grad_accum (moejax.aot.fit)",
      _line(*_COLUMNS),
    ]
  )


def format_row(t: Tried) -> str:
  """One table row: the size, its mesh, per-device total, compile seconds, verdict."""
  mesh = "×".join(map(str, t.mesh))
  total, secs = "-", "-"
  if t.footprint is not None:
    fp = t.footprint
    total, secs = f"{fp.total / 2**30:.2f} GiB", f"{t.seconds:.1f} s"
    verdict = "fits" if fp.fits else "DOES NOT FIT"
    if fp.refused:
      verdict += " (RESOURCE_EXHAUSTED)"
  else:
    verdict = f"skipped: {t.skipped}"
  return _line(t.name, t.n_devices, mesh, total, secs, verdict)


def _line(*cols) -> str:
  name, devices, mesh, total, secs, verdict = cols
  return f"  {name:<10}{devices:>7}  {mesh:<9}{total:>11}  {secs:>8}  {verdict}"


def format_summary(tried: list[Tried], name: str) -> str:
  """`smallest fit: ...`, or that no size of the family fits."""
  fam = family(name)
  last = tried[-1] if tried else None
  if last is None or not last.fits:
    compiled = sum(t.footprint is not None for t in tried)
    return (
      f"no slice up to {fam.sizes[-1]} fits ({compiled} compiled, {len(tried) - compiled} skipped)"
    )
  total = last.footprint.total / 2**30
  return (
    f"smallest fit: {last.name} ({_devices(last.n_devices, fam.platform)}), {total:.2f} of "
    f"{last.hbm_bytes / 2**30:.2f} GiB per device"
  )


def shown(tried: list[Tried]) -> Tried | None:
  """The size whose fit table follows the summary: the one that fits, else the largest
  compiled (what did not fit, and by how much), else None."""
  compiled = [t for t in tried if t.footprint is not None]
  return compiled[-1] if compiled else None
