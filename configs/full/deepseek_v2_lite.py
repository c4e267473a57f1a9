"""DeepSeek-V2-Lite at full size: the twin of configs/deepseek_v2_lite.py, for the worksheet
and the deviceless fit.

Shapes from deepseek-ai/DeepSeek-V2-Lite's config.json (DeepseekV2Config): hidden_size 2048,
27 layers, first_k_dense_replace 1 with intermediate_size 10944, 64 routed experts of
moe_intermediate_size 1408, top-6, 2 shared experts (one SwiGLU of 2 x 1408), vocab 102400,
untied embeddings, rope_theta 10000.

Attention is MLA as published: no query LoRA (q_lora_rank null: a plain q_proj),
kv_lora_rank 512, qk_nope/rope/v head dims 128/64/128, 16 heads, YaRN (factor 40, original
4096, beta_fast 32, beta_slow 1, mscale 0.707 / mscale_all_dim 0.707).

Published (the model card): 15.7B total, 2.4B active. `python -m moejax.describe --config
configs/full/deepseek_v2_lite.py` counts 15.71B total and 2.66B active with the embedding
table (convention `all`), 2.45B without it (`no_input_embedding`): docs/mla.md.
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "deepseek_v2_lite.py"))
  c.model.update(
    vocab_size=102400,
    d_model=2048,
    n_layers=27,
    n_heads=16,
    n_kv_heads=16,
    d_ff=10944,
    first_dense=1,
    moe_every=1,
    # Remat, which the train step needs to fit at this size: measured deviceless on h100:8,
    # 113.42 GiB per GPU without it, 39.62 GiB with it (docs/mla.md).
    remat="full",
  )
  c.model.mla.update(
    q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
  )
  c.model.moe.update(n_experts=64, top_k=6, d_expert=1408, d_shared=2 * 1408)
  return c
