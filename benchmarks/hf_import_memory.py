"""Peak memory of `python -m moejax.hf import` on a synthetic ~200M-parameter OLMoE.

    python benchmarks/hf_import_memory.py measure DIR  # make, then import it, measured
    python benchmarks/hf_import_memory.py make DIR     # bf16 shards via save_pretrained only

`make` builds the model with transformers' own OlmoeConfig (random weights, bfloat16,
100 MB shards) and a character-level tokenizer.json, so nothing is downloaded. `measure`
then runs `python -m moejax.hf import DIR/model --workdir DIR/run --progress=false` as a
child process and takes its peak RSS (the kernel's ru_maxrss of that child, what
/usr/bin/time -v reports) and wall time, beside the peak RSS of a child that only imports
jax (the floor), and writes them with the model's float32 size to
benchmarks/results/hf_import_memory.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, write_result

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


def peak_rss(argv: list[str]) -> tuple[float, float]:
  """(peak RSS in MiB, wall seconds) of `python ARGV` run as a child process."""
  t0 = time.perf_counter()
  proc = subprocess.Popen([sys.executable, *argv], env={**os.environ, "JAX_PLATFORMS": "cpu"})
  _, status, usage = os.wait4(proc.pid, 0)
  if os.waitstatus_to_exitcode(status) != 0:
    sys.exit(f"error: python {' '.join(argv)} failed")
  return usage.ru_maxrss / 1024, time.perf_counter() - t0  # ru_maxrss is in KiB on Linux


def measure(directory: str) -> dict:
  """`make` in a child, then the import and the floor in children of this small process: a
  child's ru_maxrss counts the memory it was forked with, so the parent holds no model."""
  model, run = os.path.join(directory, "model"), os.path.join(directory, "run")
  peak_rss([__file__, "make", model])  # writes the model's figures to the result file
  with open(os.path.join(RESULTS, "hf_import_memory.json")) as f:
    out = json.load(f)["figures"]
  rss, wall = peak_rss(["-m", "moejax.hf", "import", model, "--workdir", run, "--progress=false"])
  floor, _ = peak_rss(["-c", "import jax, moejax.hf"])
  out |= {"import_peak_RSS_MiB": rss, "import_wall_s": wall, "floor_RSS_MiB": floor}
  out["import_over_float32"] = (rss - floor) / out["float32_MiB"]
  print(f"import: peak RSS {rss:.0f} MiB ({floor:.0f} MiB floor), {wall:.1f} s wall")
  return out


def main() -> None:
  if len(sys.argv) != 3 or sys.argv[1] not in ("make", "measure"):
    sys.exit(__doc__)
  figures = make(sys.argv[2]) if sys.argv[1] == "make" else measure(sys.argv[2])
  write_result("hf_import_memory", figures)


if __name__ == "__main__":
  main()
