"""Qwen3-MoE (Qwen3-30B-A3B / 235B-A22B) family preset, scaled down.

Copied from the public configuration (Qwen/Qwen3-30B-A3B config.json; Qwen3 report):
  * 128 experts, top-8, no shared expert; softmax then top-k renormalization
    (norm_topk_prob true, `qwen3_moe` rule). Every layer MoE, dropless.
  * Load-balancing loss router_aux_loss_coef 0.001, with global-batch balancing (the report
    computes the balance statistics over the global batch, not each micro-batch). No z-loss.
  * Balance convention `count` (transformers `load_balancing_loss_func`: f_i = share of
    tokens choosing expert i, summed over the K choices, so sum f = K and the balanced value
    is K), so the copied weight acts as strongly as it does there.
  * QK-norm (RMSNorm on q and k per head), GQA 32 query / 4 kv heads, untied embeddings
    (30B-A3B; the small dense Qwen3 models tie them).
Scaled down: 128 experts -> 16, top-8 -> 4, 48 layers -> 4, d_model 2048 -> 64, expert width
768 -> 32; GQA ratio 8 -> 4 (4 query / 1 kv head). Byte tokenizer, stdlib corpus.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  c.model.update(
    d_model=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=1,
    tie_embeddings=False,
    qk_norm=True,
    moe_every=1,
    first_dense=0,
  )
  c.model.moe.update(
    rule="qwen3_moe", n_experts=16, top_k=4, d_expert=32, d_shared=0, dispatch="dropless"
  )
  c.loss.update(
    balance_convention="count",
    balance_weight=0.001,
    balance_granularity="global_batch",
    z_loss_weight=0.0,
  )
  return c
