"""DeepSeek-V2-Lite family preset with its attention: multi-head latent attention (MLA),
scaled down.

Copied from the public configuration (deepseek-ai/DeepSeek-V2-Lite config.json,
DeepseekV2Config):
  * MLA: no query LoRA (q_lora_rank null: a plain q_proj), kv_lora_rank 512, qk_nope_head_dim
    128 + qk_rope_head_dim 64 per query/key head, v_head_dim 128, 16 heads; RoPE on adjacent
    pairs; YaRN (factor 40, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1,
    mscale 0.707, mscale_all_dim 0.707: the softmax scale × 1.5896).
  * 64 routed experts, top-6, 2 shared experts (unit gain), softmax without renormalization
    (`deepseek_v2_lite` rule); first layer dense (first_k_dense_replace 1), dropless.
  * aux_loss_alpha 0.001 per sequence (seq_aux), convention `fraction`; no z-loss; untied.
Scaled down: 27 layers -> 4, d_model 2048 -> 64, 16 heads -> 4, kv_lora_rank 512 -> 32,
head dims 128/64/128 -> 16/8/16, 64 experts -> 16, top-6 -> 4, expert width 1408 -> 32.
The study's calibration question under MLA is one override away: `model.mixers=gqa` trains
the same MoE with GQA attention.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  n_shared, d_expert, top_k = 2, 32, 4
  c.model.update(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, tie_embeddings=False,
    d_ff=(top_k + n_shared) * d_expert, moe_every=1, first_dense=1, mixers="mla",
  )  # fmt: skip
  c.model.mla.update(
    q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rope_type="yarn", rope_factor=40.0, rope_original_max_position_embeddings=4096,
    rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=0.707, rope_mscale_all_dim=0.707,
  )  # fmt: skip
  c.model.moe.update(
    rule="deepseek_v2_lite", n_experts=16, top_k=top_k, d_expert=d_expert,
    d_shared=n_shared * d_expert, dispatch="dropless",
  )  # fmt: skip
  c.loss.update(
    balance_convention="fraction", balance_weight=0.001, balance_granularity="sequence",
    z_loss_weight=0.0,
  )  # fmt: skip
  return c
