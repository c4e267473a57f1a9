"""`export`: a moejax run directory → a transformers checkpoint directory.

Writes config.json, safetensors shards in the per-expert layout every transformers version
(and vLLM) reads, `model.safetensors.index.json`, and the run's tokenizer when it has a
`tokenizer.json` (imported `hf:` tokenizers and locally trained BPEs). A run in the scanned
layout (`model.scan_layers`, recorded in its config.json) is read row by row: each HF
tensor is its layer's row of a stack (`tensors.Spec.view`).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.hf import families as fl
from moejax.hf import deepseek_tensors, hfconfig, qwen3_5, qwen3_5_tensors, runstate, tensors
from moejax.training import workdir as workdir_lib

SHARD_BYTES = 4 * 2**30


def load_run(workdir: str):
  """(config, saved config.json) of a run; a UserError when it is not one."""
  saved = workdir_lib.read_saved(workdir)
  if saved is None:
    raise UserError(f"{workdir}/config.json not found; --workdir must be a moejax run")
  return workdir_lib.from_saved(saved), saved


def zero_biases(fam: fl.Family, mc) -> dict[str, np.ndarray]:
  """Biases the family's config turns on but the run never had (exact zeros)."""
  out: dict[str, np.ndarray] = {}
  hd, H, G = mc.resolved_head_dim, mc.n_heads, mc.n_kv_heads
  for i in range(mc.n_layers):
    p = f"model.layers.{i}.self_attn."
    if fam.shared and not mc.qkv_bias:  # Qwen2-MoE: q/k/v biases (qkv_bias=true everywhere)
      out.update({f"{p}q_proj.bias": np.zeros(H * hd, np.float32)})
      out.update({f"{p}{n}_proj.bias": np.zeros(G * hd, np.float32) for n in "kv"})
    if not fam.shared and mc.qkv_bias:  # attention_bias=true also biases o_proj
      out[f"{p}o_proj.bias"] = np.zeros(mc.d_model, np.float32)
  return out


def hybrid_tensors(mc, fam: fl.Family, params, layout, saved: dict, log) -> list:
  """A hybrid family's tensors (`qwen3_5_tensors`), with those moejax does not model (the
  wrapper's vision tower, the MTP head) copied from the imported checkpoint when it is
  still there."""
  named = qwen3_5_tensors.assemble(qwen3_5_tensors.specs(mc, fam), params, layout)
  src = (saved.get("resolved", {}).get("hf_import") or {}).get("source")
  if src and os.path.isdir(src):
    named += qwen3_5_tensors.carried(src, layout)
  elif layout is qwen3_5_tensors.WRAPPER:
    log(f"{src} is gone: model.visual.* not written (transformers initializes it at random)")
  return named


def write_shards(out: str, named) -> dict[str, str]:
  """Writes (name, array) pairs into ≤ SHARD_BYTES safetensors files; returns the weight map."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, arr in named:
    if size and size + arr.nbytes > SHARD_BYTES:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += arr.nbytes
  weight_map = {}
  for j, shard in enumerate(tqdm(shards, desc="export shards", unit="shard")):
    fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
    if len(shards) == 1:
      fname = "model.safetensors"
    save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, fname))
  return weight_map


def copy_tokenizer(rc: RunConfig, saved: dict, out: str) -> None:
  """The run's tokenizer.json (+ tokenizer_config.json), when it has one: an `hf:` tokenizer,
  or the BPE a training run recorded in config.json; an `sp:` model as tokenizer.model (the
  name transformers' SentencePiece tokenizers read). A tiktoken rank file is not copied."""
  kind = rc.data.tokenizer
  names = ("tokenizer.json", "tokenizer_config.json")
  if kind.startswith("hf:"):
    src = kind[3:] if os.path.isdir(kind[3:]) else os.path.dirname(kind[3:])
    paths = [os.path.join(src, n) for n in names]
  elif kind.startswith("sp:"):
    paths, names = [kind[3:]], ("tokenizer.model",)
  else:
    tok = saved.get("resolved", {}).get("data", {}).get("tokenizer", {})
    paths = [tok["path"]] if kind == "bpe" and tok.get("path") else []
  for path, name in zip(paths, names):
    if os.path.isfile(path):
      shutil.copy(path, os.path.join(out, name))
  eos = saved.get("resolved", {}).get("data", {}).get("tokenizer", {}).get("eos_id")
  write_tokenizer_config(out, eos)


def write_tokenizer_config(out: str, eos_id: int | None) -> None:
  """A tokenizer_config.json beside a tokenizer.json that came without one (a locally trained
  BPE): transformers' fast tokenizer class and the run's EOS token by name, which
  `AutoTokenizer` (and lm-eval's HF model, whose prefix token it is) would otherwise lack."""
  tok_json, cfg = (os.path.join(out, n) for n in ("tokenizer.json", "tokenizer_config.json"))
  if not os.path.isfile(tok_json) or os.path.isfile(cfg):
    return
  values = {"tokenizer_class": "PreTrainedTokenizerFast"}
  if eos_id is not None:
    values["eos_token"] = Tokenizer.from_file(tok_json).id_to_token(int(eos_id))
  with open(cfg, "w") as f:
    json.dump(values, f, indent=2)


def export_run(workdir: str, out: str, step: int | None = None, log=print) -> dict:
  """Writes `out`; returns the HF config. A run no family expresses is a UserError."""
  rc, saved = load_run(workdir)
  hybrid = qwen3_5.is_hybrid(rc)
  fam, layout = qwen3_5.choose(rc, saved) if hybrid else (hfconfig.choose_family(rc), None)
  resolved = saved.get("resolved", {})
  vocab = rc.model.vocab_size or resolved.get("vocab_size")
  if not vocab:
    raise UserError(f"{workdir}/config.json has no resolved.vocab_size; cannot size the model")
  rc = rc.with_vocab(vocab)
  mc = rc.model
  eos = resolved.get("data", {}).get("tokenizer", {}).get("eos_id")
  hf = qwen3_5.to_hf(rc, fam, eos, layout, saved) if hybrid else hfconfig.to_hf(rc, fam, eos)
  _, state = runstate.abstract(mc)
  params = runstate.restore_params(workdir, state, step, router=fam.mla)
  os.makedirs(out, exist_ok=True)
  if hybrid:
    named = hybrid_tensors(mc, fam, params, layout, saved, log)
  else:
    named = [(s.hf, s.to_hf(params)) for s in deepseek_tensors.specs_for(fam)(mc, fam)]
    named += list(zero_biases(fam, mc).items())
  weight_map = write_shards(out, named)
  total = int(sum(a.nbytes for _, a in named))
  if len(set(weight_map.values())) > 1:
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  copy_tokenizer(rc, saved, out)
  log(f"exported {workdir} as {hf['architectures'][0]} to {out} ({total / 2**20:.1f} MiB float32)")
  return hf
