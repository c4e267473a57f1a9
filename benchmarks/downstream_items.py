"""Items per second of the task grid's lm-eval model against lm-eval's own HF model, on CPU.

Needs the `eval` and `hf` extras (lm-eval, torch, transformers). Two models, each scored on
the same local multiple-choice task (a `nextline` task from the quickstart run's held-out
documents, 4 choices) by both sides, in one process, arms interleaved:

- `quickstart`: configs/quickstart.py with the run's BPE (so that transformers has a
  tokenizer.json to read), trained `--steps` steps, exported with `python -m moejax.hf export`;
- `olmoe_100m`: a random transformers OLMoE of ~100M parameters (E = 64, K = 8, 4 layers,
  d_model 512) with a BPE fitted on the task's text, imported with `python -m moejax.hf import`.

moejax: `MoejaxLM` at the native cell (`--batch_size` rows per forward, longest first, padded
to 8, 12, 16, 24, ... buckets); lm-eval's HF model (`HFLM`) at `--batch_size`,
float32. Each arm's first pass (compiles, caches) and the minimum of `--repeats` warm passes.

Run alone: python benchmarks/downstream_items.py [--items 200] [--repeats 3]
Writes benchmarks/results/downstream_items.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

PY = sys.executable


def sh(*args: str) -> None:
  subprocess.run([PY, *args], check=True, stdout=subprocess.DEVNULL)


def quickstart_run(root: str, steps: int) -> str:
  run = os.path.join(root, "quickstart")
  sh("-m", "moejax.train", "--config", "configs/quickstart.py", "--workdir", run,
     f"--config.train.steps={steps}", f"--config.train.ckpt_every={steps}",
     f"--config.train.eval_every={steps}", "--config.eval.after_train=False",
     "--config.data.tokenizer=bpe", "--config.wandb.mode=disabled",
     "--config.train.progress=False")  # fmt: skip
  return run


def olmoe_source(root: str, task_jsonl: str) -> str:
  """A random ~100M-parameter transformers OLMoE with a BPE fitted on the task's text."""
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  src = os.path.join(root, "olmoe_hf")
  os.makedirs(src)
  with open(task_jsonl) as f:
    texts = [t for line in f for t in (lambda d: [d["context"], *d["choices"]])(json.loads(line))]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  trainer = trainers.BpeTrainer(
    vocab_size=4096, special_tokens=["<eos>"], initial_alphabet=alphabet
  )
  tok.train_from_iterator(texts, trainer)
  tok.save(os.path.join(src, "tokenizer.json"))
  with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  cfg = transformers.OlmoeConfig(
    vocab_size=32768, hidden_size=512, intermediate_size=160, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, num_experts=64, num_experts_per_tok=8,
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500.0, eos_token_id=0,
    pad_token_id=0, bos_token_id=None,
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  model.save_pretrained(src)
  return src


def n_params(hf_dir: str) -> int:
  from safetensors import safe_open

  total = 0
  for name in os.listdir(hf_dir):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(hf_dir, name), "np") as f:
        total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
  return total


def timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def arm(run: str, hf_dir: str, task_yaml: str, batch: int, repeats: int) -> dict:
  """Seconds per pass of both sides over the task: the first pass with the model's loading
  (and, for moejax, its compiles), then the minimum of warm passes with the model loaded;
  and whether the two sides chose the same answer on every item."""
  from lm_eval import evaluator
  from lm_eval.models.huggingface import HFLM

  from moejax.downstream import loading
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM
  from moejax.kgrid.loading import load_config

  models, out = {}, {}

  def load_ours():
    tm = loading.load_task_model(run, load_config(run), step=None, batch_size=batch)
    models["moejax"] = MoejaxLM(tm.scorer, tm.tokenizer)

  def load_theirs():
    models["lm_eval_hf"] = HFLM(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=batch)

  def score(side):
    task = tasks_lib.load_tasks(task_yaml)
    out[side] = evaluator.evaluate(models[side], {"tasks": task}, log_samples=True,
                                   bootstrap_iters=0)  # fmt: skip

  loaders = {"moejax": load_ours, "lm_eval_hf": load_theirs}
  first = {side: timed(lambda: (load(), score(side))) for side, load in loaders.items()}
  warm = {side: [] for side in loaders}
  for _ in range(repeats):
    for side in loaders:
      warm[side].append(timed(lambda: score(side)))
  name = next(iter(out["moejax"]["samples"]))
  acc = [[s["acc"] for s in sorted(out[k]["samples"][name], key=lambda s: s["doc_id"])]
         for k in loaders]  # fmt: skip
  n, best = len(acc[0]), {k: min(v) for k, v in warm.items()}
  return {
    "items": n,
    "moejax_first_s": first["moejax"],
    "hf_first_s": first["lm_eval_hf"],
    "moejax_warm_s": best["moejax"],
    "hf_warm_s": best["lm_eval_hf"],
    "moejax_items_per_s": n / best["moejax"],
    "hf_items_per_s": n / best["lm_eval_hf"],
    "speedup_warm": best["lm_eval_hf"] / best["moejax"],
    "speedup_first": first["lm_eval_hf"] / first["moejax"],
    "same_answers": acc[0] == acc[1],
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--items", type=int, default=200)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as root:
    run = quickstart_run(root, args.steps)
    tasks = os.path.join(root, "tasks")
    sh("-m", "moejax.tasks", "nextline", "--workdir", run, "--out", tasks,
       "--items", str(args.items))  # fmt: skip
    yaml = os.path.join(tasks, "nextline.yaml")
    qs_hf = os.path.join(root, "quickstart_hf")
    sh("-m", "moejax.hf", "export", "--workdir", run, "--out", qs_hf)
    src = olmoe_source(root, os.path.join(tasks, "nextline.jsonl"))
    olmoe_run = os.path.join(root, "olmoe_run")
    sh("-m", "moejax.hf", "import", src, "--workdir", olmoe_run, "--noprogress",
       "--seq_len", "256", "--sequences", "8")  # fmt: skip
    arms = []
    for label, r, hf in (("quickstart", run, qs_hf), ("olmoe_100m", olmoe_run, src)):
      arms.append({"model": label, "params": n_params(hf),
                   **arm(r, hf, yaml, args.batch_size, args.repeats)})  # fmt: skip
      print(json.dumps(arms[-1]), flush=True)
  write_result(
    "downstream_items",
    {"batch_size": args.batch_size, "task_items": args.items, "task_choices": 4, "arms": arms},
  )


if __name__ == "__main__":
  main()
