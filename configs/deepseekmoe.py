"""DeepSeekMoE 16B / DeepSeek-V2-Lite family preset, scaled down.

Copied from the public configuration (deepseek-ai/deepseek-moe-16b-base config.json; V2-Lite
uses the same MoE settings):
  * 64 fine-grained routed experts, top-6, plus 2 always-on shared experts (unit gain).
  * Softmax over all experts, no top-k renormalization (norm_topk_prob false), no groups
    (`deepseek_v2_lite` rule).
  * First layer dense (first_k_dense_replace = 1), every later layer MoE, dropless.
  * Expert-level balance loss aux_loss_alpha = 0.001 computed per sequence (seq_aux true).
    No z-loss. Balance convention `fraction`: the paper's f_i = E / (K * T) * count_i gives
    alpha * E * sum_i (count_i / (K T)) P_i. Untied embeddings; 16B uses full multi-head
    attention.
Scaled down: 64 experts -> 16, top-6 -> 4, 28 layers -> 4, d_model 2048 -> 64, expert width
1408 (~0.7x d_model) -> 32; shared width d_shared = 2 x 32. The dense first layer keeps the
16B ratio d_ff ~ (top-k + shared) x expert width. V2-Lite's MLA attention is not modelled.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  n_shared, d_expert, top_k = 2, 32, 4
  c.model.update(
    d_model=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    tie_embeddings=False,
    d_ff=(top_k + n_shared) * d_expert,
    moe_every=1,
    first_dense=1,
  )
  c.model.moe.update(
    rule="deepseek_v2_lite",
    n_experts=16,
    top_k=top_k,
    d_expert=d_expert,
    d_shared=n_shared * d_expert,
    dispatch="dropless",
  )
  c.loss.update(
    balance_convention="fraction",
    balance_weight=0.001,
    balance_granularity="sequence",
    z_loss_weight=0.0,
  )
  return c
