"""Qwen3.5-MoE (Qwen3-Next lineage, e.g. Qwen3.5-35B-A3B) family preset, scaled down.

Copied from the public configuration (transformers Qwen3_5MoeTextConfig defaults, modelled
on Qwen3.5-35B-A3B; Qwen3-Next-80B-A3B is the same MoE design with 512 experts, top-10):
  * 256 routed experts, top-8, softmax then renormalization over the top-k (unconditional in
    the Qwen3.5-MoE code), plus one shared expert of the routed width (512) gated by
    sigmoid(x . w_g) (`qwen3_5_moe` rule). Every layer MoE, dropless.
  * router_aux_loss_coef 0.001; balanced over the global batch as in Qwen3 (the Qwen3.5
    training recipe itself is not public in that detail). No z-loss.
  * Balance convention `count` (transformers `load_balancing_loss_func`: f_i = share of
    tokens choosing expert i, summed over the K choices, so sum f = K and the balanced value
    is K), so the copied weight acts as strongly as it does there.
  * QK-norm, GQA 16 query / 2 kv heads, untied embeddings.
Scaled down: 256 experts -> 16, top-8 -> 4, 40 layers -> 4, d_model 2048 -> 64, expert and
shared width 512 -> 32.
The hybrid is modelled: three Gated DeltaNet layers then one gated full-attention layer
(`model.mixers`, layer_types' 3:1 pattern; Gated DeltaNet 16 key / 32 value heads of 128 ->
2 / 4 of 16, conv 4), gated attention with partial RoPE 0.25 (head_dim 256 -> 16), and
zero-centred norms (`model.norm`). Not modelled: MTP.
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
    n_kv_heads=1,
    tie_embeddings=False,
    head_dim=16,
    qk_norm=True,
    moe_every=1,
    first_dense=0,
    mixers="gated_deltanet,gated_deltanet,gated_deltanet,gated_attention",
    norm="zero_centred",
    partial_rotary_factor=0.25,
  )
  c.model.gated_deltanet.update(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
  )  # fmt: skip
  c.model.moe.update(
    rule="qwen3_5_moe",
    n_experts=16,
    top_k=4,
    d_expert=d_expert,
    d_shared=1 * d_expert,
    dispatch="dropless",
  )
  c.loss.update(
    balance_convention="count",
    balance_weight=0.001,
    balance_granularity="global_batch",
    z_loss_weight=0.0,
  )
  return c
