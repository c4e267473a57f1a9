"""DeepSeek-V3 (DeepSeek-AI, 2024) family preset, scaled down.

Copied from the public configuration (technical report; deepseek-ai/DeepSeek-V3 config.json):
  * 256 routed experts, top-8, plus 1 always-on shared expert (unit gain).
  * Sigmoid scores; select on s + b (aux-loss-free bias), weight with the unbiased s,
    renormalized over the selected experts and scaled by routed_scaling_factor 2.5.
  * Group-limited routing: 8 groups, keep the 4 best by the sum of each group's top-2 scores
    (`deepseek_v3` rule).
  * First 3 of 61 layers dense, the rest MoE, dropless.
  * Aux-loss-free balancing: bias update speed gamma = 0.001 (b_i += gamma * sign(mean load -
    load_i); the report sets it to 0 for the last 500B tokens, not modelled), plus a
    complementary sequence-wise balance loss with alpha = 0.0001 (convention `fraction`:
    f_i = E / (K * T) * count_i in the report). No z-loss. Untied embeddings.
Scaled down: 256 experts -> 16 in 8 groups of 2 (keep 4 groups = 8 candidate experts), top-8
-> 4, 61 layers -> 4 with 1 dense, d_model 7168 -> 64, expert width 2048 -> 32, shared width
1 x 32, dense d_ff ~ (top-k + shared) x expert width.
Attention is MLA (`model.mixers=mla`): query LoRA rank 1536 -> 24, kv_lora_rank 512 -> 32,
head dims 128/64/128 -> 16/8/16, YaRN (factor 40, mscale 1, mscale_all_dim 1: the softmax
scale × 1.8739). The MTP module is not modelled.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  n_shared, d_expert, top_k = 1, 32, 4
  c.model.update(
    d_model=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    tie_embeddings=False,
    d_ff=(top_k + n_shared) * d_expert,
    moe_every=1,
    first_dense=1,
    mixers="mla",
  )
  c.model.mla.update(
    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rope_type="yarn", rope_factor=40.0, rope_original_max_position_embeddings=4096,
    rope_mscale=1.0, rope_mscale_all_dim=1.0,
  )  # fmt: skip
  c.model.moe.update(
    rule="deepseek_v3",
    n_experts=16,
    top_k=top_k,
    d_expert=d_expert,
    d_shared=n_shared * d_expert,
    dispatch="dropless",
    n_groups=8,
    topk_groups=4,
  )
  c.loss.update(
    balance_convention="fraction",
    balance_weight=0.0001,
    balance_granularity="sequence",
    z_loss_weight=0.0,
    bias_update_rate=0.001,
  )
  return c
