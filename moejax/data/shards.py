"""A prepared corpus on disk (local or gs://, through etils.epath): ArrayRecord shards of
fixed-size int32 windows and `manifest.json`, which lists every shard with its records,
bytes and sha256. `Windows` reads rows through grain's ArrayRecordDataSource, lazily: a
process touches only the records it asks for."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from array_record.python.array_record_data_source import ArrayRecordDataSource
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from etils import epath

from moejax import remote, runio
from moejax.errors import UserError

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = "moejax-prepared-v1"
DTYPE = "<i4"  # each record: one window of seq_len + 1 little-endian int32 token ids
SPLITS = ("train", "heldout")


class ShardInfo(NamedTuple):
  """One ArrayRecord file of a split, as the manifest lists it."""

  file: str  # name inside the prepared directory
  records: int
  bytes: int
  sha256: str


CHUNK = 8 << 20  # bytes read at a time by `sha256_file`


def sha256_file(p: str | os.PathLike) -> str:
  """sha256 of a file's bytes (local or remote), streamed `CHUNK` bytes at a time."""
  h = hashlib.sha256()
  with runio.path(p).open("rb") as f:
    while chunk := f.read(CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _copy_in(local: str, dest: epath.Path) -> None:
  """Puts a finished local file at `dest`: an atomic rename locally, one object write on a
  bucket (objects appear whole), so a killed writer never leaves a half shard behind."""
  if not runio.is_remote(dest):
    os.replace(local, dest)
    return
  dest.write_bytes(epath.Path(local).read_bytes())
  os.remove(local)


def write_shard(directory: str, name: str, windows_NxL1: np.ndarray) -> ShardInfo:
  """Writes the windows as one record each (group_size 1: grain's random access) to
  `directory/name`, through a temporary file; returns what the manifest records."""
  dest = runio.path(directory, name)
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp_dir = os.fspath(dest.parent) if not runio.is_remote(dest) else tempfile.mkdtemp()
  tmp = os.path.join(tmp_dir, f".{name}.tmp{os.getpid()}")
  writer = ArrayRecordWriter(tmp, "group_size:1")
  for row in np.asarray(windows_NxL1, dtype=DTYPE):
    writer.write(row.tobytes())
  writer.close()
  with open(tmp, "rb") as f:
    data = f.read()
  info = ShardInfo(name, int(windows_NxL1.shape[0]), len(data), hashlib.sha256(data).hexdigest())
  _copy_in(tmp, dest)
  if tmp_dir != os.fspath(dest.parent):
    os.rmdir(tmp_dir)
  return info


def _why(e: Exception) -> str:
  """The first line of a reader's error (the C++ reader's status text is long)."""
  return (str(e).splitlines() or [type(e).__name__])[0][:120]


def _footer(p: epath.Path, width: int | None) -> tuple[int, int | None]:
  """(record count, tokens in the first record, None when there is none or no `width` is
  asked for) from the file's footer and its first record."""
  reader = ArrayRecordReader(os.fspath(p))
  try:
    n = reader.num_records()
    first = reader.read([0])[0] if n and width is not None else None
  finally:
    reader.close()
  return n, None if first is None else len(first) // np.dtype(DTYPE).itemsize


def shard_problem(
  directory: str, shard: ShardInfo, width: int | None = None, verify: bool = False
) -> str | None:
  """Why `shard` is not the file the manifest lists (missing, another size or record
  count, records not `width` tokens wide; with `verify`, first, another sha256), naming
  the file; None when it matches. Reads the footer and the first record, and with `verify`
  the whole file (streamed)."""
  p = runio.path(directory, shard.file)
  if not p.exists():
    return f"{p}: missing (listed in {MANIFEST})"
  size = p.stat().length
  if size != shard.bytes:
    return f"{p}: {size} bytes, {MANIFEST} lists {shard.bytes} (truncated or replaced)"
  if verify and (sha := sha256_file(p)) != shard.sha256:
    return f"{p}: sha256 {sha[:12]}..., {MANIFEST} lists {shard.sha256[:12]}... (changed)"
  try:
    n, tokens = _footer(p, width)
  except Exception as e:  # the C++ reader raises RuntimeError/ValueError with long status text
    return f"{p}: not a readable ArrayRecord file ({_why(e)})"
  if n != shard.records:
    return f"{p}: {n} records, {MANIFEST} lists {shard.records}"
  if tokens is not None and tokens != width:
    return (
      f"{p}: records of {tokens} tokens, but {MANIFEST} and data.seq_len={width - 1} make "
      f"windows of {width}"
    )
  return None


def read_manifest(directory: str) -> dict:
  """The manifest of a finished prepare, or a UserError naming the directory."""
  remote.check(directory, f"data.prepared={directory}")
  p = runio.path(directory, MANIFEST)
  if not p.exists():
    raise UserError(
      f"data.prepared={directory}: no {MANIFEST} (not prepared, or the prepare did not "
      f"finish): run python -m moejax.prepare --config C --out {directory}"
    )
  try:
    manifest = json.loads(p.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"{p}: unreadable ({e}); rerun python -m moejax.prepare") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise UserError(f"{p}: not a {FORMAT} manifest; rerun python -m moejax.prepare")
  return manifest


def split_shards(manifest: dict, split: str) -> list[ShardInfo]:
  """The shards the manifest lists for `split`, checked against its own totals."""
  entry = manifest[split]
  shards = [ShardInfo(**s) for s in entry["shards"]]
  if sum(s.records for s in shards) != entry["windows"]:
    raise UserError(
      f"{MANIFEST}: {split} shards hold {sum(s.records for s in shards)} windows, "
      f"the manifest says {entry['windows']}; rerun python -m moejax.prepare"
    )
  return shards


def check_shards(directory: str, manifest: dict, width: int, verify: bool) -> None:
  """A UserError naming the first shard that is not the one the manifest lists (`verify`:
  its sha256 too, `shard_problem`)."""
  for split in SPLITS:
    for shard in split_shards(manifest, split):
      problem = shard_problem(directory, shard, width, verify)
      if problem:
        raise UserError(f"{problem}; rerun python -m moejax.prepare --out {directory}")


class Windows:
  """int32 windows [N, width] in ArrayRecord shards, read on demand: `w[i]` is one row,
  `w[a:b]` an array of rows; `shape` and `len` as for the array it stands for (a grain
  MapDataset source, and the held-out windows of `Data.eval_batches`)."""

  def __init__(self, directory: str, shards: Sequence[ShardInfo], width: int):
    listed = [s for s in shards if s.records]
    paths = [f"{runio.path(directory, s.file)}[0:{s.records}]" for s in listed]
    # Read instructions `path[0:n]` from the manifest: no file is opened until read.
    self._source = ArrayRecordDataSource(paths) if paths else None
    self._files = [str(runio.path(directory, s.file)) for s in listed]
    self._starts = np.cumsum([0] + [s.records for s in listed])
    self.shape = (sum(s.records for s in shards), width)

  def __len__(self) -> int:
    return self.shape[0]

  def _row(self, record: bytes) -> np.ndarray:
    return np.frombuffer(record, dtype=DTYPE).astype(np.int32)

  def _corrupt(self, i: int, e: Exception) -> UserError:
    """The one line for window `i` unreadable at read time (its shard changed after the
    startup check): the shard and record, and how to go on."""
    k = int(np.searchsorted(self._starts, i, side="right")) - 1
    return UserError(
      f"{self._files[k]}: record {i - self._starts[k]} is corrupt ({_why(e)}); the shard "
      "changed after the startup check: restore it (rerun python -m moejax.prepare with the "
      "same --out rewrites it), then rerun to resume from the last checkpoint"
    )

  def _read(self, i: int) -> np.ndarray:
    try:
      return self._row(self._source[i])
    except Exception as e:  # the C++ reader's RuntimeError (a hash mismatch) or DataLossError
      raise self._corrupt(i, e) from None

  def __getitem__(self, key: Any) -> np.ndarray:
    if isinstance(key, slice):
      keys = list(range(*key.indices(len(self))))
      if not keys:
        return np.zeros((0, self.shape[1]), np.int32)
      try:
        return np.stack([self._row(r) for r in self._source.__getitems__(keys)])
      except Exception:  # one read at a time names the record that fails
        return np.stack([self._read(i) for i in keys])
    i = key.__index__()
    if not -len(self) <= i < len(self):
      raise IndexError(f"window {i} of {len(self)}")
    return self._read(i % len(self))

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    out = self[:]
    return out if dtype is None else out.astype(dtype)
