"""Architecture-family presets under configs/: complete keys, valid, and they build and train.

Helpers (`load_preset`, `shrink_for_test`, `build_model`, `lm_loss_and_grads`) are public
so a later train-step test can reuse them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from tiers import FULL, one_default

from moejax import build
from moejax import config as config_lib
from moejax.nn import losses, routing
from moejax.nn.model import ModelConfig, Transformer, is_moe_layer
from moejax.training import workdir as workdir_lib
from moejax.config.reader import resolve
from runconfig import as_run

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
VOCAB_SIZE = 257  # the byte tokenizer's vocabulary

# Preset file name -> the merge rule it must select (docs/design.md §2).
PRESET_RULES = {
  "switch": "switch",
  "gshard": "gshard",
  "mixtral": "mixtral",
  "deepseekmoe": "deepseek_v2_lite",
  "deepseek_v3": "deepseek_v3",
  "deepseek_v2_lite": "deepseek_v2_lite",
  "qwen2_moe": "qwen2_moe",
  "qwen3_moe": "qwen3_moe",
  "qwen3_5_moe": "qwen3_5_moe",
  "dbrx": "dbrx",
  "olmoe": "olmoe",
  "olmo": "olmo",
}
PRESETS = sorted(PRESET_RULES)
CAPACITY_PRESETS = {"switch", "gshard"}
QK_NORM_PRESETS = {"olmoe", "olmo", "qwen3_moe", "qwen3_5_moe"}


def load_preset(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """Runs configs/<name>.py's get_config() without absl flags."""
  path = CONFIG_DIR / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"moejax_preset_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def key_paths(d, prefix: str = "") -> set[str]:
  """Dotted paths of every leaf of a (nested) dict / ConfigDict."""
  d = d.to_dict() if isinstance(d, ml_collections.ConfigDict) else d
  out = set()
  for k, v in d.items():
    path = f"{prefix}{k}"
    if isinstance(v, dict):
      out |= key_paths(v, path + ".")
    else:
      out.add(path)
  return out


def shrink_for_test(
  cfg: ml_collections.ConfigDict, batch_size: int = 2, seq_len: int = 16
) -> ml_collections.ConfigDict:
  """A copy with a tiny batch; a capacity `group_size` is cut to divide the batch's tokens."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.data.batch_size, cfg.data.seq_len = batch_size, seq_len
  group = cfg.model.moe.group_size
  if group and (batch_size * seq_len) % group:
    cfg.model.moe.group_size = math.gcd(group, batch_size * seq_len)
  return cfg


def build_model(cfg: ml_collections.ConfigDict, seed: int = 0) -> tuple[ModelConfig, Transformer]:
  mc = as_run(cfg).with_vocab(VOCAB_SIZE).model
  return mc, build.transformer(mc, seed)


def tiny_tokens(cfg: ml_collections.ConfigDict, seed: int = 0) -> jax.Array:
  """[batch_size, seq_len + 1] random byte tokens (inputs and next-token targets)."""
  shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
  return jax.random.randint(jax.random.key(seed), shape, 0, VOCAB_SIZE, jnp.int32)


# Tests run tiny programs once: skipping LLVM's optimizations halves CPU compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnames=("graphdef", "train"), compiler_options=FAST_COMPILE)
def lm_loss_and_grads(graphdef, params, rest, tokens_BxL1, rng, *, train: bool = True):
  """Next-token cross-entropy, its gradient w.r.t. params, logits and per-MoE-layer aux."""

  def loss_fn(p):
    model = nnx.merge(graphdef, p, rest)
    logits_BxLxV, routers = model(tokens_BxL1[:, :-1], train=train, rng=rng)
    loss, _ = losses.cross_entropy(logits_BxLxV, tokens_BxL1[:, 1:])
    return loss, (logits_BxLxV, [ro.diag._asdict() for ro in routers.values()])

  (loss, (logits, auxes)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, grads, logits, auxes


def split_model(model: Transformer):
  return nnx.split(model, nnx.Param, ...)


@pytest.fixture(scope="module")
def base_keys() -> set[str]:
  return key_paths(config_lib.base_config())


def test_every_preset_is_listed():
  files = {p.stem for p in CONFIG_DIR.glob("*.py")}
  assert set(PRESETS) <= files, set(PRESETS) - files


@pytest.mark.parametrize("name", PRESETS)
def test_preset_keys_rule_and_validate(name, base_keys):
  cfg = load_preset(name)
  assert isinstance(cfg, ml_collections.ConfigDict)
  keys = key_paths(cfg)
  assert keys == base_keys, f"missing {sorted(base_keys - keys)}, extra {sorted(keys - base_keys)}"
  resolve(cfg)
  m = cfg.model.moe
  assert m.rule == PRESET_RULES[name]
  rule = as_run(cfg).moe.merge_rule
  # A rule with a shared coefficient needs a shared expert, and only such rules have one.
  assert (m.d_shared > 0) == (rule.shared != "none"), (m.d_shared, rule.shared)
  assert (m.dispatch == "capacity") == (name in CAPACITY_PRESETS)
  assert cfg.model.qk_norm == (name in QK_NORM_PRESETS)
  # Aux-loss-free bias updates only where selection uses the bias (DeepSeek-V3).
  assert (cfg.loss.bias_update_rate > 0) == rule.selection_bias
  # Tiny, byte-level, stdlib: runnable on a laptop CPU.
  assert 64 <= cfg.model.d_model <= 128 and 2 <= cfg.model.n_layers <= 4
  assert 8 <= m.n_experts <= 16 and 32 <= m.d_expert <= 128
  assert 64 <= cfg.data.seq_len <= 128 and 8 <= cfg.data.batch_size <= 16
  assert cfg.data.tokenizer == "byte" and cfg.data.corpus == "stdlib"
  assert cfg.train.steps <= 500


def test_family_specifics():
  switch, gshard, v3 = (load_preset(n) for n in ("switch", "gshard", "deepseek_v3"))
  assert switch.model.moe.top_k == 1 and switch.model.moe.jitter_eps == 0.01
  assert (switch.model.moe.capacity_factor, switch.model.moe.eval_capacity_factor) == (1.25, 2.0)
  assert gshard.model.moe.top_k == 2 and gshard.model.moe.second_expert == "random"
  assert gshard.model.moe_every == 2 and gshard.model.moe.group_size > 0
  rule = as_run(v3).moe.merge_rule
  assert (rule.n_groups, rule.topk_groups, rule.group_score) == (8, 4, "top2_sum")
  assert v3.loss.balance_granularity == "sequence" and v3.loss.balance_weight == 0.0001
  assert v3.loss.bias_update_rate == 0.001
  assert load_preset("qwen3_moe").loss.balance_granularity == "global_batch"
  assert load_preset("deepseekmoe").model.first_dense == 1


@pytest.mark.parametrize("name", one_default(PRESETS, "mixtral"))
def test_preset_forward_and_grads(name):
  cfg = shrink_for_test(load_preset(name))
  mc, model = build_model(cfg)
  graphdef, params, rest = split_model(model)
  tokens = tiny_tokens(cfg)
  loss, grads, logits, auxes = lm_loss_and_grads(
    graphdef, params, rest, tokens, jax.random.key(1), train=True
  )
  B, L = cfg.data.batch_size, cfg.data.seq_len
  assert logits.shape == (B, L, mc.padded_vocab) and mc.padded_vocab == 384  # 257, padded
  assert (np.asarray(logits).argmax(-1) < VOCAB_SIZE).all()  # the padded ids are masked
  n_moe = sum(is_moe_layer(mc, i) for i in range(mc.n_layers))
  assert n_moe >= 1 and len(auxes) == n_moe
  assert np.isfinite(float(loss)) and abs(float(loss) - np.log(VOCAB_SIZE)) < 1.0
  leaves = jax.tree_util.tree_leaves_with_path(grads)
  bad = [jax.tree_util.keystr(p) for p, g in leaves if not np.all(np.isfinite(np.asarray(g)))]
  assert not bad, bad
  router_grads = [  # one [D, E] per MoE layer: a scanned stack's rows, or a layer's own
    row
    for p, g in leaves
    if "router" in jax.tree_util.keystr(p)
    for row in (g if "'stacks'" in jax.tree_util.keystr(p) else [g])
  ]
  assert len(router_grads) == n_moe and all(g.ndim == 2 for g in router_grads)
  assert any(float(jnp.abs(g).max()) > 0 for g in router_grads)  # routing is differentiable
  for aux in auxes:
    assert all(np.isfinite(float(v)) for v in aux.values())
  if cfg.model.moe.dispatch == "capacity":
    assert all(0.0 <= float(a["drop_fraction"]) < 1.0 for a in auxes)
  else:
    assert all(float(a["drop_fraction"]) == 0.0 for a in auxes)


# --------------------------------------------------------------------------- conventions

# Each preset's balance-loss convention, from its source (see each preset's docstring):
# HF transformers / flaxformer count f over tokens (Σf = K); MegaBlocks, OLMo-core and
# DeepSeek over assignments (Σf = 1); lingvo's GShard counts top-1 choices per group.
PRESET_BALANCE = {
  "mixtral": ("count", "all"),
  "qwen2_moe": ("count", "all"),
  "qwen3_moe": ("count", "all"),
  "qwen3_5_moe": ("count", "all"),
  "switch": ("count", "all"),
  "gshard": ("fraction", "top1"),
  "dbrx": ("fraction", "all"),
  "olmo": ("fraction", "all"),
  "olmoe": ("fraction", "all"),
  "deepseekmoe": ("fraction", "all"),
  "deepseek_v2_lite": ("fraction", "all"),
  "deepseek_v3": ("fraction", "all"),
}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_balance_convention(name):
  cfg = load_preset(name)
  assert (cfg.loss.balance_convention, cfg.loss.balance_choices) == PRESET_BALANCE[name]
  if name == "gshard":  # per routing group = one sequence (group_size = seq_len)
    assert cfg.loss.balance_granularity == "sequence"
    assert cfg.model.moe.group_size == cfg.data.seq_len


# --------------------------------------------------------------------------- composed rules

REPO = CONFIG_DIR.parent
PARSE = (
  "import json, sys; from moejax import cli, config, train; "
  "cli.parse_flags(sys.argv, train._CONFIG); "
  "print(json.dumps(config.resolve(train._CONFIG.value).resolved_rule()))"
)


def _subprocess(args: list[str], cwd=REPO):
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
  )


@pytest.mark.parametrize(
  "overrides,want",
  [
    (
      ["rule=megatron", "scale=2.827", "score=sigmoid", "selection_bias=True"],
      dict(score="sigmoid", norm="sum", scale=2.827, shared="unit", selection_bias=True),
    ),
    pytest.param(
      ["rule=olmoe", "scale=k", "norm=sum"],
      dict(score="softmax", norm="sum", scale="k"),
      marks=FULL,
    ),
    pytest.param(
      ["rule=dbrx", "lp=2", "selection_bias=false"], dict(norm="lp", lp=2.0), marks=FULL
    ),
  ],
)
def test_rule_fields_through_the_cli_flag_parser(overrides, want):
  flags = [f"--config.model.moe.{o}" for o in overrides]
  out = _subprocess(["-c", PARSE, "--config", "configs/quickstart.py", *flags])
  assert out.returncode == 0, out.stderr
  rule = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(rule) == set(routing.RULE_FIELDS)
  assert {k: rule[k] for k in want} == want
  assert isinstance(rule["scale"], str) or isinstance(rule["scale"], float)


def test_invalid_rule_field_is_one_line_exit_2(tmp_path):
  out = _subprocess(
    [
      "-m",
      "moejax.train",
      "--config",
      "configs/quickstart.py",
      "--workdir",
      str(tmp_path / "run"),
      "--config.model.moe.lp=2",  # mixtral normalizes by the sum: lp would do nothing
    ]
  )
  assert out.returncode == 2, out.stderr
  assert out.stderr.count("\n") == 1 and "model.moe.lp" in out.stderr, out.stderr


def _save_run(workdir, c):
  """config.json as a run of `c` writes it (the raw config plus resolved.rule)."""
  workdir.mkdir()
  saved = c.to_dict()
  saved["resolved"] = {"rule": as_run(c).resolved_rule()}
  (workdir / "config.json").write_text(json.dumps(saved))
  return saved


KIMI = ["rule=megatron", "scale=2.827", "score=sigmoid", "selection_bias=True"]


@pytest.mark.parametrize("case", ["changed_flag", "changed_named_rule"])
def test_resume_with_a_changed_resolved_rule_exits_2(tmp_path, case):
  c = load_preset("quickstart")
  for o in KIMI:
    key, value = o.split("=")
    c.model.moe[key] = {"True": True}.get(value, value)
  c.model.moe.scale = 2.827
  saved = _save_run(tmp_path / "run", c)
  flags = [f"--config.model.moe.{o}" for o in KIMI]
  if case == "changed_flag":  # the same composed rule, but α changed on resume
    flags[1] = "--config.model.moe.scale=2.5"
  else:  # same command, but the run resolved another α (as if RULES had changed since)
    saved["resolved"]["rule"]["scale"] = 3.0
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
  args = ["-m", "moejax.train", "--config", "configs/quickstart.py", "--workdir"]
  out = _subprocess([*args, str(tmp_path / "run"), *flags])
  assert out.returncode == 2, out.stderr
  assert out.stderr.count("\n") == 1 and "model.moe.scale" in out.stderr, out.stderr


def test_from_saved_gives_the_trained_rule():
  c = load_preset("quickstart")
  c.model.moe.update(rule="megatron", scale=5.0)
  saved = c.to_dict()
  saved["resolved"] = {"rule": as_run(c).resolved_rule()}
  assert as_run(workdir_lib.from_saved(saved)).moe.merge_rule.scale == 5.0
  # The grid routes with the rule the run trained with, whatever RULES says today.
  saved["resolved"]["rule"]["norm"] = "none"
  rule = as_run(workdir_lib.from_saved(saved)).moe.merge_rule
  assert rule == routing.MergeRule(norm="none", scale=5.0, shared="unit")
