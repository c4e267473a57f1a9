"""Switch Transformer (Fedus et al., 2021) family preset, scaled down.

Copied from the public configuration (paper; HF SwitchTransformers configs):
  * top-1 routing, softmax over all experts, no renormalization (`switch` rule: r = p_top1).
  * Capacity dispatch: capacity factor 1.25 in training and 2.0 at eval, drops by position
    (first come, first served); dropped tokens keep only their residual.
  * Multiplicative router-input jitter x * U(1 - 0.01, 1 + 0.01) in training.
  * Load-balancing loss weight alpha = 0.01, computed over each core's local batch
    (`micro_batch`); no router z-loss (z-loss was introduced later, by ST-MoE).
  * Balance convention `count` (flaxformer / HF SwitchTransformers: f_i = share of tokens
    routed to i); with top-1 it equals `fraction`.
  * MoE replaces every other FFN: odd layers (HF encoder/decoder_sparse_step = 2).
  * No shared expert; full-attention heads (no GQA).
Scaled down: 128 experts (Switch-Base) -> 8; encoder-decoder T5 -> 4-layer decoder-only LM,
d_model 64, d_expert 128 (Switch experts are full-size FFNs); byte tokenizer, stdlib corpus.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  c.model.update(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=128, moe_every=2, first_dense=1
  )  # MoE on layers 1 and 3
  c.model.moe.update(
    rule="switch",
    n_experts=8,
    top_k=1,
    d_expert=128,
    d_shared=0,
    dispatch="capacity",
    capacity_factor=1.25,
    eval_capacity_factor=2.0,
    drop_policy="position",
    jitter_eps=0.01,
  )
  c.loss.update(
    balance_convention="count",
    balance_weight=0.01,
    balance_granularity="micro_batch",
    z_loss_weight=0.0,
  )
  return c
