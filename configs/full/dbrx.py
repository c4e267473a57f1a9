"""DBRX at full size: the twin of configs/dbrx.py, for the worksheet only.

Shapes from databricks/dbrx-base's config.json (HF DbrxConfig, whose defaults are these
values): d_model 6144, 40 layers, 48 query heads of 128 and attn_config.kv_n_heads 8,
ffn_config: 16 experts of ffn_hidden_size 10752, top-4; vocab 100352, untied embeddings,
rope_theta 5e5.

Published: 132B total, 36B active (Databricks' announcement). Reproduced by counting every
parameter, embedding table and LM head included (convention `all`): 131.60B / 36.47B.
Not modelled: LayerNorm without bias (RMSNorm here: the same parameter count), clip_qkv 8.
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "dbrx.py"))
  c.model.update(
    vocab_size=100352,
    d_model=6144,
    n_layers=40,
    n_heads=48,
    n_kv_heads=8,
    head_dim=128,
    d_ff=0,  # every layer is MoE
    norm_eps=1e-5,
    not_modelled="LayerNorm (RMSNorm here, same count), clip_qkv 8",
  )
  c.model.moe.update(n_experts=16, top_k=4, d_expert=10752, d_shared=0)
  return c
