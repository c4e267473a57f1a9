"""`moejax.prepare`'s output directory: usable before the corpus is read, empty or holding a
prepare of its own (`.prepare/plan.json`), that prepare's plan compared with this one, and
what a refused prepare leaves behind removed (docs/design.md "Prepared data").

A plan is {"format", "data" (the content keys), "part_bytes", "corpus" (after the scan)}.
An `--out` whose plan differs is refused, naming each differing key with both values,
unless that prepare never finished a part: then its files are removed and the plan replaced.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from moejax import cli, runio
from moejax.data import shards
from moejax.errors import UserError

STATE = ".prepare"  # per-part progress and the plan, inside the output directory
PLAN = "plan.json"
NAMES = {"part_bytes": "--part_mb", "format": "format"}  # plan keys not under data./corpus.


class Out(NamedTuple):
  """What `--out` held before this prepare."""

  path: str
  existed: bool
  plan: dict | None  # the plan of a prepare there, if any
  parts: int  # its finished parts (.prepare/part-*.json)


def read_json(p) -> dict | None:
  """A JSON object, or None when missing or unreadable (such a part is redone)."""
  p = runio.path(p)
  if not p.exists():
    return None
  try:
    value = json.loads(p.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  return value if isinstance(value, dict) else None


def write_json(p, value: Any) -> None:
  runio.write_text(p, json.dumps(value, indent=1) + "\n")


def _entries(out: str) -> list[str]:
  p = runio.path(out)
  return sorted(c.name for c in p.iterdir()) if p.exists() else []


def survey(out: str) -> Out:
  """`out` checked before the scan: a directory (or one to make), empty or a prepare's own;
  a UserError naming it otherwise. Nothing is written."""
  cli.check_dir("--out", out)
  entries = _entries(out)
  plan = read_json(runio.path(out, STATE, PLAN))
  state = runio.path(out, STATE)
  parts = len(list(state.glob("part-*.json"))) if state.exists() else 0
  others = [e for e in entries if e != STATE]  # a killed first write leaves STATE alone
  if plan is None and (others or parts):
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    raise UserError(
      f"--out {out} is not empty ({shown}) and holds no prepare of its own "
      f"({STATE}/{PLAN}); use a new or empty directory"
    )
  return Out(out, runio.exists(out), plan, parts)


def _short(value: Any, missing: bool = False) -> str:
  """A plan value as the refusal shows it (a long hash cut, an absent key `unset`)."""
  text = "unset" if missing else repr(value)
  return text if len(text) <= 40 else text[:28] + "..."


def differences(old: dict, new: dict) -> list[str]:
  """`key: old there, new now` for every plan key that differs (data.*, corpus.*)."""
  out = []
  for key in new:
    a, b = old.get(key), new[key]
    if isinstance(b, dict) and isinstance(a, dict):
      out += [
        f"{key}.{k}: {_short(a.get(k), k not in a)} there, {_short(v)} now"
        for k, v in b.items()
        if a.get(k) != v or k not in a
      ]
    elif a != b:
      shown = (a / 1e6, b / 1e6) if key == "part_bytes" and a and b else (a, b)
      out.append(f"{NAMES.get(key, key)}: {_short(shown[0])} there, {_short(shown[1])} now")
  return out


def check_plan(found: Out, plan: dict) -> None:
  """A UserError when `found` holds finished parts of another plan (the keys of `plan`
  only: the data keys before the scan, the corpus after it)."""
  if found.plan is None or not found.parts:
    return
  diff = differences({k: found.plan.get(k) for k in plan}, plan)
  if diff:
    raise UserError(
      f"--out {found.path} holds a prepare of other data ({'; '.join(diff)}); use a new "
      "--out, or the values there (nothing there was changed)"
    )


def start(found: Out, plan: dict) -> None:
  """Writes `plan` once this prepare can run; the files of a different plan that finished
  no part are removed first (a failed or killed prepare does not lock its `--out`)."""
  if found.plan == plan:
    return
  if found.plan is not None:
    discard(found)
  write_json(runio.path(found.path, STATE, PLAN), plan)


OWN = (shards.MANIFEST, shards.TOKENIZER, "tokenizer_config.json")


def discard(found: Out) -> None:
  """Removes what a prepare writes into `--out` (its state, shards and tokenizer), nothing
  else; the directory too when this prepare made it and it is left empty."""
  root = runio.path(found.path)
  if not root.exists():
    return
  for child in root.iterdir():
    if child.name == STATE:
      child.rmtree()
    elif ".array_record" in child.name or child.name in OWN:  # a shard, or a killed write
      child.unlink()
  if not found.existed and not list(root.iterdir()):
    root.rmdir()
