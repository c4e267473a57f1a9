"""Qwen1.5-MoE / Qwen2-MoE family preset, scaled down.

Copied from the public configuration (Qwen/Qwen1.5-MoE-A2.7B config.json, HF Qwen2MoE):
  * 60 routed experts, top-4, no top-k renormalization (norm_topk_prob false).
  * One shared expert of width 5632 = 4 x the routed width 1408, gated per token by
    sigmoid(x . w_g) (`qwen2_moe` rule).
  * Every layer MoE (decoder_sparse_step 1), dropless.
  * router_aux_loss_coef 0.001, over the forward batch (HF: `micro_batch`). No z-loss.
  * Balance convention `count` (transformers `load_balancing_loss_func`: f_i = share of
    tokens choosing expert i, summed over the K choices, so sum f = K and the balanced value
    is K), so the copied weight acts as strongly as it does there.
  * Full multi-head attention, untied embeddings, no QK-norm. (QKV biases not modelled.)
Scaled down: 60 experts -> 16, top-4 kept, 24 layers -> 4, d_model 2048 -> 64, expert width
1408 -> 32, shared width 4 x 32 = 128 (same 4:1 ratio). Qwen2-57B-A14B (64 experts, top-8,
shared = 8 x expert width) uses the same rule.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  d_expert = 32
  c.model.update(
    d_model=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    tie_embeddings=False,
    qk_norm=False,
    moe_every=1,
    first_dense=0,
  )
  c.model.moe.update(
    rule="qwen2_moe",
    n_experts=16,
    top_k=4,
    d_expert=d_expert,
    d_shared=4 * d_expert,
    dispatch="dropless",
  )
  c.loss.update(
    balance_convention="count",
    balance_weight=0.001,
    balance_granularity="micro_batch",
    z_loss_weight=0.0,
  )
  return c
