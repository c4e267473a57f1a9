"""Run-directory I/O through `etils.epath`, so a `gs://` workdir works as it does for orbax.

Local paths keep their POSIX behaviour (atomic replace, append); on object stores a write
replaces the whole object (objects are written atomically there) and an append rewrites it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath


def path(*parts: str | os.PathLike) -> epath.Path:
  """An `epath.Path` (local or `gs://...`) joining `parts`."""
  return epath.Path(parts[0]).joinpath(*parts[1:])


def is_remote(p: str | os.PathLike) -> bool:
  """True for URL-style paths (gs://, s3://, ...), which have no local filesystem."""
  return "://" in os.fspath(p)


def exists(p: str | os.PathLike) -> bool:
  return path(p).exists()


def read_text(p: str | os.PathLike) -> str:
  return path(p).read_text()


def write_text(p: str | os.PathLike, text: str) -> None:
  """Writes `text`; readers in other processes see the old or the new file, never half."""
  dest = path(p)
  dest.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(p):
    dest.write_text(text)
    return
  tmp = dest.parent / f".{dest.name}.tmp{os.getpid()}"
  tmp.write_text(text)
  os.replace(tmp, dest)


def append_lines(p: str | os.PathLike, lines: list[str]) -> None:
  """Appends newline-terminated `lines` (object stores: read and rewrite the object)."""
  dest = path(p)
  text = "".join(line + "\n" for line in lines)
  if is_remote(p):
    write_text(p, (dest.read_text() if dest.exists() else "") + text)
    return
  dest.parent.mkdir(parents=True, exist_ok=True)
  with dest.open("a") as f:
    f.write(text)


def move_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Moves folder `src` to `dst`, creating `dst`'s parent. Object stores have no rename:
  each object is copied, then `src` is deleted (a crash in between leaves both)."""
  if not is_remote(src):
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    shutil.move(os.fspath(src), os.fspath(dst))
    return
  source, dest = path(src), path(dst)
  for f in _files(source):
    target = dest / f.relative_to(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(f.read_bytes())
  source.rmtree()


def _files(folder: epath.Path) -> Iterator[epath.Path]:
  """Every file under `folder`, recursively (epath's rglob and walk refuse or mangle gs://)."""
  for child in sorted(folder.iterdir()):
    if child.is_dir():
      yield from _files(child)
    else:
      yield child


@contextlib.contextmanager
def local_dir(p: str | os.PathLike) -> Iterator[str]:
  """A local folder standing for `p`: `p` itself when local; for a remote `p` a temporary
  folder whose files are copied to `p` when the block exits without error."""
  if not is_remote(p):
    os.makedirs(p, exist_ok=True)
    yield os.fspath(p)
    return
  tmp = tempfile.mkdtemp(prefix="moejax-")
  try:
    yield tmp
    dest = path(p)
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(tmp)):
      (dest / name).write_bytes(epath.Path(tmp, name).read_bytes())
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
