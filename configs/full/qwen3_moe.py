"""Qwen3-30B-A3B at full size: the twin of configs/qwen3_moe.py, for the worksheet only.

Shapes from Qwen/Qwen3-30B-A3B's config.json (Qwen3MoeConfig; the same in the Megatron
arguments of THUDM/slime's scripts/models/qwen3-30B-A3B.sh): hidden_size 2048, 48 layers,
32 query / 4 kv heads of head_dim 128, QK-norm, 128 experts of moe_intermediate_size 768,
top-8, no shared expert, vocab 151936, untied embeddings, rope_theta 1e6.

Published: 30.5B total, 3.3B active (model card). Reproduced by counting every parameter,
embedding table and LM head included (convention `all`): 30.53B / 3.35B.
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "qwen3_moe.py"))
  c.model.update(
    vocab_size=151936,
    d_model=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    d_ff=0,  # every layer is MoE
    qk_norm=True,
    rope_theta=1e6,
  )
  c.model.moe.update(n_experts=128, top_k=8, d_expert=768, d_shared=0)
  return c
