"""moejax.hf on the hybrid families (issue 58): Qwen3.5-MoE's text model, its published
vision-language wrapper, and Qwen3-Next, as tiny random transformers 5.24 checkpoints.

The reference is transformers itself: its config classes (`Qwen3_5MoeTextConfig`, the
wrapper `Qwen3_5MoeConfig` with a one-block vision tower, `Qwen3NextConfig`), its modeling
code and `save_pretrained`, with every weight randomized (the zero-centred norms around 0,
where they start, the Gated DeltaNet's plain gated norm around 1). moejax's logits must equal
transformers' within 1e-4 in float32 at every position, at the native K and at k1 (the
routers at top-k1, renormalized as the family does); export gives back transformers'
tensors bit for bit; lm-eval's own HF model gives the same per-item log-likelihoods.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch  # the test extra pins torch and transformers: this file always runs
import transformers
from flax import nnx
from runconfig import as_data, as_run, saved_eval
from safetensors.numpy import load_file, save_file
from test_hf import TEXT, hf_logits, write_tokenizer
from tiers import FULL

from moejax import cli
from moejax.errors import UserError
from moejax.hf import families as fl
from moejax.hf import hfconfig, qwen3_5, runstate
from moejax.hf.exporter import export_run
from moejax.hf.importer import import_checkpoint
from moejax.kgrid.loading import load_config, load_run
from moejax.nn.overrides import Overrides
from moejax.training import workdir as workdir_lib

V, D, E, K, K1 = 128, 32, 8, 4, 2
TEXT_CONFIG = {
  "vocab_size": V, "hidden_size": D, "num_hidden_layers": 4, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
  "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
  "linear_conv_kernel_dim": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
  "num_experts": E, "num_experts_per_tok": K, "rms_norm_eps": 1e-6, "eos_token_id": 1,
  "tie_word_embeddings": False,
}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
          "out_hidden_size": D, "patch_size": 4, "num_position_embeddings": 16}  # fmt: skip
CONFIGS = {
  "text": lambda: transformers.Qwen3_5MoeTextConfig(**TEXT_CONFIG),
  "wrapper": lambda: transformers.Qwen3_5MoeConfig(text_config=TEXT_CONFIG, vision_config=VISION),
  # 5 layers: a dense first layer (mlp_only_layers), then a period of the 3:1 pattern
  "next": lambda: transformers.Qwen3NextConfig(
    **{**TEXT_CONFIG, "num_hidden_layers": 5}, intermediate_size=40, mlp_only_layers=[0]
  ),
}
CLASSES = {
  "text": transformers.Qwen3_5MoeForCausalLM,
  "wrapper": transformers.Qwen3_5MoeForConditionalGeneration,
  "next": transformers.Qwen3NextForCausalLM,
}
PRESET = os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3_5_moe.py")
LENGTHS = (1, 63, 64, 65, 200)  # around the chunked rule's chunk of 64, and several chunks


def randomize(model) -> None:
  """Every weight far from its init: zero-centred norms (init 0) around 0, the Gated
  DeltaNet's gated norm (init 1) around 1, decay rates A in (0.5, 2.5), the conv N(0, 0.05²),
  the rest N(0, 0.07²). Larger weights, weaker decay or a wider conv (keys more alike after
  SiLU) make float32's own rounding, transformers' included, reach 1e-4 at some positions
  (measured against transformers in float64): the chunked rule's triangular solve amplifies
  it. At these scales both stay within 3e-5 of float64."""
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if name.endswith("linear_attn.norm.weight"):
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith("conv1d.weight"):
        p.copy_(0.05 * noise)
      elif name.endswith("A_log"):
        p.copy_(torch.log(0.5 + 2.0 * torch.rand(p.shape, generator=g)))
      else:
        p.copy_((0.3 if "norm" in name else 0.07) * noise)


def compiled(model, k1: int | None = None):
  """tokens → (logits at native K, at (k1, k2 = k1) when `k1`): two programs run one after
  the other. Not one program holding both forwards (test_hf.compiled): jaxlib 0.10.2's CPU
  triangular solve (the chunked rule's) can deadlock when two run at once on a two-thread
  pool, each waiting in ParallelBatchMap for work the other's thread holds."""
  graphdef, state = nnx.split(model)
  native = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
  cell = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, ov=Overrides(k=k1, k2=k1))[0])

  def run(tokens):
    first = np.asarray(native(state, tokens))  # finished before the second is dispatched
    return first, (np.asarray(cell(state, tokens)) if k1 else first)

  return run


class Imported(dict):
  """name → (HF model, HF checkpoint dir, imported run dir, compiled moejax model), each
  saved and imported (scanned layout) on first use."""

  def __init__(self, root):
    super().__init__()
    self.root, self.logs = root, {}
    self.text = root / "heldout.txt"
    self.text.write_text(TEXT)

  def opts(self, **kw) -> dict:
    return {"text": str(self.text), "text_docs": "paragraph", "seq_len": 16, "sequences": 8,
            "batch_size": 4, "holdout_fraction": 0.3, "progress": False, **kw}  # fmt: skip

  def __missing__(self, name):
    torch.manual_seed(0)
    model = CLASSES[name](CONFIGS[name]()).float().eval()
    randomize(model)
    src, run = self.root / f"{name}_hf", self.root / f"{name}_run"
    model.save_pretrained(src)
    write_tokenizer(src)
    self.logs[name] = []
    import_checkpoint(str(src), str(run), self.opts(), log=self.logs[name].append)
    r = load_run(str(run), load_config(str(run)), None)  # as `moejax.evaluate` loads it
    mj = compiled(nnx.merge(r.graphdef, r.params, r.router), K1)  # k2 = k1: renormalized
    self[name] = (model, src, run, mj)
    return self[name]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  return Imported(tmp_path_factory.mktemp("hf35"))


CASES = [pytest.param("wrapper", (1, 65), id="wrapper-short", marks=FULL)] + [
  pytest.param(name, LENGTHS, marks=FULL, id=name) for name in CONFIGS
]


@pytest.mark.parametrize(("name", "lengths"), CASES)
def test_logits_match_transformers(imported, name, lengths):
  """Every position, at the native K and at (k1, native): transformers with its routers at
  top-k1, which renormalize over the k1 chosen as at K."""
  hf, _, _, mj = imported[name]
  rng = np.random.default_rng(len(lengths))
  for L in lengths:
    tokens = rng.integers(0, V, size=(2, L)).astype(np.int32)
    got, got1 = mj(tokens)
    ref, ref1 = hf_logits(hf, tokens, K), hf_logits(hf, tokens, K1)
    assert np.abs(ref).max() > 1.0 and np.abs(ref1 - ref).max() > 1e-2  # the checks can fail
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"L={L}")
    np.testing.assert_allclose(got1, ref1, atol=1e-4, rtol=0, err_msg=f"L={L}, k1={K1}")


def test_import_records_the_architecture(imported):
  """The wrapper's text model lands in moejax's keys as its text_config says; the vision
  tower is skipped with a note."""
  hf, _, run, _ = imported["wrapper"]
  m = json.loads((run / "config.json").read_text())["model"]
  tc = hf.config.text_config
  mixer = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
  assert m["mixers"].split(",") == [mixer[t] for t in tc.layer_types]  # 4 layers: one period
  assert (m["norm"], m["partial_rotary_factor"]) == ("zero_centred", 0.25)
  assert m["gated_deltanet"] == {k: getattr(tc, k) for k in qwen3_5.LINEAR_KEYS}
  assert (m["moe"]["rule"], m["moe"]["d_shared"], m["first_dense"]) == ("qwen3_5_moe", 24, 0)
  assert any("model.visual.*" in line for line in imported.logs["wrapper"])


@FULL
def test_qwen3_next_dense_layer_and_period(imported):
  """Qwen3-Next's mlp_only_layers=[0] is moejax's first_dense=1 (its SwiGLU of
  intermediate_size), and five layers of layer_types are the 3:1 period."""
  _, _, run, _ = imported["next"]
  m = json.loads((run / "config.json").read_text())["model"]
  assert (m["first_dense"], m["moe_every"], m["d_ff"]) == (1, 1, 40)
  assert m["mixers"] == "gated_deltanet,gated_deltanet,gated_deltanet,gated_attention"


@pytest.mark.parametrize(
  "name",
  [pytest.param("wrapper"), pytest.param("text", marks=FULL), pytest.param("next", marks=FULL)],
)
def test_export_round_trips(imported, name, tmp_path):
  """Import then export gives back transformers' tensors bit for bit (the wrapper's vision
  tower copied from the source, Qwen3-Next's grouped in_proj_qkvz / in_proj_ba joined)."""
  hf, _, run, _ = imported[name]
  export_run(str(run), str(tmp_path / "out"), log=lambda *_: None)
  back = CLASSES[name].from_pretrained(tmp_path / "out", dtype=torch.float32)
  want, got = hf.state_dict(), back.state_dict()
  assert sorted(got) == sorted(want)
  assert [n for n in want if not torch.equal(got[n], want[n])] == []
  cfg = json.loads((tmp_path / "out" / "config.json").read_text())
  assert cfg["architectures"] == [CLASSES[name].__name__]


@FULL
def test_wrapper_export_without_its_source_keeps_the_text_model(imported, tmp_path):
  """With the imported checkpoint gone, the wrapper exports its text model alone; transformers
  loads it (the vision tower at random) with the same text logits."""
  hf, src, run, _ = imported["wrapper"]
  moved = tmp_path / "moved"
  shutil.copytree(src, moved)
  shutil.rmtree(src)
  try:
    logs = []
    export_run(str(run), str(tmp_path / "out"), log=logs.append)
  finally:
    shutil.copytree(moved, src)
  assert any("model.visual.* not written" in line for line in logs)
  names = load_file(tmp_path / "out" / "model.safetensors")
  assert not any(n.startswith("model.visual.") for n in names)
  back = CLASSES["wrapper"].from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
  tokens = np.random.default_rng(5).integers(0, V, size=(2, 9)).astype(np.int32)
  assert np.abs(hf_logits(back, tokens, K) - hf_logits(hf, tokens, K)).max() == 0.0


def _fused(src, out):
  """`src` with each layer's experts in transformers' fused layout (`experts.gate_up_proj
  [E, 2F, D]`, `experts.down_proj [E, D, F]`), stacked here from the per-expert tensors."""
  out.mkdir()
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(src / name, out / name)
  per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight")
  tensors, experts = {}, {}
  for name, t in load_file(src / "model.safetensors").items():
    m = per_expert.fullmatch(name)
    if m is None:
      tensors[name] = t
    else:
      experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
  for prefix, w in experts.items():
    stacked = {n: np.stack([w[n][e] for e in sorted(w[n])]) for n in w}
    tensors[f"{prefix}.gate_up_proj"] = np.concatenate([stacked["gate"], stacked["up"]], axis=1)
    tensors[f"{prefix}.down_proj"] = stacked["down"]
  save_file(tensors, out / "model.safetensors")


@FULL
def test_wrapper_with_fused_experts_imports_the_same(imported, tmp_path):
  """The wrapper with fused expert tensors (under model.language_model.*) imports to the
  same arrays as the per-expert layout save_pretrained writes."""
  _, src, run, _ = imported["wrapper"]
  _fused(src, tmp_path / "fused")
  import_checkpoint(str(tmp_path / "fused"), str(tmp_path / "run"), imported.opts(),
                    log=lambda *_: None)  # fmt: skip
  mc = workdir_lib.from_saved(json.loads((run / "config.json").read_text())).with_vocab(V).model
  want = runstate.restore_params(str(run), runstate.abstract(mc)[1])
  got = runstate.restore_params(str(tmp_path / "run"), runstate.abstract(mc)[1])
  assert got.keys() == want.keys()
  for path, a in want.items():
    np.testing.assert_array_equal(got[path], a, err_msg=str(path))


def _source(tmp_path, name: str, **changes) -> str:
  """A checkpoint directory holding only a config.json (with `changes` in its text model's
  config) and a tokenizer: enough for the config checks import makes before any tensor."""
  cfg = CONFIGS[name]().to_dict()
  cfg["architectures"] = [CLASSES[name].__name__]
  target = cfg["text_config"] if name == "wrapper" else cfg
  target.update(changes)
  src = tmp_path / "src"
  src.mkdir(exist_ok=True)
  (src / "config.json").write_text(json.dumps(cfg))
  write_tokenizer(src)
  return str(src)


@pytest.mark.parametrize(
  ("changes", "message"),
  [
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
     r"layer_types\[3\]='sliding_attention' is not supported; use linear_attention or full_att"),
    ({"linear_num_value_heads": 3},
     "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    ({"attention_bias": True}, "attention_bias=true .* is not supported"),
  ],
  ids=["layer_type", "value_heads", "attention_bias"],
)  # fmt: skip
def test_bad_configs_are_one_line(tmp_path, changes, message):
  src = _source(tmp_path, "wrapper", **changes)
  with pytest.raises(UserError, match=message) as e:
    import_checkpoint(src, str(tmp_path / "run"), {"progress": False})
  assert "\n" not in str(e.value)
  assert not (tmp_path / "run").exists()  # refused before anything is written


def test_wrapper_without_text_config_is_one_line_from_the_cli(tmp_path):
  src = _source(tmp_path, "wrapper")
  cfg = json.loads((tmp_path / "src" / "config.json").read_text())
  del cfg["text_config"]
  (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "moejax.hf", "import", src, "--workdir", str(tmp_path / "run")]
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
  assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
  assert "Qwen3_5MoeForConditionalGeneration without a text_config" in p.stderr


@pytest.mark.parametrize("interval", [2, 3, 4])
def test_full_attention_interval_gives_transformers_layer_types(interval):
  """A config.json with `full_attention_interval` and no `layer_types` is read as
  transformers' config class reads it, and the period reproduces the list."""
  ref = transformers.Qwen3NextConfig(num_hidden_layers=7, full_attention_interval=interval)
  hf = {**ref.to_dict(), "full_attention_interval": interval}
  del hf["layer_types"]
  types = qwen3_5.layer_types(hf, "config.json")
  assert types == ref.layer_types
  p = qwen3_5.period(types)
  assert [p[i % len(p)] for i in range(7)] == ref.layer_types and len(p) == interval


def test_qwen3_next_router_follows_norm_topk_prob():
  """Qwen3-Next renormalizes the top-k iff norm_topk_prob (its router's code); Qwen3.5
  always does."""
  fam = fl.FAMILIES["qwen3_next"]
  for norm, rule in ((True, "qwen3_5_moe"), (False, "qwen2_moe")):
    hf = transformers.Qwen3NextConfig(**TEXT_CONFIG, norm_topk_prob=norm).to_dict()
    assert hfconfig.to_moejax(hf, fam, "config.json")["moe"]["rule"] == rule


def _native_run(tmp_path, **model):
  """configs/qwen3_5_moe.py at vocab V with random weights (norms included), saved as a run."""
  c = cli.load_file(PRESET)
  c.model.update(vocab_size=V, **model)
  mc = as_run(c).with_vocab(V).model
  graphdef, state = runstate.abstract(mc)
  rng = np.random.default_rng(1)
  arrays = {p: (0.1 * rng.standard_normal(s)).astype(np.float32)
            for p, s in runstate.shapes(state).items()}  # fmt: skip
  run = tmp_path / "run"
  runstate.save(str(run), runstate.fill(state, arrays), {})
  (run / "config.json").write_text(json.dumps({**c.to_dict(), "resolved": {"vocab_size": V}}))
  filled = runstate.fill(state, arrays)
  return run, nnx.merge(graphdef, filled["params"], filled["router"]), c


@FULL
@pytest.mark.parametrize(
  ("model", "arch"),
  [({}, "Qwen3_5MoeForCausalLM"), ({"first_dense": 1, "d_ff": 40}, "Qwen3NextForCausalLM")],
  ids=["all-moe", "dense-first"],
)
def test_export_native_hybrid_run(tmp_path, model, arch):
  """A moejax-made hybrid run (configs/qwen3_5_moe.py) exports as Qwen3.5-MoE, or as
  Qwen3-Next when it has a dense layer, with moejax's logits."""
  run, mj, c = _native_run(tmp_path, **model)
  export_run(str(run), str(tmp_path / "out"), log=lambda *_: None)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert type(back).__name__ == arch
  tokens = np.random.default_rng(2).integers(0, V, size=(2, 70)).astype(np.int32)
  k = c.model.moe.top_k
  np.testing.assert_allclose(hf_logits(back.eval(), tokens, k), compiled(mj)(tokens)[0], atol=1e-4)


@pytest.mark.parametrize(
  ("model", "field"),
  [({"mixers": "gqa,gated_deltanet"}, "model.mixers"), ({"norm": "rms"}, "model.norm")],
  ids=["mixers", "norm"],
)
def test_export_refuses_what_neither_family_has(tmp_path, model, field):
  c = cli.load_file(PRESET)
  c.model.update(vocab_size=V, **model)
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "config.json").write_text(
    json.dumps({**c.to_dict(), "resolved": {"vocab_size": V}})
  )
  with pytest.raises(UserError, match=f"cannot export: {field}=.* Qwen3.5-MoE or Qwen3-Next"):
    export_run(str(tmp_path / "run"), str(tmp_path / "out"))


def _lm_eval_logliks(hf_dir, yaml: str, task: str) -> tuple[np.ndarray, np.ndarray]:
  """Per-item log-likelihoods of every choice, and accuracy, from lm-eval's own HF model."""
  import lm_eval
  from downstream.test_hf_reference import _logliks

  # transformers 5.24 maps model_type qwen3_5_moe to its Qwen3_5Tokenizer whatever
  # tokenizer_config.json names, and that class rebuilds this test's character vocabulary
  # with a byte-level pre-tokenizer that drops its spaces; a folder of the tokenizer files
  # alone has no model_type, so lm-eval's HF model reads the tokenizer.json moejax imported
  tok_dir = pathlib.Path(hf_dir).parent / f"{pathlib.Path(hf_dir).name}_tokenizer"
  tok_dir.mkdir(exist_ok=True)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(pathlib.Path(hf_dir) / name, tok_dir / name)
  ref = lm_eval.simple_evaluate(
    model="hf", model_args={"pretrained": str(hf_dir), "tokenizer": str(tok_dir),
                            "dtype": "float32", "device": "cpu"},
    tasks=[yaml], batch_size=1, log_samples=True, bootstrap_iters=0,
  )  # fmt: skip
  return _logliks(ref["samples"][task])


def _k1_copy(src, dst, k1: int) -> None:
  """`src` with its (text model's) num_experts_per_tok at k1."""
  shutil.copytree(src, dst)
  cfg = json.loads((dst / "config.json").read_text())
  (cfg.get("text_config") or cfg)["num_experts_per_tok"] = k1
  (dst / "config.json").write_text(json.dumps(cfg))


def _hf_tokenizer_class(src) -> None:
  """Both sides read the same tokenizer.json (transformers' Qwen2 tokenizer class would
  rebuild it from the vocabulary with a byte-level pre-tokenizer this one lacks)."""
  tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
  (src / "tokenizer_config.json").write_text(
    json.dumps(tok_cfg | {"tokenizer_class": "PreTrainedTokenizerFast"})
  )


@FULL
def test_per_item_logliks_match_lm_eval_hf(imported, tmp_path):
  """The text model's per-item log-likelihoods of every choice of a local multiple-choice
  task, at the native cell and at (k1, native), against lm-eval's HF model
  (`simple_evaluate(model="hf")`) on the checkpoint at num_experts_per_tok = K and = k1."""
  from downstream.test_hf_reference import _logliks, _task
  from lm_eval import evaluator

  from moejax.downstream import loading, scoring
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM

  _, src, run, _ = imported["text"]
  _hf_tokenizer_class(src)
  _k1_copy(src, tmp_path / "k1", K1)
  yaml = _task(tmp_path, "ref_qwen3_5")
  tm = loading.load_task_model(str(run), load_config(str(run)), step=None)
  lm = MoejaxLM(tm.scorer, tm.tokenizer, tm.encoding)
  task = tasks_lib.load_tasks(yaml)
  for k1, hf_dir in ((K, src), (K1, tmp_path / "k1")):
    want_ll, want_acc = _lm_eval_logliks(hf_dir, yaml, "ref_qwen3_5")
    tm.scorer.cell = scoring.Cell(k1)
    got = evaluator.evaluate(lm, {"tasks": task}, log_samples=True, bootstrap_iters=0)
    got_ll, got_acc = _logliks(got["samples"]["ref_qwen3_5"])
    np.testing.assert_allclose(got_ll, want_ll, rtol=1e-5, atol=1e-4, err_msg=f"k1={k1}")
    np.testing.assert_array_equal(got_acc, want_acc)


@FULL
def test_cli_import_and_task_grid_on_the_wrapper(imported, tmp_path):
  """Done means: `python -m moejax.hf import` of a Qwen3.5-MoE wrapper-layout checkpoint,
  then `python -m moejax.evaluate --tasks` on a local task; each item's outcome at (K,
  native) and (k1, native) is lm-eval's HF model's on the checkpoint at K and at k1. (The
  wrapper keeps max_position_embeddings in its text_config, where the task grid does not
  look yet: it truncates requests to data.seq_len, so --seq_len is above every request.)"""
  from downstream.test_hf_reference import _task

  _, src, _, _ = imported["wrapper"]
  _hf_tokenizer_class(src)
  _k1_copy(src, tmp_path / "k1", K1)
  yaml = _task(tmp_path, "wrapper_task")
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu",
         "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
  run = tmp_path / "run"
  for cmd in (
    ["moejax.hf", "import", str(src), "--workdir", str(run), "--noprogress", "--seq_len=64",
     "--sequences=8"],
    ["moejax.evaluate", "--workdir", str(run), "--tasks", yaml, "--k1", f"{K},{K1}",
     "--k2", "native"],
  ):  # fmt: skip
    p = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, env=env,
                       timeout=900, check=False)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
  out = run / "eval" / "tasks" / "wrapper_task"
  for k1, hf_dir in ((K, src), (K1, tmp_path / "k1")):
    _, want_acc = _lm_eval_logliks(hf_dir, yaml, "wrapper_task")
    lines = (out / f"items_k1_{k1}_k2_native.jsonl").read_text().splitlines()
    items = sorted((json.loads(x) for x in lines), key=lambda o: o["doc_id"])
    assert [o["doc_id"] for o in items] == list(range(len(want_acc)))
    np.testing.assert_array_equal([o["correct"] for o in items], want_acc, err_msg=f"k1={k1}")


@FULL
def test_grid_on_the_imported_wrapper(imported):
  """`moejax.evaluate`'s loss grid on the wrapper's text model, at the recipe's k2 labels
  (k1, 16 → here E, native): its native-K loss is transformers' cross-entropy on the same
  held-out windows, and (k1, k1) is (k1, native) for a renormalizing rule."""
  from moejax.data.pipeline import make_data
  from moejax.kgrid.run import run_grid

  hf, _, run, _ = imported["wrapper"]
  ev = saved_eval(str(run), k1=f"{K},{K1}", k2="k1,native", bootstrap_resamples=1000)
  rows = run_grid(str(run), ev, log=lambda *_: None)
  cells = {(r["k1"], r["k2"]): r for r in rows}
  assert set(cells) >= {(K, "native"), (K1, "native"), (K1, K1)}
  c = workdir_lib.from_saved(json.loads((run / "config.json").read_text()))
  data = make_data(as_data(c.data), seed=0, workdir=None)
  w = torch.as_tensor(np.concatenate(data.eval_batches(8, 4)), dtype=torch.long)
  with torch.no_grad():
    logp = torch.log_softmax(hf(w[:, :-1]).logits, -1)
  ce = -logp.gather(-1, w[:, 1:, None]).mean().item()
  assert cells[K, "native"]["loss"] == pytest.approx(ce, abs=1e-4)
  assert cells[K1, K1]["loss"] == pytest.approx(cells[K1, "native"]["loss"], abs=1e-6)
