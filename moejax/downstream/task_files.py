"""Task YAMLs read before lm-eval loads them, so that a bad file is one line naming it: a
YAML that does not parse, a local data file that does not exist, and the root cause of a
dataset that cannot be built (lm-eval and `datasets` wrap it in generic errors)."""

from __future__ import annotations

import glob
import os

import yaml

from moejax.errors import UserError


class _Loader(yaml.SafeLoader):
  """YAML with lm-eval's tags (`!function ...`) read as plain values."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def parse_error(path: str) -> str | None:
  """Why `path` is not a YAML mapping (None: it is one)."""
  try:
    with open(path, encoding="utf-8") as f:
      doc = yaml.load(f, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)
  except (OSError, UnicodeError, yaml.YAMLError) as e:
    return " ".join(str(e).split())
  return None if isinstance(doc, dict) else "not a mapping of task keys"


def broken_yamls(folder: str) -> list[tuple[str, str]]:
  """(file, why) of every YAML under `folder` that does not parse."""
  files = sorted(glob.glob(os.path.join(folder, "**", "*.y*ml"), recursive=True))
  return [(f, why) for f in files if (why := parse_error(f)) is not None]


def check_data_files(path: str, name: str) -> None:
  """A task YAML's local `dataset_kwargs.data_files` exist (one line naming the first one
  that does not), when the file names any."""
  if parse_error(path) is not None:
    raise UserError(f"--tasks {name}: task file does not parse: {parse_error(path)}")
  with open(path, encoding="utf-8") as f:
    doc = yaml.load(f, Loader=_Loader)  # noqa: S506
  files = ((doc.get("dataset_kwargs") or {}).get("data_files")) or {}
  items = files.items() if isinstance(files, dict) else [("", files)]
  base = os.path.dirname(os.path.abspath(path))
  for split, value in items:
    for p in value if isinstance(value, list) else [value]:
      if not isinstance(p, str) or "://" in p:
        continue
      full = p if os.path.isabs(p) else os.path.join(base, p)
      if not glob.glob(full):
        key = f"dataset_kwargs.data_files.{split}" if split else "dataset_kwargs.data_files"
        raise UserError(f"--tasks {name}: data file {p} ({key} of {path}) does not exist")


def root_cause(e: BaseException) -> str:
  """The innermost exception's class and first line: what `datasets` and lm-eval wrapped."""
  seen = set()
  while True:
    nxt = e.__cause__ or e.__context__
    if nxt is None or id(nxt) in seen:
      break
    seen.add(id(e))
    e = nxt
  first = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {first}" if first else type(e).__name__


OFFLINE = ("OfflineModeIsEnabled", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def offline_hint(e: BaseException, name: str) -> str | None:
  """A one-line message when a Hub download was refused offline, else None."""
  text = f"{root_cause(e)} {e}"
  if not any(k in text for k in OFFLINE):
    return None
  return (
    f"--tasks {name}: its dataset is not in the local cache and the Hub is offline "
    "(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE); carry the data to this machine as a local task "
    "(docs/kgrid.md, 'Offline use, and MMLU': MMLU and GSM8K as JSONL with a YAML)"
  )
