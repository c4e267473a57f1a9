"""Qwen3.5-35B-A3B / Qwen3.6-35B-A3B at full size: the twin of configs/qwen3_5_moe.py, for the
worksheet and the deviceless fit.

Shapes from transformers 5.24's `Qwen3_5MoeTextConfig()` defaults (documented there as the
Qwen/Qwen3.5-35B-A3B configuration): hidden_size 2048, 40 layers in the repeating pattern
three Gated DeltaNet layers (16 query/key heads of 128, 32 value heads of 128, conv kernel 4)
then one gated full-attention layer (16 query / 2 kv heads of head_dim 256, partial RoPE
0.25), zero-centred norms, 256 experts of moe_intermediate_size 512, top-8, one
sigmoid-gated shared expert of 512, vocab 248320, untied embeddings.

Not counted: the vision tower (`model.visual.*`) and the multi-token-prediction head
(`mtp.*`) of the published vision-language checkpoint (docs/gated-deltanet.md gives the
worksheet's count against the published 35B / 3B).
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "qwen3_5_moe.py"))
  c.model.update(
    vocab_size=248320,
    d_model=2048,
    n_layers=40,
    n_heads=16,
    n_kv_heads=2,
    head_dim=256,
    d_ff=0,  # every layer is MoE
    not_modelled="the vision tower (0.45B) and the MTP head of the published checkpoint",
    # Remat, which the train step needs to fit at this size: measured deviceless on h100:2x8,
    # 166.18 GiB per GPU without it, 46.98 GiB with it (docs/gated-deltanet.md).
    remat="full",
  )
  c.model.gated_deltanet.update(
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
  )  # fmt: skip
  c.model.moe.update(n_experts=256, top_k=8, d_expert=512, d_shared=512)
  return c
