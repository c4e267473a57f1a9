"""The one filesystem layer of the corpus readers: `data.paths` (local or `gs://`, globs,
saved HF dataset folders) listed, and files opened as streams, through `etils.epath`
(`runio`; gcsfs for gs://), never copied whole."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from typing import IO

from moejax import cli, remote, runio
from moejax.errors import UserError

HF_STATE = "state.json"  # what `datasets.Dataset.save_to_disk` writes beside its .arrow files
HF_DICT = "dataset_dict.json"  # ... and `DatasetDict.save_to_disk`, above one folder per split


def split_items(paths: str | Sequence[str]) -> list[str]:
  """`data.paths` (a comma-separated string or a list) as its non-empty items."""
  paths = paths or ""
  items = paths.split(",") if isinstance(paths, str) else [str(p) for p in paths]
  return [p for p in (p.strip() for p in items) if p]


def expand_paths(paths: str | Sequence[str]) -> list[str]:
  """`data.paths` to a list of files, in order: globs sorted, a saved HF dataset folder as its
  .arrow files (`hf_dataset_files`)."""
  items = split_items(paths)
  if not items:
    raise UserError("data.paths is empty: data.corpus='files' needs paths (comma-separated)")
  out: list[str] = []
  for item in items:
    item = item if runio.is_remote(item) else os.path.expanduser(item)
    remote.check(item, f"data.paths {item}")
    if glob.has_magic(item):
      matches = _glob(item)
      if not matches:
        raise UserError(f"{item}: glob in data.paths matches no files")
      out.extend(matches)
    elif is_dir(item):
      out.extend(hf_dataset_files(item))
    elif not is_file(item):
      what = "no such file" if runio.is_remote(item) else cli.not_a_file(item)
      raise UserError(f"{item}: {what} (from data.paths)")
    else:
      out.append(item)
  return out


def is_file(p: str) -> bool:
  """A file (locally: a regular file); a gs:// path's bucket is reached first (`remote`)."""
  if not runio.is_remote(p):
    return os.path.isfile(p)
  remote.check(p)
  return runio.path(p).is_file()


def is_dir(p: str) -> bool:
  if not runio.is_remote(p):
    return os.path.isdir(p)
  remote.check(p)
  return runio.path(p).is_dir()


def _glob(item: str) -> list[str]:
  """The files a glob matches, sorted (a remote one listed from the folder before its first
  magic part)."""
  if not runio.is_remote(item):
    return sorted(m for m in glob.glob(item, recursive=True) if os.path.isfile(m))
  remote.check(item)
  parts = item.split("/")
  i = next(i for i, part in enumerate(parts) if glob.has_magic(part))
  root, pattern = "/".join(parts[:i]), "/".join(parts[i:])
  return sorted(str(p) for p in runio.path(root).glob(pattern) if p.is_file())


def hf_dataset_files(folder: str) -> list[str]:
  """The .arrow files of a `save_to_disk` folder in its `state.json` order (a DatasetDict's:
  each split's, in `dataset_dict.json` order), or a UserError for any other folder."""
  root = runio.path(folder)
  if (root / HF_DICT).is_file():
    splits = _json_field(root / HF_DICT, "splits", str)
    return [f for s in splits for f in hf_dataset_files(str(root / s))]
  if not (root / HF_STATE).is_file():
    raise UserError(
      f"{folder}: is a directory without {HF_STATE} (not a saved HF dataset); data.paths "
      f"takes files, globs ('{folder}/*.jsonl') or `save_to_disk` folders"
    )
  entries = _json_field(root / HF_STATE, "_data_files", dict)
  files = [str(root / f["filename"]) for f in entries if isinstance(f.get("filename"), str)]
  if not files:
    raise UserError(f"{root / HF_STATE}: lists no _data_files (a saved HF dataset lists them)")
  return files


def _json_field(p, field: str, kind: type) -> list:
  """The list `field` of the JSON object in file `p` (its items of type `kind`), or a
  UserError naming the file and where it stops parsing: a cut or edited save_to_disk file."""
  try:
    obj = json.loads(p.read_text())
  except json.JSONDecodeError as e:
    raise UserError(
      f"{p}: not JSON ({e.msg} at line {e.lineno} column {e.colno}, byte {e.pos}); the "
      "save_to_disk folder is damaged: save it again (datasets' save_to_disk)"
    ) from None
  except UnicodeDecodeError as e:
    raise UserError(f"{p}: not UTF-8 text (byte {e.start}); save the dataset again") from None
  items = obj.get(field) if isinstance(obj, dict) else None
  if not isinstance(items, list) or not all(isinstance(x, kind) for x in items):
    raise UserError(
      f"{p}: has no list {field!r} of {kind.__name__}s (a save_to_disk folder's {p.name} has "
      "one); save the dataset again"
    )
  return items


def open_binary(path: str) -> IO[bytes]:
  """`path` opened for streamed binary reads, or a UserError naming it."""
  remote.check(path)
  try:
    return runio.path(path).open("rb")
  except OSError as e:
    raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
