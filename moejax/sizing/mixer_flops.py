"""Each token mixer's matmul weights per token and its sequence-mixing FLOPs per token
(`model.mixers`), the attention part of `flops.matmul_params` and
`flops.attention_flops_per_token`.

* `gqa`: q and o d·H·hd each, k and v d·G·hd each; scores and values 12·H·hd·L (PaLM: the
  full L×L, forward and backward).
* `gated_attention` (Qwen3.5): q_proj emits [q | gate], so q is 2·d·H·hd; k, v, o as GQA;
  the same 12·H·hd·L.
* `mla` (DeepSeek): `mla.matmul_params` (the LoRA and latent projections); scores of width
  dn + dr and values of width dv, 6·H·(dn + dr + dv)·L (`mla.score_flops_per_token`).
* `gated_deltanet`: in_proj_qkv/z/b/a and out_proj, d·(2Kd + 2Vd + 2Hv) + Vd·d; its
  sequence mixing is the depthwise conv, 2·W·(2Kd + Vd), and the delta rule at the
  recurrent count MaxText and Megatron use, 8·Hv·dk·dv, each × 3 for training (the chunked
  form as run does 1.25× the rule's count at dk = dv = 128: docs/gated-deltanet.md).
"""

from __future__ import annotations

from moejax.nn import mixers, mla


def matmul_params(cfg, name: str) -> int:
  """Forward matmul weights one token meets in one layer of mixer `name`."""
  d, H, G, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
  if name == "gqa":
    return 2 * d * H * hd + 2 * d * G * hd
  if name == "gated_attention":
    return 3 * d * H * hd + 2 * d * G * hd
  if name == "mla":
    return mla.matmul_params(d, H, cfg.mla)
  g = cfg.gated_deltanet
  return d * (2 * g.key_dim + 2 * g.value_dim + 2 * g.linear_num_value_heads) + g.value_dim * d


def mixing_flops(cfg, name: str, seq_len: int) -> int:
  """Training FLOPs per token of one layer's sequence mixing (not its projections)."""
  H, hd = cfg.n_heads, cfg.resolved_head_dim
  if name in ("gqa", "gated_attention"):
    return 12 * H * hd * seq_len
  if name == "mla":
    return mla.score_flops_per_token(H, cfg.mla, seq_len)
  g = cfg.gated_deltanet
  conv = 2 * g.linear_conv_kernel_dim * g.conv_dim
  rule = 8 * g.linear_num_value_heads * g.linear_key_head_dim * g.linear_value_head_dim
  return 3 * (conv + rule)


def per_layer(cfg) -> list[str]:
  """Each layer's mixer name."""
  return [mixers.layer_mixer(cfg.mixers, i) for i in range(cfg.n_layers)]
