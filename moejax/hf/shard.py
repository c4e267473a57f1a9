"""One safetensors shard, read tensor by tensor straight into float32 destinations.

The format is an 8-byte little-endian header length, a JSON header (name → dtype, shape,
byte range of the data after the header) and the raw little-endian data. Reading it here,
rather than through `safetensors.safe_open`, keeps jax out of the import: numpy has no
bfloat16, so safetensors reads BF16 tensors only through a framework, and a jax round trip
(a device buffer, its float32 copy, then the host copy) is what made the import's
resident memory grow past the model. Here a tensor's bytes are read into one buffer of its
own size and converted (bfloat16 through `ml_dtypes`, exactly) while being copied into
its row, expert slice or gate/up half of the float32 parameter.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Self

import ml_dtypes
import numpy as np

from moejax.errors import UserError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn}  # FP8: with block scales (moejax.hf.fp8)  # fmt: skip
MAX_HEADER = 100 * 2**20  # the safetensors library's own limit


class Entry(NamedTuple):
  """One tensor of a shard: its dtype name, shape and absolute byte range in the file."""

  dtype: str
  shape: tuple[int, ...]
  start: int
  stop: int


def _bad(path: str, why: str) -> UserError:
  return UserError(f"{path}: not a readable safetensors file ({why})")


def _entry(v: dict, base: int) -> Entry:
  """A header's tensor record; its data offsets count from `base`, the end of the header."""
  start, stop = v["data_offsets"]
  return Entry(v["dtype"], tuple(v["shape"]), base + start, base + stop)


def header(path: str) -> dict[str, Entry]:
  """Tensor name → Entry, in file order, from the shard's header alone."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    if not 0 < n <= min(MAX_HEADER, size - 8):
      raise _bad(path, f"header length {n} for a {size}-byte file")
    try:
      meta = json.loads(f.read(n))
      entries = {name: _entry(v, 8 + n) for name, v in meta.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, IndexError) as e:
      raise _bad(path, f"header: {e}") from None
  if any(e.stop > size for e in entries.values()):
    raise _bad(path, "a tensor's data runs past the end of the file")
  return dict(sorted(entries.items(), key=lambda kv: kv[1].start))


class Shard:
  """An open shard: `entries` from its header, `read(name)` one tensor at a time."""

  def __init__(self, path: str):
    self.path, self.entries = path, header(path)
    self._file = open(path, "rb")  # noqa: SIM115  (closed by close() / the with block)

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *_) -> None:
    self.close()

  def close(self) -> None:
    self._file.close()

  def read(self, name: str) -> np.ndarray:
    """The tensor in its stored dtype (bfloat16 as `ml_dtypes.bfloat16`), one buffer."""
    e = self.entries[name]
    if e.dtype not in DTYPES:
      raise UserError(
        f"tensor {name} in {self.path} has dtype {e.dtype}; only {', '.join(DTYPES)} are read"
      )
    dtype = np.dtype(DTYPES[e.dtype])
    if e.stop - e.start != math.prod(e.shape) * dtype.itemsize:
      raise _bad(self.path, f"tensor {name}: {e.stop - e.start} bytes for shape {list(e.shape)}")
    buf = np.empty(e.stop - e.start, np.uint8)
    self._file.seek(e.start)
    if self._file.readinto(buf) != buf.size:
      raise _bad(self.path, f"tensor {name} is truncated")
    return buf.view(dtype).reshape(e.shape)
