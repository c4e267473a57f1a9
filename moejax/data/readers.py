"""Corpus file readers (`data.format`), a registry: each streams one file's documents, in
order, through `filesystem` (local or gs://). Text and JSONL may be compressed (.gz, .zst,
.bz2, .xz, by suffix: `compression`); Parquet is read a row group at a time; a saved HF
dataset's .arrow files a record batch at a time (Arrow IPC). JSONL, Parquet and Arrow take
the text from `data.text_key`; empty texts are skipped."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Callable, NamedTuple

from array_record.python.array_record_module import ArrayRecordReader

from moejax import runio
from moejax.data import filesystem
from moejax.data.compression import compression, lines
from moejax.errors import UserError, check_choice

try:  # the `corpora` extra (~170 MB): only Parquet and Arrow files need it
  import pyarrow as pa
  import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - the test extra installs it
  pa = pq = None

TEXT_DOCS = ("file", "paragraph")


class FileOptions(NamedTuple):
  """The data.* keys a file reader may use."""

  text_key: str = "text"
  text_docs: str = "file"


def _decode(data: bytes, where: str) -> str:
  """UTF-8 text, or a UserError naming `where`."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    msg = f"{where}: not UTF-8 text (byte {e.start}); set data.format if the extension misleads"
    raise UserError(msg) from None


def read_text(path: str, text_docs: str = "file") -> Iterator[str]:
  """A text file as one doc (`file`), or one doc per blank-line-separated paragraph."""
  text = _decode(b"".join(lines(path)), path)
  if text_docs == "file":
    if text.strip():
      yield text
    return
  paras = [p.strip("\n") for p in text.replace("\r\n", "\n").split("\n\n")]
  yield from (p for p in paras if p.strip())


def read_jsonl(path: str, key: str = "text") -> Iterator[str]:
  """One doc per non-blank line, from string field `key`."""
  for n, raw in enumerate(lines(path), start=1):
    line = _decode(raw, f"{path}:{n}")
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{n}: bad JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
      raise UserError(f"{path}:{n}: a JSON {type(obj).__name__}; need an object with {key!r}")
    if key not in obj:
      has = ", ".join(repr(k) for k in list(obj)[:10]) or "none"
      raise UserError(f"{path}:{n}: no key {key!r} (data.text_key); this object has {has}")
    if not isinstance(obj[key], str):
      got = type(obj[key]).__name__
      raise UserError(f"{path}:{n}: key {key!r} must hold a string, got {got}")
    if obj[key]:
      yield obj[key]


def _need_pyarrow(path: str) -> None:
  if pa is None:
    raise UserError(f"{path}: Parquet and Arrow files need pyarrow: pip install 'moejax[corpora]'")


def _text_column(path: str, schema, key: str) -> int:
  """The index of string column `key`, or a UserError naming the columns there are."""
  if key not in schema.names:
    has = ", ".join(repr(n) for n in schema.names[:20]) or "none"
    raise UserError(f"{path}: no column {key!r} (data.text_key); its columns: {has}")
  typ = schema.field(key).type
  if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or _is_view(typ)):
    raise UserError(f"{path}: column {key!r} (data.text_key) holds {typ}, not strings")
  return schema.get_field_index(key)


def _is_view(typ) -> bool:
  return bool(getattr(pa.types, "is_string_view", lambda t: False)(typ))


def _docs(path: str, key: str, columns: Iterator) -> Iterator[str]:
  """The non-empty strings of a column's chunks; a null is a UserError naming its row."""
  row = 0
  for col in columns:
    if col.null_count:
      i = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
      raise UserError(f"{path}: row {row + i}: column {key!r} is null, need a string")
    yield from (doc for doc in col.to_pylist() if doc)
    row += len(col)


def _why(e: BaseException) -> str:
  return (str(e).splitlines() or [""])[0][:120] or type(e).__name__


def _arrow_error(path: str, what: str, e: BaseException) -> UserError:
  return UserError(f"{path}: not a readable {what} file ({_why(e)})")


def _damaged(path: str, where: str, rows: int, f, e: BaseException) -> UserError:
  """A UserError for a file that opened but fails part-way: `where` (a row group, a record
  batch), the rows read before it and the byte the reader had reached."""
  at = ""
  with contextlib.suppress(Exception):
    at = f", near byte {f.tell():,}"
  return UserError(
    f"{path}: {where} is damaged (after {rows:,} rows{at}: {_why(e)}); the file is corrupt or "
    "truncated: re-create it, or leave it out of data.paths"
  )


def _read_guarded(path: str, f, parts: Iterator, name: Callable[[int], str]) -> Iterator:
  """`parts` (a file's row groups or record batches, read lazily) with a read failure of
  part i turned into `_damaged(... name(i) ...)`."""
  i, rows = 0, 0
  while True:
    try:
      part = next(parts)
    except StopIteration:
      return
    except (pa.ArrowException, OSError) as e:
      raise _damaged(path, name(i), rows, f, e) from None
    yield part
    i, rows = i + 1, rows + part.num_rows


def read_parquet(path: str, key: str = "text") -> Iterator[str]:
  """Column `key` of a Parquet file, read one row group at a time (`iter_batches` reads a
  Python file object whole before its first batch)."""
  _need_pyarrow(path)
  with filesystem.open_binary(path) as f:
    try:
      pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
      raise _arrow_error(path, "Parquet", e) from None
    _text_column(path, pf.schema_arrow, key)
    n = pf.num_row_groups
    groups = (pf.read_row_group(i, columns=[key]) for i in range(n))
    groups = _read_guarded(path, f, groups, lambda i: f"row group {i} of {n}")
    yield from _docs(path, key, (chunk for g in groups for chunk in g.column(0).chunks))


def read_arrow(path: str, key: str = "text") -> Iterator[str]:
  """Column `key` of an Arrow IPC file, the random-access format (magic `ARROW1`) or the
  stream format (a saved HF dataset's .arrow files), read a record batch at a time."""
  _need_pyarrow(path)
  with filesystem.open_binary(path) as f:
    random_access = f.read(6) == b"ARROW1"
    f.seek(0)
    try:
      reader = pa.ipc.open_file(f) if random_access else pa.ipc.open_stream(f)
    except (pa.ArrowException, OSError) as e:
      raise _arrow_error(path, "Arrow IPC", e) from None
    index = _text_column(path, reader.schema, key)
    if random_access:
      batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
      batches = iter(reader)
    batches = _read_guarded(path, f, batches, lambda i: f"record batch {i}")
    yield from _docs(path, key, (b.column(index) for b in batches))


def read_arrayrecord(path: str) -> Iterator[str]:
  """One doc per record; records are UTF-8 text bytes. The C++ reader takes local files: a
  remote one is copied to a temporary file first."""
  with _local_copy(path) as local:
    try:
      reader = ArrayRecordReader(local)
      records = reader.read_all()
      reader.close()
    except Exception as e:  # the C++ reader raises RuntimeError/ValueError with long status text
      why = (str(e).splitlines() or [type(e).__name__])[0][:120]
      raise UserError(f"{path}: not a readable ArrayRecord file ({why})") from None
  yield from (d for i, r in enumerate(records) if (d := _decode(r, f"{path}:record {i}")))


@contextlib.contextmanager
def _local_copy(path: str) -> Iterator[str]:
  if not runio.is_remote(path):
    with filesystem.open_binary(path):
      pass
    yield path
    return
  with tempfile.TemporaryDirectory() as tmp:
    local = os.path.join(tmp, "records.array_record")
    with filesystem.open_binary(path) as src, open(local, "wb") as dst:
      while chunk := src.read(1 << 24):
        dst.write(chunk)
    yield local


# data.format values (besides `auto`, which picks one by suffix): format -> reader.
READERS: dict[str, Callable[[str, FileOptions], Iterator[str]]] = {
  "text": lambda path, opts: read_text(path, opts.text_docs),
  "jsonl": lambda path, opts: read_jsonl(path, opts.text_key),
  "parquet": lambda path, opts: read_parquet(path, opts.text_key),
  "arrow": lambda path, opts: read_arrow(path, opts.text_key),
  "arrayrecord": lambda path, opts: read_arrayrecord(path),
}
FORMATS = ("auto", *READERS)
# `auto`: the format of a file by its name, compression suffix removed ('' = text)
SUFFIXES = {
  ".jsonl": "jsonl",
  ".parquet": "parquet",
  ".arrow": "arrow",
  ".arrayrecord": "arrayrecord",
}


def file_format(path: str, fmt: str) -> str:
  """The format to read `path` with: `fmt`, or by its name when `fmt` is 'auto'."""
  check_choice("data.format", fmt, FORMATS)
  if fmt != "auto":
    return fmt
  base = os.path.basename(path).lower()
  if compression(base):
    base = os.path.splitext(base)[0]
    if base.endswith(".json"):  # Dolma's documents/*.json.gz are JSON lines
      return "jsonl"
  if ".array_record" in base:
    return "arrayrecord"
  return SUFFIXES.get(os.path.splitext(base)[1], "text")


def read_file(path: str, fmt: str, opts: FileOptions) -> Iterator[str]:
  """The docs of one file with the reader `fmt` picks; an empty file is a UserError."""
  kind = file_format(path, fmt)
  empty = True
  for doc in READERS[kind](path, opts):
    empty = False
    yield doc
  if empty:
    raise UserError(f"{path}: empty, no documents (read as {kind})")
