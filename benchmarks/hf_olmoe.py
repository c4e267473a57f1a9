"""transformers' OLMoE sparse block (PyTorch CPU) as a comparison point for moe_layer.py.

Needs the `bench` extra (torch, transformers). Uses the same thread count as XLA's CPU
client (every core) and transformers' default experts implementation for the config.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np


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
