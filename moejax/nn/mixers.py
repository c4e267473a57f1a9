"""The token mixers by name (`model.mixers`): each builds the attention half of a block from
the model config (the interface: `moejax.nn.mixer`).

| name | mixer | decode cache | source |
|---|---|---|---|
| `gqa` | `layers.Attention`: GQA, RoPE, optional QK-norm and biases | roped K/V per slot | Llama, OLMoE, Qwen3, Mixtral |
| `mla` | `mla.MLAttention` (`model.mla.*`) | the latent and the rope key | DeepSeek-V2/V3, Kimi-K2 |
| `gated_attention` | `gated_attention.GatedAttention`: [q, gate] per head, zero-centred q/k norms, partial RoPE (`model.partial_rotary_factor`), output × σ(gate) | roped K/V per slot | Qwen3.5/3.6, Qwen3-Next full-attention layers |
| `gated_deltanet` | `gated_deltanet.GatedDeltaNet` (`model.gated_deltanet.*`) | conv window and recurrent state | Qwen3.5/3.6, Qwen3-Next linear-attention layers |

`model.mixers` is one name, or a comma-separated period of names repeated over the layers
(Qwen3.5: `gated_deltanet,gated_deltanet,gated_deltanet,gated_attention`).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from moejax.errors import UserError
from moejax.nn.gated_attention import GatedAttention
from moejax.nn.gated_deltanet import GatedDeltaNet
from moejax.nn.layers import Attention
from moejax.nn.mla import MLAttention


def _gqa(cfg, out_std: float, rngs: nnx.Rngs) -> Attention:
  return Attention(
    cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, qk_norm=cfg.qk_norm,
    qk_norm_scope=cfg.qk_norm_scope, qkv_bias=cfg.qkv_bias, rope_theta=cfg.rope_theta,
    dtype=cfg.dtype, init_std=cfg.init_std, out_std=out_std, norm_eps=cfg.norm_eps,
    impl=cfg.attention, rngs=rngs,
  )  # fmt: skip


def _mla(cfg, out_std: float, rngs: nnx.Rngs) -> MLAttention:
  return MLAttention(cfg.d_model, cfg.n_heads, cfg.mla, rope_theta=cfg.rope_theta,
                     dtype=cfg.dtype, init_std=cfg.init_std, out_std=out_std, rngs=rngs)  # fmt: skip


def _gated_attention(cfg, out_std: float, rngs: nnx.Rngs) -> GatedAttention:
  return GatedAttention(
    cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim,
    partial_rotary_factor=cfg.partial_rotary_factor, rope_theta=cfg.rope_theta,
    norm_eps=cfg.norm_eps, dtype=cfg.dtype, init_std=cfg.init_std, out_std=out_std,
    impl=cfg.attention, rngs=rngs,
  )  # fmt: skip


def _gated_deltanet(cfg, out_std: float, rngs: nnx.Rngs) -> GatedDeltaNet:
  return GatedDeltaNet(cfg.d_model, cfg.gated_deltanet, norm_eps=cfg.norm_eps, dtype=cfg.dtype,
                       init_std=cfg.init_std, out_std=out_std, rngs=rngs)  # fmt: skip


MIXERS: dict[str, Callable] = {
  "gqa": _gqa,
  "mla": _mla,
  "gated_attention": _gated_attention,
  "gated_deltanet": _gated_deltanet,
}


def pattern(spec: str) -> tuple[str, ...]:
  """`model.mixers` as its period of names, each one `MIXERS` has (else a UserError)."""
  names = tuple(n.strip() for n in spec.split(","))
  for n in names:
    if n not in MIXERS:
      raise UserError(
        f"model.mixers={spec!r}: {n!r} is not a mixer; use names of {', '.join(MIXERS)}, "
        "comma-separated for a period repeated over the layers"
      )
  return names


def layer_mixer(spec: str, layer: int) -> str:
  """The mixer of layer `layer`: the pattern's entry, cyclically."""
  names = pattern(spec)
  return names[layer % len(names)]
