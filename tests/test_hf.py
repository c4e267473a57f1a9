"""moejax.hf: tiny random transformers models of each family, imported, compared, exported.

The reference is transformers itself (its own config classes and modeling code): moejax's
logits must equal transformers' within 1e-4 in float32, at the native k and at a reduced k1.
Both parameter layouts (`model.scan_layers`: stacked or one entry per layer) import and
export: the default tier checks OLMoE in each, the full tier every family in each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch  # the test extra pins torch and transformers: this file always runs
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from tiers import FULL

from moejax import config as config_lib
from moejax.errors import UserError
from moejax.hf import runstate
from moejax.hf.exporter import export_run
from moejax.hf.importer import import_checkpoint
from moejax.kgrid.loading import load_config, load_run
from moejax.nn.model import layer_segments
from moejax.nn.overrides import Overrides
from moejax.training import workdir as workdir_lib
from runconfig import as_data, as_run, saved_eval

V, D, E, K, K1, L = 128, 32, 8, 4, 2, 2
COMMON = {
  "vocab_size": V, "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": 4,
  "num_key_value_heads": 2, "num_experts_per_tok": K, "max_position_embeddings": 64,
  "eos_token_id": 1, "bos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False,
}  # fmt: skip
CONFIGS = {
  "olmoe": lambda: transformers.OlmoeConfig(
    **COMMON, intermediate_size=16, num_experts=E, rms_norm_eps=1e-5, rope_theta=500.0
  ),
  "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
    **COMMON, head_dim=12, intermediate_size=24, moe_intermediate_size=16, num_experts=E,
    norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6,
  ),
  "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
    **COMMON, intermediate_size=24, moe_intermediate_size=16, shared_expert_intermediate_size=20,
    num_experts=E, norm_topk_prob=False, rms_norm_eps=1e-6,
  ),
  "mixtral": lambda: transformers.MixtralConfig(
    **COMMON, intermediate_size=16, num_local_experts=E, rms_norm_eps=1e-5
  ),
}  # fmt: skip
RENORM = {"olmoe": False, "qwen3_moe": True, "qwen2_moe": False, "mixtral": True}
TEXT = "\n\n".join(f"paragraph {i}: " + "the quick brown fox jumps over it. " * (3 + i % 5)
                   for i in range(60))  # fmt: skip


def write_tokenizer(directory: str, bos: bool = False) -> None:
  """A character-level tokenizer.json (BPE with no merges) and its tokenizer_config.json;
  `bos`: a Llama-style one, whose post-processor prepends BOS `<s>` (id 97)."""
  from tokenizers import Tokenizer, models, processors

  chars = [chr(c) for c in range(32, 127)]
  vocab = {"[UNK]": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
  special = {"eos_token": "<eos>"}
  if bos:
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    special["bos_token"] = "<s>"
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(special, f)


def randomize(model) -> None:
  """Weights far from init (norm scales around 1), so a wrong mapping shows in the logits."""
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)


def hf_logits(model, tokens: np.ndarray, k: int) -> np.ndarray:
  """transformers' float32 logits with every router at top-k."""
  for mod in model.modules():
    if hasattr(mod, "top_k") and hasattr(mod, "weight"):
      mod.top_k = k
  with torch.no_grad():
    out = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  for mod in model.modules():
    if hasattr(mod, "top_k") and hasattr(mod, "weight"):
      mod.top_k = K
  return out


def compiled(model, k1=None, k2=None):
  """tokens → (logits at native K, logits at k1 with k2): one compilation for both."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    native = m(tokens)[0]
    return native, (m(tokens, ov=Overrides(k=k1, k2=k2))[0] if k1 else native)

  return lambda tokens: tuple(np.asarray(x) for x in run(state, tokens))


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, V, size=(2, 12)).astype(np.int32)


# (family, model.scan_layers) cases: OLMoE in both layouts in the default tier, the rest full.
CASES = [
  pytest.param(fam, scan, marks=() if fam == "olmoe" else FULL, id=f"{fam}-{layout}")
  for fam in CONFIGS
  for scan, layout in ((True, "scanned"), (False, "unrolled"))
]


class Imported(dict):
  """(family, scan_layers) → (HF model, imported run dir, moejax model, HF source dir), each
  imported on first use (the default tier imports one family, the full tier all four), from
  one HF checkpoint per family."""

  def __init__(self, root):
    super().__init__()
    self.root, self.sources = root, {}
    self.text = root / "heldout.txt"
    self.text.write_text(TEXT)

  def __missing__(self, key):
    fam, scan = key
    if fam not in self.sources:
      self.sources[fam] = self.source(fam)
    model, src = self.sources[fam]
    opts = {"text": str(self.text), "text_docs": "paragraph", "seq_len": 16, "sequences": 8,
            "batch_size": 4, "holdout_fraction": 0.3, "progress": False,
            "scan_layers": scan}  # fmt: skip
    run = self.root / f"{fam}_{'scanned' if scan else 'unrolled'}_run"
    import_checkpoint(str(src), str(run), opts, log=lambda *_: None)
    rc = load_config(str(run))  # as `moejax.evaluate` loads an imported run
    r = load_run(str(run), rc, None)
    mj = nnx.merge(r.graphdef, r.params, r.router)
    self[key] = (model, run, compiled(mj, K1, K1 if RENORM[fam] else None), src)
    return self[key]

  def source(self, fam):
    """The family's random HF model and its checkpoint directory."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[fam](), dtype=torch.float32)
    model = model.eval()
    randomize(model)
    src = self.root / f"{fam}_hf"
    model.save_pretrained(src)
    write_tokenizer(src)
    return model, src


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  return Imported(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize(("fam", "scan"), CASES)
def test_import_matches_transformers(imported, tokens, fam, scan):
  """Native K, and k1 = K/2 with the family's own normalization (k2 = k1 when it renormalizes)."""
  hf, _, mj, _ = imported[fam, scan]
  got, got1 = mj(tokens)
  ref = hf_logits(hf, tokens, K)
  assert np.abs(ref).max() > 1.0  # the logits are far from uniform: the check can fail
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  ref1 = hf_logits(hf, tokens, K1)
  assert np.abs(ref1 - ref).max() > 1e-2  # k1 changes the output
  np.testing.assert_allclose(got1, ref1, atol=1e-4, rtol=0)


@FULL
def test_import_records_the_architecture(imported):
  """Per-family conventions land in moejax's config keys."""
  cfg = {
    f: json.loads((imported[f, True][1] / "config.json").read_text())["model"] for f in CONFIGS
  }
  assert [cfg[f]["moe"]["rule"] for f in CONFIGS] == [
    "olmoe",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
  ]
  assert (cfg["olmoe"]["qk_norm_scope"], cfg["qwen3_moe"]["qk_norm_scope"]) == ("proj", "head")
  assert cfg["qwen2_moe"]["qkv_bias"] and not cfg["mixtral"]["qk_norm"]
  assert (cfg["qwen3_moe"]["first_dense"], cfg["qwen3_moe"]["d_ff"]) == (1, 24)
  assert (cfg["olmoe"]["rope_theta"], cfg["olmoe"]["norm_eps"]) == (500.0, 1e-5)


@pytest.mark.parametrize(("fam", "scan"), CASES)
def test_export_round_trips(imported, tokens, fam, scan, tmp_path):
  """Import then export gives back transformers' tensors bit for bit: Δlogit 0.0."""
  hf, run, _, _ = imported[fam, scan]
  export_run(str(run), str(tmp_path / "out"), log=lambda *_: None)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert type(back) is type(hf)
  want, got = hf.state_dict(), back.state_dict()
  assert sorted(got) == sorted(want)
  assert all(torch.equal(got[n], want[n]) for n in want), [
    n for n in want if not torch.equal(got[n], want[n])
  ]
  assert np.abs(hf_logits(back.eval(), tokens, K) - hf_logits(hf, tokens, K)).max() == 0.0
  assert os.path.exists(tmp_path / "out" / "tokenizer.json")


def test_an_unaligned_vocab_is_padded_on_import_and_exported_back(tmp_path):
  """An HF vocab of 100 ids (not a multiple of 128) imports as 128 rows, the 28 padded ones
  zero and masked: moejax's logits over the 100 real ids are transformers'. The export
  writes 100 rows again, every tensor bit for bit: Δlogit 0.0."""
  n_real = 100
  cfg = CONFIGS["olmoe"]()
  cfg.vocab_size = n_real
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  randomize(hf)
  src, run = tmp_path / "src", tmp_path / "run"
  hf.save_pretrained(src)
  write_tokenizer(src)  # 97 ids
  (tmp_path / "heldout.txt").write_text(TEXT)
  opts = {"text": str(tmp_path / "heldout.txt"), "text_docs": "paragraph", "seq_len": 16,
          "sequences": 8, "batch_size": 4, "holdout_fraction": 0.3, "progress": False}  # fmt: skip
  import_checkpoint(str(src), str(run), opts, log=lambda *_: None)
  saved = json.loads((run / "config.json").read_text())
  assert saved["resolved"]["vocab_size"] == n_real
  assert saved["resolved"]["padded_vocab_size"] == 128
  mc = workdir_lib.from_saved(saved).with_vocab(97).model
  assert (mc.vocab_size, mc.padded_vocab) == (n_real, 128)
  r = load_run(str(run), load_config(str(run)), None)  # as `moejax.evaluate` loads it
  mj = nnx.merge(r.graphdef, r.params, r.router)
  emb = np.asarray(mj.embed.embedding[...])
  assert emb.shape == (128, D) and emb[:n_real].any() and not emb[n_real:].any()
  assert not np.asarray(mj.lm_head.kernel[...])[:, n_real:].any()
  toks = np.random.default_rng(3).integers(0, n_real, size=(2, 12)).astype(np.int32)
  got = compiled(mj)(toks)[0]
  ref = hf_logits(hf, toks, K)
  assert got.shape[-1] == 128 and ref.shape[-1] == n_real
  np.testing.assert_allclose(got[..., :n_real], ref, atol=1e-4, rtol=0)
  assert (got[..., n_real:] < -1e30).all()
  export_run(str(run), str(tmp_path / "out"), log=lambda *_: None)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert back.config.vocab_size == n_real
  want, have = hf.state_dict(), back.state_dict()
  assert sorted(have) == sorted(want)
  assert all(torch.equal(have[n], want[n]) for n in want)
  assert np.abs(hf_logits(back.eval(), toks, K) - ref).max() == 0.0


def _as_layers(flat: dict[tuple, object], segs) -> dict[tuple, object]:
  """A flat {path: array} of the scanned layout in the unrolled one, by the layout's rule
  (moejax/nn/stack.py): row r of segment s's body position j is layer start + r * period + j."""
  out = {}
  for path, a in flat.items():
    if path[0] != "stacks":
      out[path] = a
      continue
    seg, j, key = segs[int(path[1])], int(path[3]), type(path[1])  # int or str keys
    for r in range(seg.repeats):
      out[("layers", key(seg.start + r * len(seg.moe) + j), *path[4:])] = a[r]
  return out


def test_import_stacks_the_layers_it_fills(imported):
  """The scanned import is the unrolled one stacked (rows = layers), both hold what the HF
  tensors say, and each run records its layout in config.json."""
  _, scanned, _, src = imported["olmoe", True]
  _, unrolled, _, _ = imported["olmoe", False]
  saved = {r: json.loads((r / "config.json").read_text()) for r in (scanned, unrolled)}
  assert [saved[r]["model"]["scan_layers"] for r in (scanned, unrolled)] == [True, False]
  mc = {r: as_run(workdir_lib.from_saved(saved[r])).with_vocab(V).model for r in saved}
  params = {r: runstate.restore_params(str(r), runstate.abstract(mc[r])[1]) for r in saved}
  assert any(p[0] == "stacks" for p in params[scanned]) and not any(
    p[0] == "layers" for p in params[scanned]
  )
  flat = _as_layers(params[scanned], layer_segments(mc[scanned]))
  assert sorted(flat, key=str) == sorted(params[unrolled], key=str)
  for path, a in params[unrolled].items():
    np.testing.assert_array_equal(flat[path], a, err_msg=str(path))
  hf = load_file(src / "model.safetensors")
  gate_FxD, up_FxD = (hf[f"model.layers.1.mlp.experts.3.{n}_proj.weight"] for n in ("gate", "up"))
  w_gu_RxExDx2F = params[scanned][("stacks", 0, "blocks", 0, "mlp", "experts", "w_gate_up")]
  F = mc[scanned].moe.d_expert
  assert w_gu_RxExDx2F.shape[-1] == 2 * F == 2 * up_FxD.shape[0]
  np.testing.assert_array_equal(w_gu_RxExDx2F[1, 3, :, :F], gate_FxD.T)  # layer 1 = row 1
  np.testing.assert_array_equal(w_gu_RxExDx2F[1, 3, :, F:], up_FxD.T)  # expert 3, up half


@FULL  # an import of its own (~15 s); the per-expert layout's halves are checked by default
def test_import_reads_the_fused_expert_layout(imported, tmp_path):
  """transformers 5's fused layout (`experts.gate_up_proj [E, 2F, D]`: each expert's gate
  rows, then its up rows; `experts.down_proj [E, D, F]`), written here from the per-expert
  tensors, imports to the same arrays as they do."""
  _, run, _, src = imported["olmoe", True]
  fused = tmp_path / "fused"
  fused.mkdir()
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    (fused / name).write_bytes((src / name).read_bytes())
  hf = load_file(src / "model.safetensors")
  per_expert = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight")
  out, experts = {}, {}
  for name, t in hf.items():
    m = per_expert.fullmatch(name)
    if m is None:
      out[name] = t
    else:
      experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
  for prefix, w in experts.items():
    stacked = {n: np.stack([w[n][e] for e in sorted(w[n])]) for n in w}
    out[f"{prefix}.gate_up_proj"] = np.concatenate([stacked["gate"], stacked["up"]], axis=1)
    out[f"{prefix}.down_proj"] = stacked["down"]
  save_file(out, fused / "model.safetensors")
  saved = json.loads((run / "config.json").read_text())
  opts = {"text": str(imported.text), "text_docs": "paragraph", "seq_len": 16, "sequences": 8,
          "batch_size": 4, "holdout_fraction": 0.3, "progress": False, "scan_layers": True}  # fmt: skip
  import_checkpoint(str(fused), str(tmp_path / "run"), opts, log=lambda *_: None)
  mc = workdir_lib.from_saved(saved).with_vocab(V).model
  want = runstate.restore_params(str(run), runstate.abstract(mc)[1])
  got = runstate.restore_params(str(tmp_path / "run"), runstate.abstract(mc)[1])
  assert got.keys() == want.keys()
  for path, a in want.items():
    np.testing.assert_array_equal(got[path], a, err_msg=str(path))


def test_export_native_run(tmp_path, tokens):
  """A moejax-made run (tied embeddings, mixtral rule, random weights) exports with the same
  logits; a rule no family has is refused naming the field."""
  c = config_lib.base_config()
  c.model.update(vocab_size=V, d_model=D, n_layers=L, n_heads=4, n_kv_heads=2, d_ff=0)
  c.model.moe.update(n_experts=E, top_k=K, d_expert=16)
  mc = as_run(c).with_vocab(V).model
  _, state = runstate.abstract(mc)
  rng = np.random.default_rng(1)
  arrays = {
    p: (0.2 * rng.standard_normal(s)).astype(np.float32) for p, s in runstate.shapes(state).items()
  }
  run = tmp_path / "run"
  runstate.save(str(run), runstate.fill(state, arrays), {})
  (run / "config.json").write_text(json.dumps({**c.to_dict(), "resolved": {"vocab_size": V}}))
  export_run(str(run), str(tmp_path / "out"), log=lambda *_: None)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  graphdef, _ = runstate.abstract(mc)
  filled = runstate.fill(state, arrays)  # the weights the run holds, from memory
  got = compiled(nnx.merge(graphdef, filled["params"], filled["router"]))(tokens)[0]
  np.testing.assert_allclose(hf_logits(back.eval(), tokens, K), got, atol=1e-4)
  c.model.moe.rule = "olmo"  # α = K: no family scales its routed weights
  (run / "config.json").write_text(json.dumps({**c.to_dict(), "resolved": {"vocab_size": V}}))
  with pytest.raises(UserError, match="model.moe.scale"):
    export_run(str(run), str(tmp_path / "out2"))


def test_import_errors_name_the_tensor_or_key(imported, tmp_path):
  _, _, _, src = imported["olmoe", True]
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (bad / name).write_bytes((src / name).read_bytes())
  hf = json.loads((src / "config.json").read_text())
  tensors = load_file(src / "model.safetensors")
  missing = "model.layers.1.mlp.experts.3.up_proj.weight"
  save_file({k: v for k, v in tensors.items() if k != missing}, bad / "model.safetensors")
  (bad / "config.json").write_text(json.dumps(hf))
  with pytest.raises(UserError, match=f"missing tensor {missing}"):
    import_checkpoint(str(bad), str(tmp_path / "r1"), {"progress": False})
  save_file(tensors, bad / "model.safetensors")
  (bad / "config.json").write_text(json.dumps({**hf, "intermediate_size": 20}))
  shape = r"tensor model.layers.0.mlp.experts.0.\w+.weight .* has shape .* does not fit moejax's "
  with pytest.raises(
    UserError, match=shape + r"stacks\.0\.blocks\.0\.mlp\.experts\.w_\w+\[row 0\]"
  ):
    import_checkpoint(str(bad), str(tmp_path / "r2"), {"progress": False})
  (bad / "config.json").write_text(json.dumps({**hf, "architectures": ["LlamaForCausalLM"],
                                                "model_type": "llama"}))  # fmt: skip
  with pytest.raises(UserError, match="LlamaForCausalLM.*not supported"):
    import_checkpoint(str(bad), str(tmp_path / "r3"), {"progress": False})
  no_arch = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
  (bad / "config.json").write_text(json.dumps(no_arch))
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "moejax.hf", "import", str(bad), "--workdir", str(tmp_path / "r4")]
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
  assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
  assert "no architectures or model_type" in p.stderr


@FULL
def test_grid_on_imported_model(imported):
  """`moejax.evaluate`'s grid runs on an imported model; its native K loss is transformers'
  cross-entropy on the same held-out windows."""
  from moejax.data.pipeline import make_data
  from moejax.kgrid.run import run_grid

  hf, run, _, _ = imported["olmoe", True]
  ev = saved_eval(str(run), k1="4,2", k2="native", bootstrap_resamples=1000)
  rows = run_grid(str(run), ev, log=lambda *_: None)
  assert [(r["k1"], r["k2"]) for r in rows] == [(4, "native"), (2, "native")]
  c = workdir_lib.from_saved(json.loads((run / "config.json").read_text()))
  data = make_data(as_data(c.data), seed=0, workdir=None)
  w = torch.as_tensor(np.concatenate(data.eval_batches(8, 4)), dtype=torch.long)
  with torch.no_grad():
    logp = torch.log_softmax(hf(w[:, :-1]).logits, -1)
  ce = -logp.gather(-1, w[:, 1:, None]).mean().item()
  native = next(r for r in rows if (r["k1"], r["k2"]) == (4, "native"))
  assert native["n_sequences"] == w.shape[0] and native["delta"] == 0.0
  assert native["loss"] == pytest.approx(ce, abs=1e-4)
  text = str(run.parent / "heldout.txt")  # the user's held-out choice, recorded in the grid
  assert native["heldout"] == {
    "corpus": "files",
    "paths": text,
    "tokenizer": c.data.tokenizer,
    "holdout_fraction": 0.3,
    "sequences": w.shape[0],
    "tokens": w.shape[0] * 16,
    "windows_available": len(data.heldout_windows),
  }
  md = (run / "eval" / "k_grid.md").read_text()
  assert f"Held-out data: files ({text}), tokenizer {c.data.tokenizer}" in md
  assert f"{w.shape[0]} sequences ({len(data.heldout_windows)} available)" in md


def test_imported_run_is_for_evaluation_only(imported):
  """The checkpoint holds step, params and router biases only (no optimizer moments), and
  training on it is refused in one line naming the run."""
  from moejax.training import workdir

  _, run, _, src = imported["olmoe", True]
  meta = json.loads((run / "checkpoints" / "0" / "state" / "_METADATA").read_text())
  tops = {key.split("'")[1] for key in meta["tree_metadata"]}  # "('params', 'embed', ...)"
  assert tops == {"step", "params", "router"}
  saved = json.loads((run / "config.json").read_text())
  with pytest.raises(UserError, match=f"imported from {src}: imported runs are for evaluation"):
    workdir.refuse_imported(saved, str(run / "config.json"))
  workdir.refuse_imported({k: v for k, v in saved.items() if k != "resolved"}, "trained")


@FULL
def test_cli_import_takes_the_layout(imported, tmp_path):
  """`--noscan_layers` imports into the unrolled layout and records it."""
  _, _, _, src = imported["olmoe", True]
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
  run = tmp_path / "run"
  cmd = [sys.executable, "-m", "moejax.hf", "import", str(src), "--workdir", str(run),
         "--noscan_layers", "--noprogress", "--seq_len=16", "--sequences=8"]  # fmt: skip
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
  assert p.returncode == 0, p.stderr
  assert json.loads((run / "config.json").read_text())["model"]["scan_layers"] is False
  meta = json.loads((run / "checkpoints" / "0" / "state" / "_METADATA").read_text())
  assert any("'layers'" in k for k in meta["tree_metadata"])
  assert not any("'stacks'" in k for k in meta["tree_metadata"])
