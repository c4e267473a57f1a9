"""Compressed corpus files, chosen by suffix (.gz, .zst, .bz2, .xz) and streamed: a file's
lines, decompressed a chunk at a time; a corrupt or truncated file is a UserError naming it
and the compressed byte reached."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import zlib
from collections.abc import Iterator
from typing import IO, Callable

import zstandard

from moejax.data import filesystem
from moejax.errors import UserError

CHUNK = 1 << 20  # bytes read from a file at a time


def _zstd(raw: IO[bytes]) -> Iterator[bytes]:
  """Decompressed chunks of a zstd stream of one or more frames; a last frame that does not
  end (a truncated file) raises, where `stream_reader` would end quietly."""
  dctx = zstandard.ZstdDecompressor()
  obj, started = dctx.decompressobj(), False
  while data := raw.read(CHUNK):
    while data:
      started = True
      if out := obj.decompress(data):
        yield out
      data = b""
      if obj.eof:
        data, obj, started = obj.unused_data, dctx.decompressobj(), False
  if started:
    raise zstandard.ZstdError("the file ends inside a zstd frame")


Chunks = Callable[[IO[bytes]], Iterator[bytes]]  # the raw stream -> its decompressed chunks


def _stdlib(opener: Callable[[IO[bytes]], IO[bytes]]) -> Chunks:
  """The decompressed chunks of a stdlib codec's file object over the raw stream."""

  def chunks(raw: IO[bytes]) -> Iterator[bytes]:
    with opener(raw) as f:
      while data := f.read(CHUNK):
        yield data

  return chunks


# suffix -> the decompressed chunks of the raw (compressed) stream, streamed
COMPRESSIONS: dict[str, Chunks] = {
  ".gz": _stdlib(lambda raw: gzip.GzipFile(fileobj=raw, mode="rb")),
  ".zst": _zstd,
  ".bz2": _stdlib(lambda raw: bz2.BZ2File(raw, mode="rb")),
  ".xz": _stdlib(lambda raw: lzma.LZMAFile(raw, mode="rb")),
}
_CORRUPT = (OSError, EOFError, zlib.error, zstandard.ZstdError, lzma.LZMAError, ValueError)


def compression(path: str) -> str:
  """The compression suffix of `path` ('' when none)."""
  ext = os.path.splitext(path.lower())[1]
  return ext if ext in COMPRESSIONS else ""


def _corrupt(path: str, raw: IO[bytes], e: BaseException) -> UserError:
  """A UserError naming a corrupt or truncated compressed file and the byte reached."""
  where = ""
  with contextlib.suppress(Exception):
    where = f" near compressed byte {raw.tell():,}"
  why = (str(e).splitlines() or [type(e).__name__])[0][:100] or type(e).__name__
  return UserError(f"{path}: corrupt or truncated {compression(path)} data{where} ({why})")


def lines(path: str) -> Iterator[bytes]:
  """The lines (b'\\n'-terminated) of a file, decompressed by suffix, streamed."""
  with filesystem.open_binary(path) as raw:
    kind = compression(path)
    if not kind:
      yield from raw
      return
    chunks, tail = COMPRESSIONS[kind](raw), []
    while True:
      try:
        data = next(chunks, None)
      except _CORRUPT as e:
        raise _corrupt(path, raw, e) from None
      if data is None:
        break
      *done, rest = data.split(b"\n")
      if done:  # the line held over ends here
        yield b"".join([*tail, done[0], b"\n"])
        yield from (line + b"\n" for line in done[1:])
        tail = []
      tail.append(rest)
    if b"".join(tail):
      yield b"".join(tail)
