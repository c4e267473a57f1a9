"""Decoder-only Transformer (docs/design.md §5): pre-norm blocks, dense or MoE feed-forward.

Layer i is MoE iff `is_moe_layer(cfg, i)`; MoE placement follows `moe_every` (GShard) and
`first_dense` (DeepSeek).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.errors import UserError, check_choice
from moejax.nn import elastic, remat
from moejax.nn.attention import ATTENTION_IMPLS
from moejax.nn.layers import DTYPES, QK_NORM_SCOPES, Attention, DenseFFN, RMSNorm, init_normal
from moejax.nn.moe import EVAL_SECOND_EXPERT_SEED, MoEBlock, MoEConfig, RouterOut


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and options of the Transformer; `head_dim=0` means d_model // n_heads.

  `dtype` is the compute dtype of attention, FFNs, experts and the residual stream;
  parameters, optimizer state, norms' statistics, router, softmax and losses stay float32.
  `remat` names a block rematerialization policy (`moejax.nn.remat.REMAT_POLICIES`),
  `attention` an attention implementation (`moejax.nn.attention.ATTENTION_IMPLS`)."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int = 0
  d_ff: int = 0
  qk_norm: bool = False
  qk_norm_scope: str = "head"
  qkv_bias: bool = False
  tie_embeddings: bool = True
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  dtype: str = "float32"
  init_std: float = 0.02
  moe: MoEConfig | None = None
  moe_every: int = 1
  first_dense: int = 0
  remat: str = "none"
  attention: str = "xla"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads"):
      if getattr(self, name) < 1:
        raise UserError(f"model.{name}={getattr(self, name)} is not allowed; use an int >= 1")
    if self.head_dim < 0:
      raise UserError(f"model.head_dim={self.head_dim} is not allowed; use 0 (auto) or > 0")
    if self.head_dim == 0 and self.d_model % self.n_heads:
      raise UserError(
        f"model.n_heads={self.n_heads} must divide model.d_model="
        f"{self.d_model} (or set model.head_dim)"
      )
    if self.n_heads % self.n_kv_heads:
      raise UserError(
        f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
      )
    if self.resolved_head_dim % 2:
      raise UserError(
        f"model.head_dim={self.resolved_head_dim} is not allowed; RoPE needs an even head_dim"
      )
    check_choice("model.dtype", self.dtype, DTYPES)
    check_choice("model.remat", self.remat, tuple(remat.REMAT_POLICIES))
    check_choice("model.attention", self.attention, tuple(ATTENTION_IMPLS))
    if self.qk_norm_scope not in QK_NORM_SCOPES:
      raise UserError(
        f"model.qk_norm_scope={self.qk_norm_scope!r} is not allowed; "
        f"use one of {', '.join(QK_NORM_SCOPES)}"
      )
    if self.moe_every < 0:
      raise UserError(f"model.moe_every={self.moe_every} is not allowed; use an int >= 0")
    if not 0 <= self.first_dense <= self.n_layers:
      raise UserError(
        f"model.first_dense={self.first_dense} is not allowed; use 0 <= "
        f"first_dense <= n_layers={self.n_layers}"
      )
    if not (self.rope_theta > 0 and self.norm_eps > 0 and self.init_std > 0):
      raise UserError("model.rope_theta, model.norm_eps and model.init_std must be > 0")
    if self.moe is not None and self.moe.d_model != self.d_model:
      raise UserError(
        f"model.moe.d_model={self.moe.d_model} must equal model.d_model={self.d_model}"
      )
    if self.d_ff < 1 and not all(is_moe_layer(self, i) for i in range(self.n_layers)):
      raise UserError(f"model.d_ff={self.d_ff} is not allowed; dense layers need d_ff >= 1")

  @property
  def resolved_head_dim(self) -> int:
    """head_dim, or d_model // n_heads when head_dim is 0."""
    return self.head_dim or self.d_model // self.n_heads


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
  """Whether layer i uses the MoE block (every `moe_every`-th layer from `first_dense` on)."""
  return (
    cfg.moe is not None
    and cfg.moe_every > 0
    and i >= cfg.first_dense
    and (i - cfg.first_dense) % cfg.moe_every == 0
  )


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); mlp dense or MoE."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.layer = layer
    self.is_moe = is_moe_layer(cfg, layer)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    self.attn = Attention(
      cfg.d_model,
      cfg.n_heads,
      cfg.n_kv_heads,
      cfg.resolved_head_dim,
      qk_norm=cfg.qk_norm,
      qk_norm_scope=cfg.qk_norm_scope,
      qkv_bias=cfg.qkv_bias,
      rope_theta=cfg.rope_theta,
      dtype=cfg.dtype,
      init_std=cfg.init_std,
      out_std=out_std,
      norm_eps=cfg.norm_eps,
      impl=cfg.attention,
      rngs=rngs,
    )
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    if self.is_moe:
      moe_cfg = dataclasses.replace(cfg.moe, dtype=cfg.dtype)  # the model's dtype wins
      self.mlp = MoEBlock(moe_cfg, rngs=rngs)
    else:
      self.mlp = DenseFFN(
        cfg.d_model, cfg.d_ff, dtype=cfg.dtype, init_std=cfg.init_std, out_std=out_std, rngs=rngs
      )

  def __call__(
    self,
    x_BxLxD: jax.Array,
    positions_BxL: jax.Array,
    *,
    k: int | None = None,
    k2: int | None = None,
    train: bool = False,
    rng: jax.Array | None = None,
    routed_scale: jax.Array | None = None,
    train_k: jax.Array | None = None,
  ) -> tuple[jax.Array, RouterOut | None]:
    x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL)
    h_BxLxD = self.mlp_norm(x_BxLxD)
    if not self.is_moe:
      return x_BxLxD + self.mlp(h_BxLxD), None
    y_BxLxD, router_out = self.mlp(
      h_BxLxD, k=k, k2=k2, train=train, rng=rng, routed_scale=routed_scale, train_k=train_k
    )
    return x_BxLxD + y_BxLxD.astype(x_BxLxD.dtype), router_out


class Transformer(nnx.Module):
  """Decoder-only LM: embed → blocks → final RMSNorm → float32 logits (tied/untied head).

  The head multiplies in the compute dtype and accumulates and returns float32 logits
  (MaxText's default `logits_dot_in_fp32: False` with `cast_logits_to_fp32: True`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.float32,
      embedding_init=init_normal(cfg.init_std),
      rngs=rngs,
    )
    self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    if cfg.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Linear(
        cfg.d_model,
        cfg.vocab_size,
        use_bias=False,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        preferred_element_type=jnp.float32,
        kernel_init=init_normal(cfg.init_std),
        rngs=rngs,
      )

  def __call__(
    self,
    tokens_BxL: jax.Array,
    *,
    k: int | None = None,
    k2: int | None = None,
    train: bool = False,
    rng: jax.Array | None = None,
    routed_scale_M: jax.Array | None = None,
    step: jax.Array | None = None,
  ) -> tuple[jax.Array, dict[int, RouterOut]]:
    """Float32 logits [B, L, V] and the `RouterOut` of each MoE layer, by layer index.

    At eval without `rng`, routing randomness (GShard's random second expert) uses a fixed
    seed, so evaluations are reproducible. `routed_scale_M` (optional, eval): one multiplier
    of the routed output per MoE layer, in layer order; a traced array, so one compiled
    forward serves every value. `step` (training): the optimizer step, for elastic-k's
    `schedule`; elastic-k draws come from `rng` (`moejax.nn.elastic`)."""
    B, L = tokens_BxL.shape
    positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    x_BxLxD = self.embed(tokens_BxL)
    if rng is None and not train:
      rng = jax.random.key(EVAL_SECOND_EXPERT_SEED)
    routers = {}
    call = remat.block_call(self.cfg.remat, k=k, k2=k2, train=train)
    k_MxBxL = self._train_k(train, rng, step, B, L)
    for i, block in enumerate(self.layers):
      layer_rng = None if rng is None else jax.random.fold_in(rng, i)
      scale = train_k = None
      if routed_scale_M is not None and block.is_moe:
        scale = routed_scale_M[len(routers)]
      if k_MxBxL is not None and block.is_moe:
        train_k = k_MxBxL[len(routers)]
      x_BxLxD, out = call(block, x_BxLxD, positions_BxL, layer_rng, scale, train_k)
      if out is not None:
        routers[i] = out
    cdt = jnp.dtype(self.cfg.dtype)
    h_BxLxD = self.final_norm(x_BxLxD).astype(cdt)
    if self.lm_head is None:
      emb_VxD = self.embed.embedding[...].astype(cdt)
      logits_BxLxV = jnp.einsum("bld,vd->blv", h_BxLxD, emb_VxD, preferred_element_type=jnp.float32)
    else:
      logits_BxLxV = self.lm_head(h_BxLxD)
    return logits_BxLxV, routers

  def _train_k(self, train: bool, rng, step, B: int, L: int) -> jax.Array | None:
    """Elastic-k: experts used per MoE layer and token in this training forward."""
    moe = self.cfg.moe
    if not (train and moe is not None and moe.elastic.active):
      return None
    n_moe = sum(is_moe_layer(self.cfg, i) for i in range(self.cfg.n_layers))
    k_MxT = elastic.draw(moe.elastic, moe.top_k, rng, step, n_moe, B * L)
    return k_MxT.reshape(n_moe, B, L)
