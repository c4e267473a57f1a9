"""Qwen1.5-MoE-A2.7B at full size: the twin of configs/qwen2_moe.py, for the worksheet only.

Shapes from Qwen/Qwen1.5-MoE-A2.7B's config.json (Qwen2MoeConfig): hidden_size 2048, 24
layers, 16 heads of 128 (MHA), 60 experts of moe_intermediate_size 1408, top-4, one shared
expert of shared_expert_intermediate_size 5632 with a sigmoid gate, decoder_sparse_step 1,
vocab 151936, untied embeddings, rope_theta 1e6.

Published: 14.3B total, 2.7B active (model card), and 2.0B non-embedding active (Qwen blog).
Reproduced by counting every parameter, embedding table and LM head included (convention
`all`): 14.32B / 2.69B; `non_embedding` gives 2.07B active.
Not modelled: the q/k/v projection biases (3 x 2048 per layer, 147K in all).
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "qwen2_moe.py"))
  c.model.update(
    vocab_size=151936,
    d_model=2048,
    n_layers=24,
    n_heads=16,
    n_kv_heads=16,
    head_dim=128,
    d_ff=0,  # every layer is MoE
    rope_theta=1e6,
    not_modelled="q/k/v projection biases (3 x 2048 per layer, 147K in all)",
  )
  c.model.moe.update(n_experts=60, top_k=4, d_expert=1408, d_shared=5632)
  return c
