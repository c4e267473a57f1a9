"""Peak memory of `python -m moejax.hf import` on a synthetic ~200M-parameter OLMoE.

    python benchmarks/hf_import_memory.py measure DIR [--python PY ...] [--baseline REV]
    python benchmarks/hf_import_memory.py make DIR     # bf16 shards via save_pretrained only

`make` builds the model with transformers' own OlmoeConfig (random weights, bfloat16,
100 MB shards) and a character-level tokenizer.json, so nothing is downloaded. `measure`
then runs `python -m moejax.hf import DIR/model --workdir DIR/run --progress=false` as a
child process and takes its peak RSS (the kernel's ru_maxrss of that child, what
/usr/bin/time -v reports) and wall time, beside the peak RSS of a child that only imports
jax and moejax.hf (the floor), under each `--python` interpreter (default: this one; one
per jax line, each with moejax's dependencies installed) with this tree's moejax first on
its PYTHONPATH. `--baseline REV` measures REV's moejax too (`git archive` into
DIR/src-REV), side by side: a row per interpreter and code. The rows, with the model's
float32 size, go to benchmarks/results/hf_import_memory.json; `import_over_float32` =
(peak - floor) / float32 size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import REPO, RESULTS, write_result

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


def peak_rss(python: str, argv: list[str], code: str, cwd: str) -> tuple[float, float, str]:
  """(peak RSS in MiB, wall seconds, stdout) of `PYTHON ARGV` run as a child process in
  `cwd` (not a source tree: `-c` puts the working directory first on sys.path) with `code`
  first on its PYTHONPATH."""
  path = os.pathsep.join(filter(None, (code, os.environ.get("PYTHONPATH"))))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
  t0 = time.perf_counter()
  proc = subprocess.Popen([python, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  if os.waitstatus_to_exitcode(status) != 0:
    sys.exit(f"error: {python} {' '.join(argv)} failed")
  return usage.ru_maxrss / 1024, time.perf_counter() - t0, out  # ru_maxrss: KiB on Linux


FLOOR = (
  "import platform, jax, moejax, moejax.hf; "
  "print(platform.python_version(), jax.__version__, moejax.__file__)"
)


def export(rev: str, directory: str) -> str:
  """REV's tree (`git archive`) under DIR/src-REV; its path."""
  out = os.path.join(directory, f"src-{rev}")
  if not os.path.isdir(out):
    os.makedirs(out)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", out], input=archive.stdout, check=True)
  return out


def row(python: str, code: str, name: str, directory: str, float32_mib: float) -> dict:
  """One interpreter and code's floor, import peak and wall time."""
  floor, _, out = peak_rss(python, ["-c", FLOOR], code, directory)
  version, jax_version, where = out.split()
  if not where.startswith(os.path.join(code, "moejax")):
    sys.exit(f"error: {python} imports moejax from {where}, not from {code}")
  model, run = os.path.join(directory, "model"), os.path.join(directory, "run")
  shutil.rmtree(run, ignore_errors=True)  # each import writes a fresh run directory
  argv = ["-m", "moejax.hf", "import", model, "--workdir", run, "--progress=false"]
  rss, wall, _ = peak_rss(python, argv, code, directory)
  print(f"python {version} / jax {jax_version}, {name}: peak RSS {rss:.0f} MiB "
        f"({floor:.0f} MiB floor), {wall:.1f} s wall")  # fmt: skip
  return {
    "python": version, "jax": jax_version, "code": name, "floor_RSS_MiB": floor,
    "import_peak_RSS_MiB": rss, "import_wall_s": wall,
    "import_over_float32": (rss - floor) / float32_mib,
  }  # fmt: skip


def measure(directory: str, pythons: list[str], baseline: str | None) -> dict:
  """`make` in a child, then the import and the floor in children of this small process: a
  child's ru_maxrss counts the memory it was forked with, so the parent holds no model."""
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  model = os.path.join(directory, "model")
  print(peak_rss(sys.executable, [os.path.abspath(__file__), "make", model], REPO, directory)[2])
  with open(os.path.join(RESULTS, "hf_import_memory.json")) as f:
    out = json.load(f)["figures"]  # the model's figures, written by `make`
  codes = [(REPO, "this tree")]
  if baseline:
    codes.insert(0, (export(baseline, directory), baseline))
  out["imports"] = [
    row(py, code, name, directory, out["float32_MiB"]) for py in pythons for code, name in codes
  ]
  return out


def main() -> None:
  parser = argparse.ArgumentParser(usage=__doc__)
  parser.add_argument("action", choices=("make", "measure"))
  parser.add_argument("directory")
  parser.add_argument("--python", action="append", help="an interpreter to import with")
  parser.add_argument("--baseline", help="a git revision to measure beside this tree")
  args = parser.parse_args()
  if args.action == "make":
    figures = make(args.directory)
  else:
    figures = measure(args.directory, args.python or [sys.executable], args.baseline)
  write_result("hf_import_memory", figures)


if __name__ == "__main__":
  main()
