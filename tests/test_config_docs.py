"""The config schema as documentation: docs/config.md is the table the dataclasses generate,
every key of `base_config()` has exactly one documented row, each key's documented range is
what `config.resolve` enforces, and `describe --keys` prints the table."""

from __future__ import annotations

import math
from pathlib import Path

import ml_collections
import pytest

from moejax import config, describe
from moejax.config import table
from moejax.errors import UserError
from moejax.config.reader import resolve

ROOT = Path(__file__).resolve().parents[1]


def leaf_keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for k in c.keys():
    v = c.get(k)
    if isinstance(v, ml_collections.ConfigDict):
      out += leaf_keys(v, f"{prefix}{k}.")
    else:
      out.append(f"{prefix}{k}")
  return out


def all_rows():
  return [r for name in config.SECTIONS for r in table.section_rows(name)]


def test_docs_config_md_is_the_generated_table():
  want = table.markdown()
  got = (ROOT / "docs" / "config.md").read_text()
  assert got == want, "docs/config.md is stale: python -m moejax.config.table > docs/config.md"


def test_every_key_has_exactly_one_row_with_a_description():
  rows = all_rows()
  keys = [r.key for r in rows]
  assert len(keys) == len(set(keys))
  assert sorted(keys) == sorted(leaf_keys(config.base_config()))
  assert all(r.doc.strip() for r in rows)


def test_each_documented_default_is_the_base_config_value():
  c = config.base_config()
  for r in all_rows():
    node = c
    for part in r.key.split("."):
      node = node[part]
    if "(the rule's)" not in r.default:
      assert r.default == repr(node), r.key


def _outside(r) -> list:
  """Values just outside a row's documented range (from its `allowed` text)."""
  out = []
  for token, op in ((">= ", "ge"), ("> ", "gt"), ("<= ", "le"), ("< ", "lt")):
    if r.allowed.startswith(token):
      bound = float(r.allowed[len(token) :])
      out.append({"ge": bound - 1, "gt": bound, "le": bound + 1, "lt": bound}[op])
  if r.allowed.startswith("["):  # [lo, hi] or [lo, hi)
    lo, hi = (float(x) for x in r.allowed[1:-1].split(","))
    out += [lo - 0.5, hi + 0.5] if r.allowed.endswith("]") else [lo - 0.5, hi]
  if r.allowed.startswith("'"):
    out.append("not-a-choice")
  return out


def _set(c, key: str, value) -> None:
  *parents, leaf = key.split(".")
  node = c
  for p in parents:
    node = node[p]
  node[leaf] = value


# Rows whose range another test checks: the merge rule's fields (composed and checked by
# moejax.nn.routing, tests/test_routing.py), data.tokenizer (a kind with an argument,
# tests/test_data.py) and model.moe.top_k (bounded by n_experts too, checked with it).
ELSEWHERE = {"data.tokenizer", "model.moe.top_k"}
RANGED = [
  r for r in all_rows() if r.allowed and r.key not in ELSEWHERE and "(the rule's)" not in r.default
]


@pytest.mark.parametrize("row", RANGED, ids=lambda r: r.key)
def test_resolve_refuses_a_value_outside_each_documented_range_naming_the_key(row):
  for bad in _outside(row):
    c = config.base_config()
    if row.type == "int" and isinstance(bad, float):
      bad = math.floor(bad)  # an int just outside: ge 1 -> 0, ge 0 -> -1
    _set(c, row.key, bad)
    with pytest.raises(UserError, match=row.key.replace(".", r"\.") + "="):
      resolve(c)


def test_describe_keys_prints_a_section_and_refuses_an_unknown_one(capsys):
  """`describe --keys` in this process (the error line's wording and exit code 2 are
  `cli.run_main`'s, checked through describe's subprocess in tests/test_describe.py)."""
  assert describe.main(["describe", "--keys", "optim"]) == 0
  out = capsys.readouterr().out
  names = [line.split()[0] for line in out.splitlines() if line.startswith("optim.")]
  assert names == [r.key for r in table.section_rows("optim")]
  with pytest.raises(UserError, match=r"^--keys 'optimz'") as e:
    describe.main(["describe", "--keys", "optimz"])
  assert "\n" not in str(e.value)
