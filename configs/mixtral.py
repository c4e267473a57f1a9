"""Mixtral 8x7B (Mistral AI, 2024) family preset, scaled down.

Copied from the public configuration (mistralai/Mixtral-8x7B-v0.1 config.json, HF Mixtral):
  * 8 experts, top-2, every layer MoE, no shared expert, dropless.
  * Softmax over the selected logits = top-k of the full softmax renormalized (`mixtral` rule).
  * Load-balancing loss weight 0.02: `router_aux_loss_coef` in the released config.json
    (the transformers MixtralConfig default is 0.001; Mistral's own training weight is not
    public). HF computes it over the whole forward batch (`micro_batch`). No z-loss.
  * Balance convention `count` (transformers `load_balancing_loss_func`: f_i = share of
    tokens choosing expert i, summed over the K choices, so sum f = K and the balanced value
    is K), so the copied weight acts as strongly as it does there.
  * GQA 32 query / 8 kv heads (ratio 4), untied embeddings, RoPE theta 1e6.
Scaled down: d_model 4096 -> 64, 32 layers -> 4, expert FFN 14336 (3.5x d_model) -> 128 (2x);
byte tokenizer, stdlib corpus. Sliding-window attention (Mistral 7B) is not modelled.
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
    rope_theta=1e6,
    moe_every=1,
    first_dense=0,
  )
  c.model.moe.update(
    rule="mixtral", n_experts=8, top_k=2, d_expert=128, d_shared=0, dispatch="dropless"
  )
  c.loss.update(
    balance_convention="count",
    balance_weight=0.02,
    balance_granularity="micro_batch",
    z_loss_weight=0.0,
  )
  return c
