"""OLMo-core MoE (AI2 Olmo MoE with a shared expert) family preset, scaled down.

Copied from the public OLMo-core MoE configuration (TransformerConfig small/llama-like MoE):
  * Fine-grained routed experts (32 experts, top-4 in the small config) plus an always-on
    shared MLP at unit gain; softmax, top-k renormalized, then rescaled so the routed
    weights sum to K (restore_weight_scale) (`olmo` rule: sum r_i = K, c(x) = 1).
  * Load-balancing loss weight 0.01 and router z-loss weight 0.001; balance over the local
    micro-batch. Every layer MoE, dropless. Balance convention `fraction` (OLMo-core's
    load-balancing loss divides the counts by tokens * top_k, as MegaBlocks does).
  * QK-norm; untied embeddings (approximately: the OLMo 2 convention).
  * Widths: expert 0.5 x d_model, shared MLP 2 x d_model (so the shared MLP is 4 experts wide).
Scaled down: 32 experts -> 16, top-4 kept, d_model -> 64, 4 layers, expert width 32, shared
width 128. Not modelled: OLMo 2's reordered (post-sublayer) norm; pre-norm is used here.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  d_model = 64
  c.model.update(
    d_model=d_model,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    tie_embeddings=False,
    qk_norm=True,
    moe_every=1,
    first_dense=0,
  )
  c.model.moe.update(
    rule="olmo",
    n_experts=16,
    top_k=4,
    d_expert=d_model // 2,
    d_shared=2 * d_model,
    dispatch="dropless",
  )
  c.loss.update(
    balance_convention="fraction",
    balance_weight=0.01,
    balance_granularity="micro_batch",
    z_loss_weight=0.001,
  )
  return c
