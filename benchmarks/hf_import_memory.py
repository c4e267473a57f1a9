"""Peak memory of `python -m moejax.hf import` on a synthetic ~200M-parameter OLMoE.

    python benchmarks/hf_import_memory.py make DIR     # bf16 shards via save_pretrained
    /usr/bin/time -v python -m moejax.hf import DIR --workdir RUN --progress=false

`make` builds the model with transformers' own OlmoeConfig (random weights, bfloat16,
100 MB shards) and a character-level tokenizer.json, so nothing is downloaded. The report
is the "Maximum resident set size" line of /usr/bin/time -v against `float32 size`, which
`make` prints and writes to benchmarks/results/hf_import_memory.json.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

SHAPE = {
  "vocab_size": 32000, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
  "num_key_value_heads": 8, "intermediate_size": 800, "num_experts": 32, "num_experts_per_tok": 8,
  "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 1,
  "pad_token_id": None, "bos_token_id": None,
}  # fmt: skip


def write_tokenizer(directory: str) -> None:
  """A character-level tokenizer.json (BPE without merges) and its tokenizer_config.json."""
  from tokenizers import Tokenizer, models

  vocab = {"[UNK]": 0, "<eos>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
  Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]")).save(
    os.path.join(directory, "tokenizer.json")
  )
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>"}, f)


def make(directory: str) -> dict:
  import torch
  import transformers

  torch.manual_seed(0)
  cfg = transformers.OlmoeConfig(**SHAPE)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
  n = sum(p.numel() for p in model.parameters())
  model.save_pretrained(directory, max_shard_size="100MB")
  write_tokenizer(directory)
  shards = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
  biggest = max(os.path.getsize(os.path.join(directory, f)) for f in shards)
  print(
    f"{directory}: {n:,} params, float32 size {4 * n / 2**20:.0f} MiB, "
    f"{len(shards)} bf16 shards, largest {biggest / 2**20:.0f} MiB"
  )
  return {
    "params": n,
    "float32_MiB": 4 * n / 2**20,
    "bf16_shards": len(shards),
    "largest_shard_MiB": biggest / 2**20,
  }


def main() -> None:
  if len(sys.argv) != 3 or sys.argv[1] != "make":
    sys.exit(__doc__)
  write_result("hf_import_memory", make(sys.argv[2]))


if __name__ == "__main__":
  main()
