"""transformers' OLMoE sparse block (PyTorch CPU) as a comparison point for moe_layer.py.

Needs the `bench` extra (torch, transformers). Uses the same thread count as XLA's CPU
client (every core) and transformers' default experts implementation for the config.

Run alone: python benchmarks/hf_olmoe.py [--repeats 7]
Times the block's forward + backward (min of `--repeats`) at moe_layer.py's shapes and
cotangents, and writes benchmarks/results/hf_olmoe.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_min, write_result


def available() -> bool:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    return False
  return True


def fwd_bwd(T: int, d: int, f: int, E: int, K: int, g_TxD) -> tuple[Callable[[], object], str]:
  """A closure running OlmoeSparseMoeBlock forward + backward of sum(y · g) on T tokens
  (g: the cotangent array moe_layer.py gives every arm), and a label naming the torch
  version, threads and experts implementation."""
  import torch
  import transformers
  from transformers import OlmoeConfig
  from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

  torch.set_num_threads(os.cpu_count() or 1)
  cfg = OlmoeConfig(hidden_size=d, intermediate_size=f, num_experts=E, num_experts_per_tok=K)
  torch.manual_seed(0)
  block = OlmoeSparseMoeBlock(cfg)
  for p in block.parameters():
    torch.nn.init.normal_(p, std=0.02)
  x = torch.randn(1, T, d, requires_grad=True)
  g = torch.from_numpy(np.asarray(g_TxD)).reshape(1, T, d)

  def step():
    block.zero_grad(set_to_none=True)
    x.grad = None
    (block(x) * g).sum().backward()
    return x.grad

  impl = getattr(cfg, "_experts_implementation", None) or "eager"
  label = f"torch {torch.__version__} transformers {transformers.__version__} "
  return step, label + f"threads={torch.get_num_threads()} experts={impl}"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args()
  if not available():
    sys.exit("error: needs torch and transformers (pip install -e '.[bench]')")
  from moe_layer import CASES, cotangent  # pylint: disable=import-outside-toplevel

  print("| T | d | f | E | K | OLMoE block ms |\n|---|---|---|---|---|---:|")
  rows, label = [], ""
  for T, d, f, E, K in CASES:
    step, label = fwd_bwd(T, d, f, E, K, cotangent(T, d))
    ms = interleaved_min({"olmoe": step}, args.repeats)["olmoe"] * 1e3
    print(f"| {T} | {d} | {f} | {E} | {K} | {ms:.1f} |", flush=True)
    rows.append({"T": T, "d": d, "f": f, "E": E, "K": K, "olmoe_ms": ms})
  print(f"OLMoE block: {label}")
  write_result("hf_olmoe", {"rows": rows, "olmoe_block": label, "repeats": args.repeats})


if __name__ == "__main__":
  main()
