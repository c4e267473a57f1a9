"""Config keys that were renamed (old dotted name -> new), and the one message for a key the
config does not have: the new name when it is an old one, else the nearest key of its
section, and where the keys are documented. Imports nothing heavy: `moejax.cli` uses it
before JAX is imported."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# old dotted key -> its name now (`git log -S <old key>` finds the change)
RENAMED = {
  "data.jsonl_key": "data.text_key",  # the readers registry (Parquet and Arrow read it too)
}


def unknown_key(key: str, known: Iterable[str] = (), flag: bool = False, given: str = "") -> str:
  """`unknown config key KEY; ...` for dotted `key` (`given`: the longer key the user set,
  when `key`, a section of it, is what is missing): its new name if it was renamed, else
  the nearest of `known` (the keys beside `key`) when one is close, then where every key is
  listed. `flag`: the key was given as `--config.KEY=...`."""
  pre = "--config." if flag else ""
  head = f"unknown config key {pre}{given or key}"
  section, _, leaf = key.rpartition(".")
  keys = f"docs/config.md, or python -m moejax.describe --keys {section}".rstrip()
  new = RENAMED.get(key)
  if new is not None:
    return f"{head}: it was renamed {new}, set {pre}{new} instead; every key: {keys}"
  close = difflib.get_close_matches(leaf, list(known), n=1)
  hint = f" (did you mean {pre}{section + '.' if section else ''}{close[0]}?)" if close else ""
  return f"{head}{hint}; the keys are in {keys}"
