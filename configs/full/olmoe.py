"""OLMoE-1B-7B at full size: the twin of configs/olmoe.py, for the worksheet only.

Shapes from allenai/OLMoE-1B-7B-0924's config.json (HF OlmoeConfig): hidden_size 2048, 16
layers, 16 heads of 128 (MHA), QK-norm, 64 experts of intermediate_size 1024, top-8, vocab
50304, untied embeddings, rope_theta 10000, rms_norm_eps 1e-5. (transformers' OlmoeConfig
defaults to intermediate_size 2048, which is not the released model: it would count ~13B.)

Published: 6.9B total, 1.3B active (OLMoE paper). Reproduced by counting every parameter,
embedding table and LM head included (convention `all`): 6.92B / 1.28B.
Not modelled: OLMoE normalizes q and k over the whole projection (2 x 2048 scales per layer);
moejax's QK-norm is per head (2 x 128), 61K parameters fewer in all.
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "olmoe.py"))
  c.model.update(
    vocab_size=50304,
    d_model=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=16,
    head_dim=128,
    d_ff=0,  # every layer is MoE
    qk_norm=True,
    norm_eps=1e-5,
    not_modelled="QK-norm over the whole q/k projection (per head here; 61K scales fewer)",
  )
  c.model.moe.update(n_experts=64, top_k=8, d_expert=1024, d_shared=0)
  return c
