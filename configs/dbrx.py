"""DBRX (Databricks, 2024) family preset, scaled down.

Copied from the public configuration (databricks/dbrx-base config.json ffn_config, HF Dbrx):
  * 16 experts, top-4, no shared expert, every layer MoE, dropless (MegaBlocks).
  * Softmax over all experts, top-k weights divided by their L1 norm
    (moe_normalize_expert_weights = 1, `dbrx` rule); no router jitter (moe_jitter_eps 0).
  * Load-balancing loss moe_loss_weight 0.05 (released config; the HF DbrxFFNConfig default
    is 0.01), over each rank's micro-batch as in MegaBlocks. No z-loss. Balance convention
    `fraction` (MegaBlocks `batched_load_balancing_loss`: E / (T * K) * sum_i count_i P_i).
  * GQA 48 query / 8 kv heads, untied embeddings, RoPE theta 5e5.
Scaled down: d_model 6144 -> 64, 40 layers -> 4, expert width 10752 (1.75x d_model) -> 112
(1.75x). Not modelled: clip_qkv = 8, LayerNorm (RMSNorm here).
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
    rope_theta=5e5,
    moe_every=1,
    first_dense=0,
  )
  c.model.moe.update(
    rule="dbrx",
    n_experts=16,
    top_k=4,
    d_expert=112,
    d_shared=0,
    dispatch="dropless",
    jitter_eps=0.0,
  )
  c.loss.update(
    balance_convention="fraction",
    balance_weight=0.05,
    balance_granularity="micro_batch",
    z_loss_weight=0.0,
  )
  return c
