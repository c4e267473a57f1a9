"""DeepSeekMoE 16B at full size: the twin of configs/deepseekmoe.py, for the worksheet only.

Shapes from deepseek-ai/deepseek-moe-16b-base's config.json (DeepseekConfig): hidden_size
2048, 28 layers, 16 heads of 128 (MHA), first_k_dense_replace 1 with intermediate_size
10944, 64 routed experts of moe_intermediate_size 1408, top-6, 2 shared experts, vocab
102400, untied embeddings, rope_theta 10000.
The 2 shared experts are one SwiGLU of width 2 x 1408 = 2816 here (two SwiGLUs summed are
one SwiGLU over the concatenated hidden units: the same function and parameter count).

Published: 16.4B total, 2.8B active (DeepSeekMoE paper). Reproduced by counting every
parameter, embedding table and LM head included (convention `all`): 16.38B / 2.83B.
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "deepseekmoe.py"))
  c.model.update(
    vocab_size=102400,
    d_model=2048,
    n_layers=28,
    n_heads=16,
    n_kv_heads=16,
    head_dim=128,
    d_ff=10944,
    first_dense=1,
    moe_every=1,
  )
  c.model.moe.update(n_experts=64, top_k=6, d_expert=1408, d_shared=2 * 1408)
  return c
