"""Decode tokens/s per k1 against the memory-bandwidth bound, and against transformers'
`generate`, on CPU, for an OLMoE-shaped model large enough to be memory-bound here.

A random transformers OLMoE (E = 64, K = 8, 4 layers, d_model 512, expert width 1024, vocab
8192: 1.7 GB of float32 weights, 88% of them routed experts) is saved and imported with
`python -m moejax.hf import`. In one process, on random 16-token prompts, 33 greedy tokens:

- moejax's decode (`moejax.decode.speed.measure`: the while-loop generator at k1, per-step
  time from a 33-token minus a 1-token generation, the distinct experts of each step read
  from the generated sequences' routing) at k1 = K, K/2, K/4, batch 1 and 8;
- transformers' greedy `generate` (float32, torch's threads = the cores) on the same
  checkpoint against moejax's generator, batch 1, k1 = K: new tokens per second of a whole
  33-token generation each (prefill included);
- the bound: batch × read bandwidth (a 512 MiB sum, measured first) / weight bytes one step
  reads.

Targets (issue 62; ratios, one run): at batch 1, tok/s(K/4)/tok/s(K) ≥ 0.8 × the bound's
ratio; k1 = K at ≥ 50% of its bound; moejax ≥ 1× transformers at k1 = K.

Run alone, on a quiet host: python benchmarks/decode_speed.py
Writes benchmarks/results/decode_speed.json (with the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

N_NEW, PROMPT = 33, 16


def olmoe_source(root: str, vocab: int, width: int) -> str:
  import torch
  import transformers

  src = os.path.join(root, "olmoe_hf")
  cfg = transformers.OlmoeConfig(
    vocab_size=vocab, hidden_size=512, intermediate_size=width, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, num_experts=64, num_experts_per_tok=8,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500.0, eos_token_id=0,
    pad_token_id=0, bos_token_id=None,
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  model.save_pretrained(src)
  _tokenizer(src, vocab)
  return src


def _tokenizer(src: str, vocab: int) -> None:
  """A word-level tokenizer.json of `vocab` ids (the import needs one; prompts are ids)."""
  import json

  import numpy as np
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab)}}
  tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(f"{src}/tokenizer.json")
  ids = np.random.default_rng(0).integers(1, vocab, size=(40, 200))  # held-out text to import
  with open(f"{src}/heldout.txt", "w") as f:
    f.write("\n\n".join(" ".join(f"w{i}" for i in row) for row in ids))
  with open(f"{src}/tokenizer_config.json", "w") as f:
    json.dump({"eos_token": "<eos>"}, f)


def hf_tok_s(src: str, vocab: int, repeats: int) -> float:
  """transformers' greedy generate at batch 1: new tokens per second of a whole 33-token
  generation (prefill included), best of `repeats` after a warm-up."""
  import numpy as np
  import torch
  import transformers

  torch.set_num_threads(os.cpu_count())
  model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
  ids = torch.as_tensor(np.random.default_rng(0).integers(1, vocab, size=(1, PROMPT)))
  best = float("inf")
  for _ in range(repeats + 1):
    t = time.perf_counter()
    with torch.no_grad():
      out = model.generate(ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    best = min(best, time.perf_counter() - t)
  assert out.shape[1] == PROMPT + N_NEW
  return N_NEW / best


def ours_tok_s(gen, vocab: int, repeats: int) -> float:
  """moejax's generate the same way: batch 1, k1 = K, a whole 33-token generation."""
  import numpy as np

  prompt = [list(np.random.default_rng(0).integers(1, vocab, size=PROMPT))]
  gen.generate(prompt, N_NEW)
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    gen.generate(prompt, N_NEW)
    best = min(best, time.perf_counter() - t)
  return N_NEW / best


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--width", type=int, default=1024)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  load_before = os.getloadavg()
  from moejax.decode import session as session_lib
  from moejax.decode import speed
  from moejax.kgrid.loading import load_config

  with tempfile.TemporaryDirectory() as root:
    src = olmoe_source(root, args.vocab, args.width)
    run = os.path.join(root, "run")
    subprocess.run([sys.executable, "-m", "moejax.hf", "import", src, "--workdir", run,
                    "--noprogress", "--seq_len", "64", "--sequences", "4",
                    "--text", f"{src}/heldout.txt", "--text_docs", "paragraph"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    bandwidth = speed.read_bandwidth()
    hf = hf_tok_s(src, args.vocab, args.repeats)
    rows = []
    rc = load_config(run)
    for batch in (1, 8):
      s = session_lib.open_session(run, rc, step=None, max_length=PROMPT + N_NEW + 1,
                                   batch_size=batch)  # fmt: skip
      if batch == 1:
        ours = ours_tok_s(s.generator, args.vocab, args.repeats)
      for k1 in (8, 4, 2):
        rows.append(speed.measure(s.generator, k1, batch, n_new=N_NEW, prompt_len=PROMPT,
                                  bandwidth=bandwidth, vocab=args.vocab))  # fmt: skip
        print(speed.markdown(rows[-1:], "").splitlines()[-1], flush=True)
  by = {(r.k1, r.batch): r for r in rows}
  k8, k2 = by[8, 1], by[2, 1]
  figures = {
    "model": f"OLMoE-shaped, E=64 K=8, 4 layers, d_model 512, expert width {args.width}, "
             f"vocab {args.vocab}, float32",  # fmt: skip
    "cores": os.cpu_count(),
    "load_before_1m_5m_15m": " / ".join(f"{x:.2f}" for x in load_before),
    "load_after_1m_5m_15m": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    "read_bandwidth_gb_s": bandwidth,
    "rows": [r._asdict() for r in rows],
    "hf_generate_tok_s_batch1": hf,
    "moejax_generate_tok_s_batch1": ours,
    "vs_hf_batch1_k8": ours / hf,
    "ratio_k2_over_k8_batch1": k2.tok_s / k8.tok_s,
    "bound_ratio_k2_over_k8_batch1": k2.bound_tok_s / k8.bound_tok_s,
    "target_ratio_met": k2.tok_s / k8.tok_s >= 0.8 * k2.bound_tok_s / k8.bound_tok_s,
    "k8_fraction_of_bound": k8.fraction_of_bound,
  }
  print(speed.markdown(rows, "decode speed"))
  print({k: v for k, v in figures.items() if k != "rows"})
  write_result("decode_speed", figures)


if __name__ == "__main__":
  main()
