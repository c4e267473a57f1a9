"""`import`: a transformers checkpoint directory → a moejax run directory, shard by shard.

Memory: the float32 parameter arrays are allocated once (empty) and filled while the
safetensors shards stream past, one tensor at a time; nothing else holds the model. With
`model.scan_layers` (the default; `--noscan_layers` for the unrolled layout) the arrays are
the stacks, and each layer's tensors fill its row in place.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from tqdm import tqdm

from moejax import build
from moejax.data.tokenizer import HFTokenizer
from moejax.errors import UserError
from moejax.hf import families as fl
from moejax.hf import (
  deepseek_tensors,
  fp8,
  hfconfig,
  hub,
  qwen3_5,
  qwen3_5_tensors,
  runstate,
  tensors,
)
from moejax.config.reader import from_values, resolve
from moejax.hf.shard import Shard, header

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def read_json(path: str) -> dict:
  """A JSON file, or a one-line UserError naming it."""
  if not os.path.isfile(path):
    raise UserError(f"{path}: not found; PATH must be a transformers checkpoint directory")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"{path}: unreadable ({e})") from None


def shard_files(src: str) -> list[str]:
  """The safetensors shards of a checkpoint (from the index when there is one)."""
  index = os.path.join(src, "model.safetensors.index.json")
  if os.path.isfile(index):
    names = sorted(set(read_json(index)["weight_map"].values()))
  else:
    names = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
  if not names:
    raise UserError(f"{src}: no *.safetensors files (only safetensors checkpoints are read)")
  return [os.path.join(src, n) for n in names]


def tensor_index(files: list[str]) -> dict[str, str]:
  """Tensor name → shard file, from the shard headers only."""
  where: dict[str, str] = {}
  for path in files:
    where.update(dict.fromkeys(header(path), path))
  return where


def config_values(hf: dict, fam: fl.Family, src: str, opts: dict, tokenizer: str) -> dict:
  """The run config's values (over `base_config()`): the HF architecture, the user's
  held-out text, the model's tokenizer."""
  model = hfconfig.to_moejax(hf, fam, os.path.join(src, "config.json"))
  model.update(qwen3_5.model_keys(hf, fam, os.path.join(src, "config.json")))
  if "scan_layers" in opts:
    model["scan_layers"] = opts["scan_layers"]
  seq_len = opts.get("seq_len", 512)
  window = hf.get("sliding_window") if fam.name == "mixtral" else None
  if window and seq_len > window:
    raise UserError(f"--seq_len={seq_len} exceeds sliding_window={window}; lower it")
  data = {
    "corpus": "files" if opts.get("text") else "stdlib",
    "paths": opts.get("text", ""),
    "text_docs": opts.get("text_docs", "file"),
    "seq_len": seq_len,
    "holdout_fraction": opts.get("holdout_fraction", 0.02),
    "batch_size": 1,
    "tokenizer": tokenizer,
  }
  return {
    "model": model,
    "data": data,
    "eval": {"sequences": opts.get("sequences", 256), "batch_size": opts.get("batch_size", 8)},
    "train": {"steps": 1, "eval_every": 1, "ckpt_every": 1, "log_every": 1},
    "wandb": {"mode": opts.get("wandb_mode", "disabled")},
  }


def copy_tokenizer(src: str, hf: dict, workdir: str) -> str:
  """Copies tokenizer.json (+ tokenizer_config.json, EOS id) into DIR/tokenizer/."""
  if not os.path.isfile(os.path.join(src, "tokenizer.json")):
    raise UserError(f"{src}/tokenizer.json not found; the grid needs the model's own tokenizer")
  out = os.path.join(workdir, "tokenizer")
  os.makedirs(out, exist_ok=True)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(src, name)):
      shutil.copy(os.path.join(src, name), os.path.join(out, name))
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({"eos_token_id": hf.get("eos_token_id")}, f)
  return os.path.abspath(out)


def plan(mc, fam: fl.Family, where: dict[str, str], tied: bool,
         layout: qwen3_5_tensors.Layout = qwen3_5_tensors.PLAIN) -> dict[str, list[tensors.Spec]]:  # fmt: skip
  """HF tensor name → the specs it fills; a missing or unexpected tensor is a UserError.
  `layout`: where the model's tensors are, and which others the checkpoint holds."""
  names = {n: c for n in where if (c := layout.canonical(n)) is not None}  # disk → model name
  fused = tensors.fused_layers(set(names.values()), fam, mc.n_layers)
  build = qwen3_5_tensors.specs if fam.hybrid else deepseek_tensors.specs_for(fam)
  by_name: dict[str, list[tensors.Spec]] = {}
  for spec in build(mc, fam, fused):
    by_name.setdefault(layout.disk(spec.hf), []).append(spec)
  for name in by_name:
    if name not in where:
      raise UserError(f"missing tensor {name} (expected for {fam.architecture})")
  for name in names:
    scale = fp8.is_scale(name) and fp8.weight_of(name) in by_name  # read with its weight
    if (
      name not in by_name
      and not name.endswith(IGNORED)
      and not (tied and name == "lm_head.weight")
      and not scale
    ):
      raise UserError(
        f"unexpected tensor {name} in {where[name]}: no counterpart in moejax's model"
      )
  return by_name


def stream(files: list[str], by_name, arrays: dict, progress: bool = True, read=None) -> None:
  """Fills `arrays` from every shard, one tensor at a time (in file order), checking shapes;
  each tensor is converted to float32 as it is copied into its place, no other copy (an
  FP8 one is dequantized by `read`, an `fp8.Reader`, into one float32 copy first)."""
  read = read or (lambda shard, name: shard.read(name))
  for path in tqdm(files, desc="import shards", unit="shard", disable=not progress):
    with Shard(path) as shard:
      for name, entry in shard.entries.items():
        fills = [(spec, spec.view(arrays)) for spec in by_name.get(name, ())]
        for spec, dest in fills:  # in place: a layer's row of a stack, an expert's slice
          if spec.moejax_shape(entry.shape) != dest.shape:
            raise UserError(
              f"tensor {name} in {path} has shape {list(entry.shape)}, which does not fit "
              f"moejax's {spec.where()} {list(dest.shape)}"
            )
        value = read(shard, name) if fills else None
        for spec, dest in fills:
          dest[...] = spec.to_moejax(value)


def import_checkpoint(src: str, workdir: str, opts: dict | None = None, log=print) -> dict:
  """Converts `src` into the run directory `workdir`; returns the written config.json."""
  opts = opts or {}
  src = hub.resolve(src)  # a Hub id: its snapshot in the Hugging Face cache
  source = read_json(os.path.join(src, "config.json"))
  hf, layout = qwen3_5.unwrap(source, os.path.join(src, "config.json"))
  fam = fl.detect(hf, os.path.join(src, "config.json"))
  config_values(hf, fam, src, opts, "")  # its checks, before anything is written
  files = shard_files(src)
  block = fp8.block_size(hf, os.path.join(src, "config.json"))
  fp8.check(files, block)
  os.makedirs(workdir, exist_ok=True)
  tokenizer = "hf:" + copy_tokenizer(src, hf, workdir)
  rc = resolve(from_values(config_values(hf, fam, src, opts, tokenizer)))
  tok = HFTokenizer(tokenizer[3:])
  if tok.vocab_size > rc.model.vocab_size:
    raise UserError(
      f"{tok.path}: {tok.vocab_size} tokens > the model's vocab_size {rc.model.vocab_size}"
    )
  mc = rc.with_vocab(tok.vocab_size).model  # the checkpoint's vocab, its embedding padded
  where = tensor_index(files)
  if fam.mla:
    where = deepseek_tensors.without_mtp(where, mc.n_layers, log)
  by_name = plan(mc, fam, where, mc.tie_embeddings, layout)
  _, state = runstate.abstract(mc)
  arrays = {p: np.empty(s, np.float32) for p, s in runstate.shapes(state).items()}
  arrays.update({p: np.zeros(s, np.float32) for p, s in runstate.router_shapes(state).items()})
  tensors.zero_vocab_padding(mc, arrays)
  read = fp8.Reader(where, block)
  stream(files, by_name, arrays, progress=opts.get("progress", True), read=read)
  runstate.save(workdir, runstate.fill(state, arrays), {"imported_from": os.path.abspath(src)})
  n_params = build.count_params(state["params"], mc.moe).total
  out = dict(rc.tree)
  out["resolved"] = {
    "vocab_size": mc.vocab_size,
    "vocab_multiple": mc.vocab_multiple,  # the embedding's rows: vocab_size rounded up
    "padded_vocab_size": mc.padded_vocab,
    "n_params": n_params,
    "hf_import": {"source": os.path.abspath(src), "family": fam.name, "config": source},
  }
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(out, f, indent=2)
  arch = (source.get("architectures") or [fam.architecture])[0]
  log(
    f"imported {arch} ({n_params:,} params, rule {rc.tree['model']['moe']['rule']}, "
    f"K={mc.moe.top_k} of E={mc.moe.n_experts}) into {workdir}; grid it with "
    f"python -m moejax.evaluate --workdir {workdir}"
  )
  skipped = sorted({p for n in where for p in layout.skipped if n.startswith(p)})
  if skipped:
    log(f"skipped the tensors under {', '.join(p + '*' for p in skipped)}: not the text model")
  return out
