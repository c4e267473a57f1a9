"""OLMoE-1B-7B (AI2, 2024) family preset, scaled down.

Copied from the public configuration (allenai/OLMoE-1B-7B-0924 config.json; OLMoE paper):
  * 64 experts, top-8, no shared expert, every layer MoE, dropless.
  * Softmax over all experts without top-k renormalization (norm_topk_prob false, `olmoe`).
  * Load-balancing loss weight 0.01 (router_aux_loss_coef) and router z-loss weight 0.001
    (paper), balance over the local micro-batch. Balance convention `fraction`: OLMoE was
    trained with MegaBlocks' loss (E / (T * K) * sum_i count_i P_i); transformers' Olmoe port
    uses `count`, the convention of its `load_balancing_loss_func`.
  * QK-norm, full multi-head attention (16/16), untied embeddings.
Scaled down: 64 experts -> 16, top-8 -> 4, 16 layers -> 4, d_model 2048 -> 64, expert width
1024 (0.5x d_model) -> 32 (0.5x). Byte tokenizer, stdlib corpus.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  c.model.update(
    d_model=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    tie_embeddings=False,
    qk_norm=True,
    moe_every=1,
    first_dense=0,
  )
  c.model.moe.update(
    rule="olmoe", n_experts=16, top_k=4, d_expert=32, d_shared=0, dispatch="dropless"
  )
  c.loss.update(
    balance_convention="fraction",
    balance_weight=0.01,
    balance_granularity="micro_batch",
    z_loss_weight=0.001,
  )
  return c
