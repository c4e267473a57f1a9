"""Every config file resolves to the same dicts as before issue 20's tidy, key by key.

`tests/data/configs_resolved.json` was written by the code before the tidy moved the
builders (its `_generated` names the commit): per config file (and `:arg` variant), the
whole ConfigDict, the resolved merge rule, the typed ModelConfig (vocabulary 257) and the
LossConfig. A refactor that changes one default, drops a key or builds a field differently
fails here naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moejax import cli
from moejax import config as config_lib

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = json.loads((ROOT / "tests" / "data" / "configs_resolved.json").read_text())["specs"]


def _jsonable(x):
  def fallback(o):
    return dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)

  return json.loads(json.dumps(x, default=fallback))


def _resolve(spec: str) -> dict:
  c = cli.load_file(str(ROOT / spec))
  rc = config_lib.typed(c)  # a study's base file: its sweep completes the cross-section keys
  return _jsonable(
    {
      "config": c.to_dict(),
      "rule": rc.resolved_rule(),
      "model": dataclasses.asdict(rc.with_vocab(257).model),
      "loss": dataclasses.asdict(rc.with_shards(1).loss),
    }
  )


# Keys added since the snapshot, with the value every config file resolves them to; each is
# checked, then dropped before the comparison (issue 34: the layer stack as a scan).
# Issue 36: `model.not_modelled` became a ModelConfig field (every key one dataclass's), so the
# typed model carries the config's text; a callable value is read from the resolved dict.
def _mixer_sections(where):
  from moejax.config import defaults

  return lambda got: defaults.section_defaults(f"model.{where}")


# Issues 58 and 61: the token mixer per layer and its sections, dropped where a config keeps
# the default (GQA, RMSNorm, as before); a preset that sets them (deepseek_v3, deepseek_v2_lite,
# qwen3_5_moe and their full twins) keeps them in its snapshot entry, which those issues
# regenerated from the code that added them (`_generated_mixers` in the JSON).
ADDED_IF_DEFAULT = {
  **{(*top, "model", "mixers"): "gqa" for top in (("config",), ())},
  **{(*top, "model", "norm"): "rms" for top in (("config",), ())},
  **{(*top, "model", "partial_rotary_factor"): 1.0 for top in (("config",), ())},
  **{(*top, "model", sub): _mixer_sections(sub)
     for top in (("config",), ()) for sub in ("mla", "gated_deltanet")},  # fmt: skip
}
ADDED = {
  ("config", "model", "scan_layers"): True,
  ("model", "scan_layers"): True,
  ("config", "model", "scan_unroll"): -1,  # by platform and remat (model.auto_unroll)
  ("model", "scan_unroll"): -1,
  ("model", "not_modelled"): lambda got: got["config"]["model"]["not_modelled"],
  # issue 51: tiktoken rank files take a split pattern
  ("config", "data", "tiktoken_pattern"): "",
  # Issue 53: the learning-rate schedule by name (cosine, as before, unless a file sets it).
  ("config", "optim", "schedule"): "cosine",
  ("config", "optim", "decay_fraction"): 0.2,
  ("config", "optim", "decay_shape"): "1-sqrt",
  ("config", "train", "compile_cache"): "auto",
  ("config", "train", "profile_steps"): "",
  ("config", "train", "tensorboard"): True,
  ("config", "train", "async_checkpoints"): True,
  # Issue 51: the embedding padded to a multiple of 128 rows (a ModelConfig field, not a key).
  ("model", "vocab_multiple"): 128,
}
# Keys renamed since the snapshot: new path -> old path (issue 51: `data.jsonl_key` became
# `data.text_key`, the JSONL field and the Parquet/Arrow column); the value moves back.
RENAMED = {("config", "data", "text_key"): ("config", "data", "jsonl_key")}


def _without_added(got: dict) -> dict:
  for new, old in RENAMED.items():
    *parents, leaf = new
    node = got
    for key in parents:
      node = node[key]
    node[old[-1]] = node.pop(leaf)
  for path, value in ADDED.items():
    *parents, leaf = path
    node = got
    for key in parents:
      node = node[key]
    want = value(got) if callable(value) else value
    assert node.pop(leaf) == want, path
  for path, value in ADDED_IF_DEFAULT.items():
    *parents, leaf = path
    node = got
    for key in parents:
      node = node[key]
    if node[leaf] == (value(got) if callable(value) else value):
      node.pop(leaf)
  return got


def _differences(want, got, path: str = "") -> list[str]:
  """Every key path where `got` differs from `want` (missing, extra or another value)."""
  if isinstance(want, dict) and isinstance(got, dict):
    out = [f"{path}{k}: missing" for k in want if k not in got]
    out += [f"{path}{k}: not in the snapshot" for k in got if k not in want]
    for k in want.keys() & got.keys():
      out += _differences(want[k], got[k], f"{path}{k}.")
    return out
  return [] if want == got else [f"{path.rstrip('.')}: {want!r} before, {got!r} now"]


def test_the_snapshot_covers_every_config_file():
  files = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.py")}
  assert files <= {spec.partition(":")[0] for spec in SNAPSHOT}


@pytest.mark.parametrize("spec", sorted(SNAPSHOT))
def test_config_resolves_as_before(spec):
  assert _differences(SNAPSHOT[spec], _without_added(_resolve(spec))) == []


def test_differences_names_the_key():
  """The comparison itself can fail, and says where."""
  want = {"model": {"moe": {"top_k": 2, "rule": "mixtral"}}, "loss": {}}
  got = {"model": {"moe": {"top_k": 4, "rule": "mixtral", "extra": 1}}}
  assert sorted(_differences(want, got)) == [
    "loss: missing",
    "model.moe.extra: not in the snapshot",
    "model.moe.top_k: 2 before, 4 now",
  ]
