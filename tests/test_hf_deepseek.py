"""moejax.hf on DeepSeek-V2, V2-Lite, V3 and Kimi-K2: tiny random transformers checkpoints
(transformers 5.24's own config classes and modeling code are the reference), imported,
compared, exported; FP8 block-scaled checkpoints; Hub ids from an offline cache.

Cases (issue 61), every norm randomized (a 1-initialized norm hides a swapped scale):
* `v2`: no query LoRA, greedy top-k, 2 shared experts, YaRN with mscale 0.707 (V2-Lite);
* `v2_grouped`: query LoRA, `group_limited_greedy`, routed_scaling_factor 1.5 (V2);
* `v3`: query LoRA, 4 groups keeping 2, a non-zero `e_score_correction_bias`, scale 2.5,
  renormalized, YaRN with mscale 1.0, and a multi-token-prediction layer in the checkpoint;
* `kimi_k2`: V3's code with Kimi-K2's shape: 16 experts in one group, scale 2.827, YaRN
  (factor 32, beta_fast = beta_slow = 1, θ 50000), saved as Kimi-K2's config.json says
  (`model_type: kimi_k2`, legacy `rope_scaling` + `rope_theta`).
The default tier checks `v3` (the most features) and the config-level cases; the full tier
every case in both layouts, and lm-eval's HF model on V2 and V3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file, save_file
from test_hf import TEXT, compiled, hf_logits, randomize, write_tokenizer
from tiers import FULL

from moejax.config.reader import from_values, resolve
from moejax.errors import UserError
from moejax.hf import deepseek, families, runstate
from moejax.hf.exporter import export_run
from moejax.hf.importer import import_checkpoint
from moejax.kgrid.loading import load_config, load_run
from moejax.nn import routing, stack
from moejax.nn.model import layer_segments
from moejax.training import workdir as workdir_lib

V, L, K, K1 = 128, 3, 4, 2
COMMON = {
  "vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": L,
  "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
  "v_head_dim": 6, "n_routed_experts": 8, "num_experts_per_tok": K, "moe_intermediate_size": 12,
  "first_k_dense_replace": 1, "tie_word_embeddings": False, "eos_token_id": 1,
  "bos_token_id": None, "pad_token_id": None,
}  # fmt: skip


def yarn(factor, mscale, original=16, theta=10000.0, beta_fast=32.0, beta_slow=1.0) -> dict:
  """`rope_parameters` of a YaRN config, and its max_position_embeddings (factor × original)."""
  params = {
    "rope_type": "yarn", "rope_theta": theta, "factor": factor, "mscale": mscale,
    "mscale_all_dim": mscale, "original_max_position_embeddings": original,
    "beta_fast": beta_fast, "beta_slow": beta_slow,
  }  # fmt: skip
  return {"rope_parameters": params, "max_position_embeddings": int(factor * original)}


CONFIGS = {
  "v2": lambda: transformers.DeepseekV2Config(
    **COMMON, q_lora_rank=None, topk_method="greedy", n_shared_experts=2, **yarn(40.0, 0.707)
  ),
  "v2_grouped": lambda: transformers.DeepseekV2Config(
    **COMMON, q_lora_rank=12, topk_method="group_limited_greedy", n_group=4, topk_group=2,
    n_shared_experts=1, routed_scaling_factor=1.5, max_position_embeddings=64,
  ),
  "v3": lambda: transformers.DeepseekV3Config(
    **COMMON, q_lora_rank=12, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    n_shared_experts=1, norm_topk_prob=True, **yarn(40.0, 1.0),
  ),
  "kimi_k2": lambda: transformers.DeepseekV3Config(
    **(COMMON | {"n_routed_experts": 16}), q_lora_rank=12, n_group=1, topk_group=1,
    routed_scaling_factor=2.827, n_shared_experts=1, norm_topk_prob=True,
    **yarn(32.0, 1.0, theta=50000.0, beta_fast=1.0, beta_slow=1.0),
  ),
}  # fmt: skip
# What each router computes, read from transformers' DeepseekV2TopkRouter/V3TopkRouter.
RULES = {
  "v2": routing.MergeRule(norm="none", shared="unit"),
  "v2_grouped": routing.MergeRule(
    norm="none", scale=1.5, shared="unit", n_groups=4, topk_groups=2, group_score="max"
  ),
  "v3": routing.MergeRule(
    score="sigmoid",
    scale=2.5,
    shared="unit",
    selection_bias=True,
    n_groups=4,
    topk_groups=2,
    group_score="top2_sum",
  ),
  "kimi_k2": routing.MergeRule(
    score="sigmoid", scale=2.827, shared="unit", selection_bias=True, group_score="top2_sum"
  ),  # one group: its score decides nothing
}
BIASED = ("v3", "kimi_k2")
OPTS = {"text_docs": "paragraph", "seq_len": 16, "sequences": 8, "batch_size": 4,
        "holdout_fraction": 0.3, "progress": False}  # fmt: skip
QUIET = {"log": lambda *_: None}


def kimi_config_json(hf: dict) -> dict:
  """transformers' saved DeepseekV3Config as Kimi-K2's own config.json writes it."""
  rope = dict(hf.pop("rope_parameters"))
  hf["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")
  return hf | {"model_type": "kimi_k2", "rope_scaling": rope, "topk_method": "noaux_tc",
               "scoring_func": "sigmoid", "num_nextn_predict_layers": 0}  # fmt: skip


def add_mtp_layer(src) -> None:
  """A multi-token-prediction layer as V3 publishes it (`model.layers.{L}.*`), which moejax
  does not model: import must skip it."""
  tensors = load_file(src / "model.safetensors")
  D = COMMON["hidden_size"]
  g = torch.Generator().manual_seed(5)
  tensors |= {
    f"model.layers.{L}.eh_proj.weight": torch.randn(D, 2 * D, generator=g),
    f"model.layers.{L}.enorm.weight": torch.ones(D),
    f"model.layers.{L}.self_attn.q_a_proj.weight": torch.randn(12, D, generator=g),
    f"model.layers.{L}.mlp.experts.0.gate_proj.weight": torch.randn(12, D, generator=g),
  }  # fmt: skip
  save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def hf_model(case: str):
  """The case's random transformers model: norms around 1, a random selection bias."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(CONFIGS[case](), dtype=torch.float32)
  model = model.eval()
  randomize(model)
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for mod in model.modules():
      if hasattr(mod, "e_score_correction_bias"):  # a buffer: `randomize` leaves it at 0
        b = mod.e_score_correction_bias
        b.copy_(0.3 * torch.randn(b.shape, generator=g))
  return model


class Imported(dict):
  """(case, scan_layers) → (HF model, run dir, compiled moejax forward, HF source dir, import
  log), each imported on first use from one checkpoint per case."""

  def __init__(self, root):
    super().__init__()
    self.root, self.sources = root, {}
    self.text = root / "heldout.txt"
    self.text.write_text(TEXT)

  def opts(self, **extra) -> dict:
    return OPTS | {"text": str(self.text)} | extra

  def checkpoint(self, case):
    """(HF model, source dir) of the case, saved on first use."""
    if case not in self.sources:
      self.sources[case] = self.source(case)
    return self.sources[case]

  def __missing__(self, key):
    case, scan = key
    model, src = self.checkpoint(case)
    run, lines = self.root / f"{case}_{'scanned' if scan else 'unrolled'}_run", []
    import_checkpoint(str(src), str(run), self.opts(scan_layers=scan), log=lines.append)
    r = load_run(str(run), load_config(str(run)), None)  # as `moejax.evaluate` loads it
    mj = nnx.merge(r.graphdef, r.params, r.router)
    self[key] = (model, run, compiled(mj, K1), src, lines)
    return self[key]

  def source(self, case):
    model = hf_model(case)
    src = self.root / f"{case}_hf"
    model.save_pretrained(src)
    write_tokenizer(src)
    if case == "v3":
      add_mtp_layer(src)
    if case == "kimi_k2":
      hf = json.loads((src / "config.json").read_text())
      (src / "config.json").write_text(json.dumps(kimi_config_json(hf)))
    return model, src


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  return Imported(tmp_path_factory.mktemp("hf_deepseek"))


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, V, size=(2, 12)).astype(np.int32)


CASES = [
  pytest.param(case, scan, marks=() if (case, scan) == ("v3", True) else FULL,
               id=f"{case}-{'scanned' if scan else 'unrolled'}")
  for case in CONFIGS
  for scan in (True, False)
]  # fmt: skip


@pytest.mark.parametrize(("case", "scan"), CASES)
def test_import_matches_transformers(imported, tokens, case, scan):
  """Logits at every position within 1e-4 of transformers' at the native K, and the
  (k1, native) cell equal to transformers at num_experts_per_tok = k1."""
  hf, _, mj, _, lines = imported[case, scan]
  got, got1 = mj(tokens)
  ref = hf_logits(hf, tokens, K)
  assert np.abs(ref).max() > 1.0  # far from uniform: the comparison can fail
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  ref1 = hf_logits(hf, tokens, K1)
  assert np.abs(ref1 - ref).max() > 1e-2  # k1 changes the output
  np.testing.assert_allclose(got1, ref1, atol=1e-4, rtol=0)
  if case in BIASED:  # the selection bias decides experts here: dropping it would show
    biases = [
      m.e_score_correction_bias for m in hf.modules() if hasattr(m, "e_score_correction_bias")
    ]
    saved = [b.clone() for b in biases]
    with torch.no_grad():
      for b in biases:
        b.zero_()
      unbiased = hf_logits(hf, tokens, K)
      for b, s in zip(biases, saved):
        b.copy_(s)
    assert np.abs(unbiased - ref).max() > 1e-2
  if case == "v3":  # its checkpoint holds an MTP layer, skipped with a note
    assert any(f"model.layers.{L}.*" in line and "multi-token" in line for line in lines)


@pytest.mark.parametrize(
  "case", [pytest.param(c, marks=() if c == "v3" else FULL) for c in CONFIGS]
)
def test_export_round_trips(imported, tokens, case, tmp_path):
  """Import then export gives back transformers' tensors bit for bit (the selection bias
  included, the MTP layer left out): Δlogit 0.0. Kimi-K2 exports as DeepSeek-V3."""
  hf, run, _, _, _ = imported[case, True]
  export_run(str(run), str(tmp_path / "out"), **QUIET)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert type(back) is type(hf)
  want, got = hf.state_dict(), back.state_dict()
  assert sorted(got) == sorted(want)
  assert all(torch.equal(got[n], want[n]) for n in want), [
    n for n in want if not torch.equal(got[n], want[n])
  ]
  assert np.abs(hf_logits(back.eval(), tokens, K) - hf_logits(hf, tokens, K)).max() == 0.0


def saved_config(case: str) -> dict:
  """The config.json `save_pretrained` writes for the case (Kimi-K2's as Kimi writes it)."""
  hf = json.loads(CONFIGS[case]().to_json_string(use_diff=False))
  return kimi_config_json(hf) if case == "kimi_k2" else hf


@pytest.mark.parametrize("case", list(CONFIGS))
def test_config_translation_gives_each_router_and_attention(case):
  """Each config resolves to the merge rule its transformers router computes (read from the
  modeling code, `RULES`), the MLA shapes and RoPE it builds, and n_shared ×
  moe_intermediate_size of shared width; the saved `head_dim` (the rope head dim) is not
  read as moejax's."""
  hf = saved_config(case)
  fam = families.detect(hf, "config.json")
  assert fam.name == ("deepseek_v2" if case.startswith("v2") else "deepseek_v3")
  model = deepseek.to_moejax(hf, fam, "config.json")
  mc = resolve(from_values({"model": model})).model
  assert mc.moe.merge_rule == RULES[case]
  assert mc.mixers == "mla" and mc.head_dim == 0 and hf["head_dim"] == COMMON["qk_rope_head_dim"]
  assert (mc.first_dense, mc.moe_every, mc.d_ff) == (1, 1, COMMON["intermediate_size"])
  assert mc.moe.d_shared == hf["n_shared_experts"] * COMMON["moe_intermediate_size"]
  cfg = CONFIGS[case]()
  assert mc.mla.q_lora_rank == (cfg.q_lora_rank or 0)
  rope = cfg.rope_parameters
  assert mc.rope_theta == rope["rope_theta"] and mc.mla.rope_type == rope["rope_type"]
  if case == "v2":  # transformers' V2 router ignores norm_topk_prob, and so does the import
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg.norm_topk_prob = True
    router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    _, w_TxK, _ = router(torch.randn(5, COMMON["hidden_size"]))
    assert (w_TxK.sum(-1) < 0.99).all()  # not renormalized
    renorm = deepseek.to_moejax(hf | {"norm_topk_prob": True}, fam, "config.json")
    assert resolve(from_values({"model": renorm})).model.moe.merge_rule == RULES["v2"]
  if rope["rope_type"] == "yarn":
    # the attention's softmax scale: transformers' `scaling` on its own module
    attn = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn
    assert mc.mla.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


def test_bad_configs_are_one_line_errors(tmp_path):
  """An unknown topk_method, attention_bias, moe_layer_freq other than 1 and an unsupported
  RoPE type stop before anything is written, naming the key."""
  src = tmp_path / "src"
  src.mkdir()
  v2, v3 = saved_config("v2"), saved_config("v3")
  for hf, match in (
    (v2 | {"topk_method": "sparsemixer"},
     "topk_method='sparsemixer' is not supported; use one of greedy, group_limited_greedy"),
    (v3 | {"topk_method": "greedy"}, "topk_method='greedy' is not supported; use one of noaux_tc"),
    (v2 | {"attention_bias": True}, "attention_bias=True is not supported; use false"),
    (v3 | {"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported; use 1"),
    (v2 | {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
  ):  # fmt: skip
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UserError, match=match) as e:
      import_checkpoint(str(src), str(tmp_path / "run"), {"progress": False}, **QUIET)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
  """DeepSeek's quantizer: each block's amax / 448 (e4m3's largest value), a loop."""
  b0, b1 = block
  rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
  s = torch.empty(rows, cols)
  for r in range(rows):
    for c in range(cols):
      s[r, c] = w[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1].abs().max() / 448.0
  return s


def expand(s: torch.Tensor, shape, block) -> torch.Tensor:
  return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def test_fp8_checkpoint_dequantizes_on_import(imported, tmp_path):
  """V3's published FP8 layout (e4m3 `*_proj.weight` with float32 `weight_scale_inv` block
  scales, the rest bf16; blocks of 16 × 8 so that tensors span several blocks, partial
  ones included) imports to the weights of its bf16 cast (DeepSeek's `fp8_cast_bf16`: q·s
  in bf16) within bf16 rounding, and near the original weights within e4m3's; an FP8
  weight without its scale is a one-line error."""
  src = imported.checkpoint("v3")[1]
  block = (16, 8)
  fp8_dir, bf16_dir = tmp_path / "fp8", tmp_path / "bf16"
  fp8, bf16, original = {}, {}, {}
  for name, w in load_file(src / "model.safetensors").items():
    if name.endswith("_proj.weight"):
      s = block_scales(w, block)
      q = (w / expand(s, w.shape, block)).to(torch.float8_e4m3fn)
      fp8[name], fp8[name + "_scale_inv"] = q, s
      bf16[name] = (q.float() * expand(s, w.shape, block)).bfloat16()
      original[name] = w
    else:
      fp8[name] = bf16[name] = w.bfloat16()
  hf = json.loads((src / "config.json").read_text())
  quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": list(block)}  # fmt: skip
  for d, tensors, cfg in (
    (fp8_dir, fp8, hf | {"quantization_config": quant}),
    (bf16_dir, bf16, hf),
  ):
    d.mkdir()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copy(src / name, d / name)
    import_checkpoint(str(d), str(tmp_path / f"{d.name}_run"), imported.opts(), **QUIET)
  saved = json.loads((tmp_path / "fp8_run" / "config.json").read_text())
  mc = workdir_lib.from_saved(saved).with_vocab(V).model
  state = runstate.abstract(mc)[1]
  got = runstate.restore_params(str(tmp_path / "fp8_run"), state, router=True)
  want = runstate.restore_params(str(tmp_path / "bf16_run"), state, router=True)
  assert got.keys() == want.keys()
  for path, a in want.items():
    np.testing.assert_allclose(got[path], a, rtol=2.0**-8, atol=0, err_msg=str(path))
  # the dequantized weights are the originals within e4m3 rounding: scales applied, per block
  (head, row) = stack.scanned_path(("layers", 1), layer_segments(mc))
  w_OxI = original["model.layers.1.self_attn.q_b_proj.weight"]
  s_OxI = expand(block_scales(w_OxI, block), w_OxI.shape, block).numpy()
  got_OxI = got[(*head, "attn", "q_b_proj", "kernel")][row].T
  err_OxI = np.abs(got_OxI - w_OxI.numpy())
  assert np.all(err_OxI <= 2.0**-4 * np.abs(w_OxI.numpy()) + 2.0**-10 * s_OxI)
  assert err_OxI.max() > 0  # quantized: not the weights themselves
  del fp8["model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"]
  save_file(fp8, fp8_dir / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(UserError, match=r"tensor model.layers.2.mlp.experts.3.up_proj.weight in "
                     r".* is F8_E4M3 without its scale .*weight_scale_inv") as e:  # fmt: skip
    import_checkpoint(str(fp8_dir), str(tmp_path / "bad_run"), imported.opts(), **QUIET)
  assert "\n" not in str(e.value) and not (tmp_path / "bad_run").exists()


def hub_cache(home, repo: str, src) -> str:
  """`src` laid out in a Hugging Face cache under `home` as huggingface_hub lays it out:
  hub/models--ORG--NAME/{blobs/<sha>, snapshots/<rev>/<file> → ../../blobs/<sha>,
  refs/main}; returns the snapshot directory."""
  import hashlib

  rev = "0123456789abcdef0123456789abcdef01234567"
  repo_dir = home / "hub" / ("models--" + repo.replace("/", "--"))
  snap = repo_dir / "snapshots" / rev
  (repo_dir / "blobs").mkdir(parents=True)
  snap.mkdir(parents=True)
  (repo_dir / "refs").mkdir()
  (repo_dir / "refs" / "main").write_text(rev)
  for f in sorted(os.listdir(src)):
    data = (src / f).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    (repo_dir / "blobs" / sha).write_bytes(data)
    os.symlink(os.path.join("..", "..", "blobs", sha), snap / f)
  return str(snap)


def test_hub_id_resolves_from_an_offline_cache(imported, tmp_path, monkeypatch):
  """`import ORG/NAME` with HF_HUB_OFFLINE reads the snapshot `refs/main` names in the cache
  (huggingface_hub's constants, as HF_HOME/HF_HUB_OFFLINE set them at its import)."""
  from huggingface_hub import constants

  src = imported.checkpoint("v2")[1]
  snap = hub_cache(tmp_path / "hf_home", "deepseek-ai/Tiny-V2", src)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  out = import_checkpoint("deepseek-ai/Tiny-V2", str(tmp_path / "run"), imported.opts(), **QUIET)
  assert out["resolved"]["hf_import"]["source"] == snap
  assert out["resolved"]["hf_import"]["family"] == "deepseek_v2"
  with pytest.raises(UserError, match="deepseek-ai/Missing: .* while HF_HUB_OFFLINE is set"):
    import_checkpoint("deepseek-ai/Missing", str(tmp_path / "run2"), imported.opts(), **QUIET)
  assert not (tmp_path / "run2").exists()


def _cli(args, env_extra):
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu", **env_extra}
  cmd = [sys.executable, "-m", "moejax.hf", "import", *args, "--noprogress"]
  return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_cli_hub_id_not_in_offline_cache_is_one_line(tmp_path):
  """Exit 2 and one line naming HF_HUB_OFFLINE and the cache HF_HOME places."""
  home = tmp_path / "hf_home"
  home.mkdir()
  p = _cli(["deepseek-ai/DeepSeek-V2-Lite", "--workdir", str(tmp_path / "run")],
           {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})  # fmt: skip
  assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
  assert "HF_HUB_OFFLINE" in p.stderr and str(home / "hub") in p.stderr
  assert not (tmp_path / "run").exists()


@FULL
def test_cli_hub_id_under_hf_home(imported, tmp_path):
  """The command line takes HF_HOME and HF_HUB_OFFLINE from the environment."""
  src = imported.checkpoint("v3")[1]
  snap = hub_cache(tmp_path / "hf_home", "deepseek-ai/Tiny-V3", src)
  run = tmp_path / "run"
  p = _cli(["deepseek-ai/Tiny-V3", "--workdir", str(run), "--seq_len=16", "--sequences=8"],
           {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"})  # fmt: skip
  assert p.returncode == 0, p.stderr
  saved = json.loads((run / "config.json").read_text())
  assert saved["resolved"]["hf_import"]["source"] == snap
  assert "multi-token-prediction" in p.stdout + p.stderr


@FULL
@pytest.mark.parametrize("case", ["v2", "v3"])
def test_per_item_logliks_match_lm_eval_hf(imported, case, tmp_path):
  """Every choice's log-likelihood on a local multiple-choice task equals lm-eval's own HF
  model's (`simple_evaluate(model="hf")`) at the native cell and at (k1, native)."""
  import lm_eval
  from downstream.test_hf_reference import _logliks, _task
  from lm_eval import evaluator

  from moejax.downstream import loading, scoring
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM

  _, run, _, src, _ = imported[case, True]
  ref_src = tmp_path / "src"
  shutil.copytree(src, ref_src)
  tok_cfg = json.loads((ref_src / "tokenizer_config.json").read_text())
  (ref_src / "tokenizer_config.json").write_text(
    json.dumps(tok_cfg | {"tokenizer_class": "PreTrainedTokenizerFast"})
  )
  k1_src = tmp_path / "src_k1"
  shutil.copytree(ref_src, k1_src)
  cfg = json.loads((k1_src / "config.json").read_text())
  (k1_src / "config.json").write_text(json.dumps(cfg | {"num_experts_per_tok": K1}))
  yaml = _task(tmp_path, f"ref_{case}")
  tm = loading.load_task_model(str(run), load_config(str(run)), step=None)
  lm = MoejaxLM(tm.scorer, tm.tokenizer, tm.encoding)
  task = tasks_lib.load_tasks(yaml)
  for k1, hf_dir in ((K, ref_src), (K1, k1_src)):
    ref = lm_eval.simple_evaluate(
      model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
      tasks=[yaml], batch_size=1, log_samples=True, bootstrap_iters=0,
    )  # fmt: skip
    want_ll, want_acc = _logliks(ref["samples"][f"ref_{case}"])
    tm.scorer.cell = scoring.Cell(k1)
    got = evaluator.evaluate(lm, {"tasks": task}, log_samples=True, bootstrap_iters=0)
    got_ll, got_acc = _logliks(got["samples"][f"ref_{case}"])
    np.testing.assert_allclose(got_ll, want_ll, rtol=1e-5, atol=1e-4, err_msg=f"k1={k1}")
    np.testing.assert_array_equal(got_acc, want_acc)


def test_e4m3_is_what_ml_dtypes_reads():
  """The shard reader's e4m3 (ml_dtypes) decodes torch's float8_e4m3fn bytes: every one of
  the 256 codes, NaNs aside."""
  codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
  want = codes.view(torch.float8_e4m3fn).float().numpy()
  got = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  finite = ~np.isnan(want)
  assert finite.sum() == 254 and np.array_equal(np.isnan(got), ~finite)
  np.testing.assert_array_equal(got[finite], want[finite])
