"""Bad configs are rejected before any compilation with one line naming the key.

A seeded fuzz over random invalid configs (each a valid tiny config plus random valid
noise plus one bad value), run in-process through `trainer.check_config`, which is what
`trainer.train` runs first; and the probe's listed cases one by one.
"""

from __future__ import annotations

import random

import jax
import ml_collections
import pytest
from failure_helpers import tiny

from moejax.errors import UserError
from moejax.config.reader import resolve
from moejax.nn import routing
from moejax.training import trainer
from runconfig import as_run

N_FUZZ = 360

# (dotted key, bad value, the name the error line must contain)
BAD: list[tuple[str, object, str]] = []
for key in (
  "train.steps",
  "train.log_every",
  "train.eval_every",
  "train.ckpt_every",
  "train.keep_checkpoints",
  "train.grad_accum",
  "train.eval_sequences",
  "eval.sequences",
  "eval.batch_size",
  "data.batch_size",
):
  BAD += [(key, 0, key), (key, -3, key), (key, "7", key), (key, 2.5, key), (key, None, key)]
for key in ("optim.lr", "optim.weight_decay", "optim.clip_norm", "loss.balance_weight"):
  BAD += [(key, -0.5, key), (key, "x", key)]
BAD += [
  ("optim.b1", 1.5, "optim.b1"),
  ("optim.b1", -0.1, "optim.b1"),
  ("optim.b2", -1.0, "optim.b2"),
  ("optim.b2", 1.0, "optim.b2"),
  ("optim.eps", -1.0, "optim.eps"),
  ("optim.eps", 0.0, "optim.eps"),
  ("optim.min_lr_ratio", 1.5, "optim.min_lr_ratio"),
  ("train.stop_at", 10_000, "train.stop_at"),
  ("train.on_nonfinite", "ignore", "train.on_nonfinite"),
  ("train.max_skips", -1, "train.max_skips"),
  ("train.progress", "yes", "train.progress"),
  ("loss.balance_granularity", "token", "loss.balance_granularity"),
  ("wandb.mode", "loud", "wandb.mode"),
  ("model.d_ff", -1, "model.d_ff"),
  ("model.vocab_size", -5, "model.vocab_size"),
  ("model.moe.rule", "nope", "rule"),
  ("model.moe.top_k", 5, "top_k"),  # k > E = 4
  ("model.moe.top_k", 0, "top_k"),
  ("model.moe.n_groups", 3, "n_groups"),  # does not divide E = 4
  ("model.moe.d_shared", 16, "d_shared"),  # mixtral has no shared expert
  ("model.moe.dispatch", "magic", "dispatch"),
  ("data.corpus", "web", "data.corpus"),
  ("data.format", "csv", "data.format"),
  ("data.tokenizer", "sentencepiece", "data.tokenizer"),
  ("data.seq_len", 1, "data.seq_len"),
  ("data.holdout_fraction", 1.5, "data.holdout_fraction"),
  ("eval.k1", "abc", "eval.k1"),
  ("eval.k2", "zz", "eval.k2"),
  ("mesh.data", 3, "mesh"),  # the batch of 4 does not divide 3 devices (or there are not 3)
  ("train.stepz", 5, "train.stepz"),  # unknown keys, as set inside a config file
  ("model.moe.typo", 1, "model.moe.typo"),
  ("extra", 1, "extra"),
]
# Combinations: capacity <= 0, a sigmoid shared gate without a shared expert, accumulation.
COMBOS: list[tuple[dict, str]] = [
  ({"model.moe.dispatch": "capacity", "model.moe.capacity_factor": 0.0}, "capacity_factor"),
  ({"model.moe.dispatch": "capacity", "model.moe.capacity_factor": -1.0}, "capacity_factor"),
  ({"model.moe.rule": "qwen2_moe", "model.moe.d_shared": 0}, "d_shared"),
  ({"train.grad_accum": 3}, "grad_accum"),  # does not divide data.batch_size = 4
]
# Valid noise: keys and values that keep a tiny config valid.
NOISE = {
  "train.seed": [0, 1, 7],
  "optim.lr": [1e-3, 3e-3],
  "train.log_every": [1, 2, 5],
  "model.moe.rule": ["mixtral", "olmoe", "qwen3_moe"],
  "loss.balance_granularity": ["sequence", "global_batch"],
  "data.seq_len": [8, 16],
}


def with_values(values: dict) -> ml_collections.ConfigDict:
  """tiny() with dotted values set through a plain dict (no ConfigDict type checks, as a
  config file may build one), so wrong types and unknown keys get through."""
  d = tiny().to_dict()
  for dotted, value in values.items():
    *parents, leaf = dotted.split(".")
    node = d
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return ml_collections.ConfigDict(d)


def fuzz_cases(n: int, seed: int = 0) -> list[tuple[dict, str]]:
  rng = random.Random(seed)
  singles = [({k: v}, name) for k, v, name in BAD]
  pool = singles + COMBOS
  cases = list(pool)
  while len(cases) < n:
    bad, name = rng.choice(pool)
    noise = {k: rng.choice(v) for k, v in NOISE.items() if rng.random() < 0.5}
    noise = {k: v for k, v in noise.items() if not any(k == b for b in bad)}
    if "model.moe.rule" in bad:
      noise.pop("model.moe.rule", None)
    if name in ("d_shared",):
      noise.pop("model.moe.rule", None)
    cases.append(({**noise, **bad}, name))
  return cases


def check(c: ml_collections.ConfigDict) -> None:
  """What `python -m moejax.train` checks before it builds anything: the config and the
  grid's cells (eval.k1/eval.k2) in one `config.resolve`, then the mesh against the batch."""
  resolve(c)
  trainer.check_config(as_run(c))


def test_the_valid_base_and_noise_pass():
  check(tiny())
  for key, values in NOISE.items():
    for value in values:
      check(with_values({key: value}))


def test_fuzz_invalid_configs_rejected_before_compiling_naming_the_key():
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: compiles.append(event) if "compile" in event else None
  )
  cases = fuzz_cases(N_FUZZ)
  assert len(cases) >= 300
  failures = []
  for values, name in cases:
    try:
      check(with_values(values))
    except UserError as e:
      line = str(e)
      if "\n" in line or name not in line:
        failures.append((values, f"does not name {name!r} on one line: {line}"))
      continue
    except Exception as e:  # noqa: BLE001  (any other exception is a failure)
      failures.append((values, f"{type(e).__name__}: {e}"))
      continue
    failures.append((values, "accepted"))
  assert not failures, f"{len(failures)} of {len(cases)}: {failures[:10]}"
  assert not compiles, compiles[:5]


@pytest.mark.parametrize("rule", sorted(routing.RULES))
def test_every_named_rule_validates_with_its_shared_expert(rule):
  """Each rule is valid with a shared expert exactly when it has one (sigmoid needs one)."""
  shared = routing.RULES[rule].shared
  values = {"model.moe.rule": rule, "model.moe.d_shared": 16 if shared != "none" else 0}
  if routing.RULES[rule].n_groups > 1:
    values["model.moe.n_experts"] = 2 * routing.RULES[rule].n_groups
  check(with_values(values))
