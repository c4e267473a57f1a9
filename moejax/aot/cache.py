"""Compiled footprints kept on disk, keyed by exactly what the compiler was given.

A sweep's precheck compiles each distinct program for its accelerator, and the TPU preset's
train step takes ~210 CPU-s to compile on v5e:4x4 whatever its depth (docs/cloud.md), so a
dry run followed by the launch would compile everything twice. Here the compiler's answer
(`memory_analysis()`, the HBM refusal, the while loops) is stored as JSON under a key that
hashes the lowered program's text (`Lowered.as_text()`: deterministic across processes and
without `loc` annotations, but a Pallas kernel's serialized payload carries the source
lines that called it, so editing moejax/kernels/megablox.py above a call is a new key), the
target (name, device count, usable memory, its GpuTargetConfig for
a GPU), the compilers' versions (jax, jaxlib, libtpu, the CUDA plugin) and the flags they
read (XLA_FLAGS, LIBTPU_INIT_ARGS) or the target passes (`Target.compiler_options`). Any
change to the code, the config, the target or the compiler changes the key; a hit skips
only the XLA compile, the lowering still runs. The state's own bytes (params, optimizer,
router, batch) are never stored: they are recomputed from the shardings.

The directory is $MOEJAX_AOT_CACHE, else ~/.cache/moejax/aot. A file that does not parse,
or whose fields do not have their types (`check_types`), is a miss, rewritten after the
compile; writes go through a temporary file and a rename.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile

import jax

from moejax.aot import targets
from moejax.aot.loops import Body, Loop

FORMAT = 2  # bump when the stored fields change (2: loops tagged as layer scans)
ENV = "MOEJAX_AOT_CACHE"
FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
COMPILERS = (
  "jaxlib",
  "libtpu",
  *(f"jax-cuda{v}-{p}" for v in (12, 13) for p in ("plugin", "pjrt")),
)
FIELDS = ("arguments", "outputs", "aliased", "temporaries", "code", "refused")


def default_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(ENV) or pathlib.Path.home() / ".cache" / "moejax" / "aot")


def _version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return ""


def key(program_text: str, target: targets.Target) -> str:
  """The sha256 of what the compile depends on (the module docstring)."""
  h = hashlib.sha256()
  proto = ""
  if target.platform == "cuda":
    proto = targets.target_config(targets.parse_gpu(target.name)[0])
  parts = {
    "format": FORMAT,
    "target": [target.name, target.platform, target.n_devices, target.hbm_bytes, proto],
    **({"options": list(target.compiler_options)} if target.compiler_options else {}),
    "jax": jax.__version__,
    "compilers": {d: _version(d) for d in COMPILERS},
    "flags": {f: os.environ.get(f, "") for f in FLAGS},
  }
  h.update(json.dumps(parts, sort_keys=True).encode())
  h.update(program_text.encode())
  return h.hexdigest()


def _loop_json(lp: Loop) -> list:
  return [lp.name, lp.trip, lp.depth, lp.source, list(lp.body), lp.bound, lp.what]


def _loop(row: list) -> Loop:
  name, trip, depth, source, (kernels, matmuls, collectives, custom), bound, what = row
  body = Body(kernels, matmuls, collectives, tuple((t, n) for t, n in custom))
  return Loop(name, trip, depth, source, body, bound, what)


def encode(compiled: dict) -> str:
  """JSON of a compile's answer: FIELDS, `loops` (a tuple of `Loop`) and `kernels`."""
  out = {f: compiled[f] for f in FIELDS}
  out["loops"] = [_loop_json(lp) for lp in compiled["loops"]]
  out["kernels"] = [list(kv) for kv in compiled["kernels"]]
  return json.dumps(out, sort_keys=True)


def _is(value, kind) -> bool:
  """`value` has the JSON type `kind` (a type or a tuple of them); an int is never a bool."""
  return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _pairs(value) -> bool:
  """A list of [str, int] pairs (custom calls: a loop body's, the program's `kernels`)."""
  return isinstance(value, list) and all(
    isinstance(p, list) and len(p) == 2 and _is(p[0], str) and _is(p[1], int) for p in value
  )


def _typed_loop(row) -> bool:
  """A stored loop: [name, trip, depth, source, body, bound, what] as `_loop_json` writes it."""
  if not (isinstance(row, list) and len(row) == 7):
    return False
  name, trip, depth, source, body, bound, what = row
  opt_int = (int, type(None))
  kinds = (str, opt_int, int, str, opt_int, str)
  if not all(map(_is, (name, trip, depth, source, bound, what), kinds)):
    return False
  return (
    isinstance(body, list) and len(body) == 4
    and all(_is(n, int) for n in body[:3]) and _pairs(body[3])
  )  # fmt: skip


def check_types(d) -> None:
  """A ValueError unless `d` holds every field with its type (byte counts ints, `refused` a
  bool, loops as `_loop_json` writes them): a stored answer of other types is a miss."""
  if not isinstance(d, dict) or any(f not in d for f in (*FIELDS, "loops")):
    raise ValueError("not a compile answer")
  bad = [f for f in FIELDS if not _is(d[f], bool if f == "refused" else int)]
  if not isinstance(d["loops"], list) or not all(map(_typed_loop, d["loops"])):
    bad.append("loops")
  if not _pairs(d.get("kernels")):  # [[custom-call target, count], ...]
    bad.append("kernels")
  if bad:
    raise ValueError(f"compile answer with mistyped fields: {', '.join(bad)}")


def decode(text: str) -> dict:
  """The answer `encode` wrote; a ValueError for one whose fields do not have their types."""
  d = json.loads(text)
  check_types(d)
  out = {f: d[f] for f in FIELDS}
  out["loops"] = tuple(_loop(row) for row in d["loops"])
  out["kernels"] = tuple((str(f), int(n)) for f, n in d["kernels"])
  return out


class Store:
  """Compile answers under `root` (`default_dir()` when None), one JSON file per key;
  `read=False` compiles every program again and replaces what is stored."""

  def __init__(self, root: str | os.PathLike | None = None, read: bool = True):
    self.root = pathlib.Path(root) if root else default_dir()
    self.read = read

  def _path(self, k: str) -> pathlib.Path:
    return self.root / f"{k}.json"

  def load(self, k: str) -> dict | None:
    if not self.read:
      return None
    try:
      return decode(self._path(k).read_text())
    except (OSError, ValueError, KeyError, TypeError):  # missing or unreadable: a miss
      return None

  def save(self, k: str, compiled: dict) -> None:
    self.root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      f.write(encode(compiled))
    os.replace(tmp, self._path(k))
