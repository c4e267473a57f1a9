"""GShard (Lepikhin et al., 2020) family preset, scaled down.

Copied from the public description (paper; lingvo/fairscale Top2Gate):
  * top-2 routing, softmax over all experts, g1 and g2 renormalized to sum 1 (`gshard` rule).
  * Random routing: the second expert is dispatched with probability min(1, g2 / 0.5).
  * Capacity dispatch with local group dispatching: tokens are split into groups of S tokens
    and each expert takes C = 2S/E tokens per group, i.e. capacity_factor 1.0 in our
    C = cf * K * S / E; here one group per sequence (group_size = seq_len).
  * MoE replaces every other FFN layer (odd layers here).
  * Auxiliary load-balancing loss as lingvo's `top2_gating`: f counts top-1 choices only
    (`balance_choices="top1"`, density_1 before capacity), per routing group, averaged over
    groups: one group per sequence here, so `balance_granularity="sequence"`. Its weight
    here is ~0.01 (a common choice, not a value verified from the paper). No z-loss.
  * The random second expert also applies at eval (lingvo has no train/eval switch), with a
    fixed eval seed (`eval_second_expert="same"`). No shared expert.
Scaled down: 2048 experts (600B MT model) -> 8; encoder-decoder -> 4-layer decoder-only LM,
d_model 64, d_expert 128. eval_capacity_factor 2.0 is this framework's default, not GShard's.
"""

import ml_collections

from moejax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.preset_base()
  c.model.update(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=128, moe_every=2, first_dense=1
  )  # MoE on layers 1 and 3
  c.model.moe.update(
    rule="gshard",
    n_experts=8,
    top_k=2,
    d_expert=128,
    d_shared=0,
    dispatch="capacity",
    capacity_factor=1.0,
    eval_capacity_factor=2.0,
    drop_policy="position",
    second_expert="random",
    group_size=128,
  )
  c.loss.update(
    balance_weight=0.01,
    balance_granularity="sequence",
    balance_choices="top1",
    balance_convention="fraction",
    z_loss_weight=0.0,
  )
  return c
