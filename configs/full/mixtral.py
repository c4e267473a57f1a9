"""Mixtral 8x7B at full size: the twin of configs/mixtral.py, for the worksheet only.

Shapes from mistralai/Mixtral-8x7B-v0.1's config.json (HF MixtralConfig; the same values in
the copies found by code search, e.g. Mixtral-8x7B-Instruct's printed MixtralConfig):
hidden_size 4096, 32 layers, 32 query / 8 kv heads of 128, intermediate_size 14336, 8 local
experts, top-2, vocab 32000, untied embeddings, rope_theta 1e6, rms_norm_eps 1e-5.

Published: 46.7B total, 12.9B active (Mistral AI's announcement). Reproduced by counting
every parameter, embedding table and LM head included (convention `all`): 46.70B / 12.88B.
Rule, losses and dispatch are the scaled preset's. Far too large to train here; run
`python -m moejax.describe --config configs/full/mixtral.py`.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "mixtral.py"))
  c.model.update(
    vocab_size=32000,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=0,  # every layer is MoE
    norm_eps=1e-5,
  )
  c.model.moe.update(n_experts=8, top_k=2, d_expert=14336, d_shared=0)
  return c
