"""The worksheet: counts by hand formula, full-size twins against their published counts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import ml_collections
import pytest
from tiers import FULL

from moejax import build, cli, describe
from moejax import config as config_lib
from moejax.config.reader import resolve
from runconfig import as_run

ROOT = Path(__file__).resolve().parents[1]
FULL_DIR = ROOT / "configs" / "full"

# Twin -> (scaled preset it extends, published total, published active), in parameters.
# Every one is reproduced by the `all` convention: embedding table and LM head counted.
PUBLISHED = {
  "mixtral": ("mixtral", 46.7e9, 12.9e9),
  "deepseekmoe": ("deepseekmoe", 16.4e9, 2.8e9),
  "qwen2_moe": ("qwen2_moe", 14.3e9, 2.7e9),
  "qwen3_moe": ("qwen3_moe", 30.5e9, 3.3e9),
  "olmoe": ("olmoe", 6.9e9, 1.3e9),
  "dbrx": ("dbrx", 132e9, 36e9),
}


def key_paths(d, prefix: str = "") -> set[str]:
  d = d.to_dict() if isinstance(d, ml_collections.ConfigDict) else d
  out = set()
  for k, v in d.items():
    out |= key_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
  return out


@pytest.fixture(scope="module")
def sheets():
  """Worksheets of the full-size twins, built once (eval_shape of up to 671B parameters)."""
  names = [*PUBLISHED, "deepseek_v3"]
  return {n: describe.worksheet(as_run(cli.load_file(str(FULL_DIR / f"{n}.py"))).with_vocab(0)) for n in names}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_twin_matches_published_counts(name, sheets):
  _, total, active = PUBLISHED[name]
  ws = sheets[name]
  assert abs(ws.total / total - 1) < 0.02, (ws.total, total)
  assert abs(ws.active / active - 1) < 0.02, (ws.active, active)


def test_every_twin_is_a_complete_valid_config_extending_its_preset():
  base = key_paths(config_lib.base_config())
  for name in [*PUBLISHED, "deepseek_v3"]:
    c = cli.load_file(str(FULL_DIR / f"{name}.py"))
    preset = cli.load_file(str(ROOT / "configs" / f"{name}.py"))
    assert key_paths(c) == base, name
    resolve(c)
    assert c.model.moe.rule == preset.model.moe.rule
    assert c.loss.to_dict() == preset.loss.to_dict()


def mla_params_per_layer() -> int:
  """DeepSeek-V3's MLA attention, from its config.json (q/kv LoRA ranks, head dims)."""
  D, H, q_rank, kv_rank, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
  q = D * q_rank + q_rank + q_rank * H * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
  kv = D * (kv_rank + rope) + kv_rank + kv_rank * H * (nope + v)  # kv_a, kv_a_layernorm, kv_b
  return q + kv + H * v * D  # o_proj


def test_deepseek_v3_matches_published_with_mla(sheets):
  """671B total (without MTP) and 36.6B active without the input embedding (DeepSeek's
  README_WEIGHTS.md), with MLA's attention counted as its config.json has it."""
  ws = sheets["deepseek_v3"]
  a_norms = 1536 + 512  # q_a_layernorm and kv_a_layernorm: the worksheet's norms group
  assert ws.group("attention").total == 61 * (mla_params_per_layer() - a_norms)
  total, active = ws.conventions["no_input_embedding"]
  assert abs(ws.total / 671e9 - 1) < 0.005
  assert abs(active / 36.6e9 - 1) < 0.01
  assert ws.total - total == ws.group("embeddings").total == 129280 * 7168


def tiny(**model) -> ml_collections.ConfigDict:
  c = config_lib.base_config()
  c.model.update(vocab_size=11, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=4)
  c.model.update({"d_ff": 12, "qk_norm": True, "tie_embeddings": False, "first_dense": 1, **model})
  c.model.moe.update(rule="qwen2_moe", n_experts=4, top_k=2, d_expert=6, d_shared=10)
  return c


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_groups_match_hand_formulas(scan):
  V, D, L, H, G, hd, F_dense, E, K, F, S = 11, 8, 3, 2, 1, 4, 12, 4, 2, 6, 10
  V = 128  # the embedding's rows: model.vocab_size=11 padded to a multiple of 128
  n_moe = 2  # layers 1 and 2
  want = {
    "embeddings": V * D,
    "lm_head": D * V,
    "attention": L * (D * H * hd + 2 * D * G * hd + H * hd * D),
    "norms": L * (2 * D + 2 * hd) + D,
    "dense_ffn": 3 * D * F_dense,
    "router": n_moe * D * E,
    "shared_experts": n_moe * (3 * D * S + D),  # + the sigmoid gate's D x 1 kernel
    "routed_experts": n_moe * E * 3 * D * F,
  }
  ws = describe.worksheet(as_run(tiny(scan_layers=scan)).with_vocab(0))
  assert {g.name: g.total for g in ws.groups} == want
  assert ws.group("routed_experts").active == want["routed_experts"] * K // E
  assert ws.active == sum(want.values()) - want["routed_experts"] * (E - K) // E
  assert ws.conventions["non_embedding"][0] == sum(want.values()) - 2 * V * D
  tied = describe.worksheet(as_run(tiny(tie_embeddings=True, scan_layers=scan)).with_vocab(0))
  assert tied.group("lm_head").total == 0 and tied.total == ws.total - D * V


def test_placement_is_every_moe_every_th_layer_after_first_dense():
  ws = describe.worksheet(as_run(tiny(n_layers=9, first_dense=2, moe_every=3)).with_vocab(0))
  assert ws.moe_layers == tuple(i for i in range(9) if i >= 2 and (i - 2) % 3 == 0)
  assert "3 of 9 layers MoE: 2, 5, 8" in ws.placement
  dense = describe.worksheet(as_run(tiny(moe_every=0)).with_vocab(0))
  assert dense.moe_layers == () and dense.total == dense.active and dense.experts == "none"
  assert dense.group("dense_ffn").total == 3 * 3 * 8 * 12


def test_parameters_are_only_shapes():
  mc = as_run(cli.load_file(str(FULL_DIR / "olmoe.py"))).with_vocab(0).model
  leaves = jax.tree_util.tree_leaves(build.abstract_params(mc))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_an_unknown_parameter_path_is_an_error():
  with pytest.raises(ValueError, match="no worksheet group"):
    describe.group_of(("layers", "0", "mystery", "kernel"))
  with pytest.raises(ValueError, match="no worksheet group"):
    describe.group_of(("stacks", "1", "blocks", "0", "mystery", "kernel"))
  assert describe.group_of(("stacks", "1", "blocks", "0", "mlp", "experts", "w_gate_up")) == (
    "routed_experts"
  )


# Configs whose layer stacks cut into different segments (`moejax.nn.stack`): a dense
# prefix and an MoE stack; a moe_every=2 period with a left-over tail; GShard's moe_every=2;
# DeepSeek-V3's 3 dense layers then 58 MoE layers.
LAYOUT_CASES = {
  "first_dense": lambda: tiny(),
  "moe_every_tail": lambda: tiny(n_layers=6, moe_every=2),
  "gshard": lambda: cli.load_file(str(ROOT / "configs" / "gshard.py")),
  "deepseek_v3": lambda: cli.load_file(str(FULL_DIR / "deepseek_v3.py")),
}


def _layout(c, scan: bool):
  """(worksheet, its text, build.count_params, the parameters' top-level names) in one
  layout."""
  c.model.scan_layers = scan
  rc = as_run(c)
  rc = rc.with_vocab(rc.model.vocab_size or 257)  # the config's own vocab where it sets one
  mc = rc.model
  params = build.abstract_params(mc)
  tops = {build.param_names(p)[0] for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  ws = describe.worksheet(rc)
  return ws, describe.format_worksheet(ws), build.count_params(params, mc.moe), tops


@pytest.mark.parametrize("name", sorted(LAYOUT_CASES))
def test_worksheet_and_counts_are_the_same_in_both_layouts(name):
  """`model.scan_layers` changes where parameters live, not what the worksheet prints nor
  what `build.count_params` counts (routed experts at K/E behind a stack's layer axis)."""
  c = LAYOUT_CASES[name]()
  ws, text, count, tops = _layout(c, True)
  ws_unrolled, text_unrolled, count_unrolled, tops_unrolled = _layout(c, False)
  assert "stacks" in tops and "layers" not in tops  # the layouts differ
  assert "layers" in tops_unrolled and "stacks" not in tops_unrolled
  assert text == text_unrolled and ws == ws_unrolled
  assert count == count_unrolled == (ws.total, ws.active)
  assert f"{ws.total:,}" in text and ws.active < ws.total  # the text holds the counts


def test_text_states_router_capacity_losses_and_mesh(sheets):
  c = cli.load_file(str(ROOT / "configs" / "gshard.py"))
  ws = describe.worksheet(as_run(c).with_vocab(257))
  m = c.model.moe
  G = m.group_size or c.data.batch_size * c.data.seq_len // c.train.grad_accum
  cap = max(m.min_capacity, math.ceil(m.capacity_factor * m.top_k * G / m.n_experts))
  text = describe.format_worksheet(ws)
  for fact in (
    "decoder-only",
    f"top-{m.top_k}",
    f"C = {min(cap, G)}",
    f"priority {m.drop_policy}",
    f"balance: {c.loss.balance_weight:g} E",
    "mesh",
    "expert=1",
  ):
    assert fact in text, fact
  v3 = describe.format_worksheet(sheets["deepseek_v3"])
  for fact in ("sigmoid", "s + b", "best 4 of 8 groups", "a = 2.5", "MLA", "58 of 61 layers MoE"):
    assert fact in v3, fact


def test_trainer_records_the_worksheet():
  """config.json's resolved.worksheet; its counts agree with the trainer's own count."""
  from moejax.training import trainer  # pylint: disable=import-outside-toplevel

  c = tiny(vocab_size=0)
  params = build.abstract_params(as_run(c).with_vocab(257).model)
  n_params, n_active = build.count_params(params, as_run(c).moe)
  tokenizer = types.SimpleNamespace(vocab_size=257)
  data = types.SimpleNamespace(tokenizer=tokenizer, describe=dict)
  run = types.SimpleNamespace(
    config=as_run(c).with_vocab(257), data=data, n_params=n_params, n_active=n_active
  )
  ws = trainer.resolved_config(run)["resolved"]["worksheet"]
  assert (ws["total"], ws["active"]) == (n_params, n_active)
  assert ws["vocab_size"] == 257 and ws["padded_vocab"] == 384  # 257 rounded up to 128s
  assert ws["groups"]["embeddings"]["total"] == 384 * 8  # the rows held, padding included
  json.dumps(ws)  # config.json and the wandb config take it as is


def _describe(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "moejax.describe", *args]
  return subprocess.run(
    cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
  )


@FULL
def test_cli_prints_the_worksheet_with_overrides():
  out = _describe("--config", "configs/full/olmoe.py", "--config.model.moe.top_k=4")
  assert out.returncode == 0, out.stderr
  assert "64 routed, top-4, width 1024" in out.stdout
  bad = _describe("--config", "configs/full/olmoe.py", "--config.model.moe.nope=1")
  assert bad.returncode == 2
  assert bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1
