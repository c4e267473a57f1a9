"""Multi-head latent attention (MLA: DeepSeek-V2, arXiv:2405.04434; V3; Kimi-K2), a mixer.

Parameters, named as transformers' `DeepseekV2Attention` / `DeepseekV3Attention` name them
(D = d_model, H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
C = kv_lora_rank, Rq = q_lora_rank; kernels are [in, out]):

* query: `q_proj` [D, H·(dn+dr)], or with q_lora_rank > 0 `q_a_proj` [D, Rq] →
  `q_a_layernorm` (RMSNorm, eps 1e-6) → `q_b_proj` [Rq, H·(dn+dr)]; each head is [nope | rope].
* keys and values: `kv_a_proj_with_mqa` [D, C+dr] gives the latent [C] and one rope key
  [dr] shared by every head; `kv_a_layernorm` (RMSNorm, eps 1e-6) on the latent;
  `kv_b_proj` [C, H·(dn+dv)] expands it to each head's [k_nope | v].
* `o_proj` [H·dv, D].

A head's score is (q_nope·k_nope + q_rope·k_rope) · (dn+dr)^-1/2 · m² (m: YaRN's mscale,
`yarn.softmax_factor`), the RoPE only on the rope slices (adjacent pairs, `yarn.rope_pairs`,
or halves without `rope_interleave`). Scores and softmax are float32; v is dv wide.

Two forms of the same attention:

* Expanded (training and scoring, `cache=None`): kv_b_proj on every token's latent gives
  per-head k_nope and v, then causal einsum attention.
* Absorbed (decode, with a cache): the cache holds the normalized latent [B, S, C] and the
  roped rope key [B, S, dr] (C + dr numbers a token and layer, not H·(dn+dr+dv)). The
  query's nope part is taken into latent space through kv_b_proj's key half
  (q̃ = q_nope·W_UKᵀ, [H, C]), scores are q̃·c + q_rope·k_rope, the probabilities weight the
  latents (õ = p·c, [H, C]), and kv_b_proj's value half maps õ to v space. No per-head K/V
  is ever formed for the cached slots.

Parameters and FLOPs per token (docs/mla.md): N (forward matmul weights one token is
multiplied by, per layer) = D·H·(dn+dr) [or D·Rq + Rq·H·(dn+dr)] + D·(C+dr) + C·H·(dn+dv)
+ H·dv·D; parameters add the norms' Rq + C. Training FLOPs per token and layer:
6·N + 6·H·(dn+dr+dv)·L (QKᵀ and PV over the full L×L, flops.py's convention).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.schema import check_fields, key
from moejax.errors import UserError
from moejax.nn import yarn
from moejax.nn.layers import RMSNorm, init_normal
from moejax.nn.mixer import DecodeAt, write_slots

ROPE_TYPES = ("default", "yarn")
LATENT_NORM_EPS = 1e-6  # the two a-norms' epsilon, as transformers hard-codes it


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """MLA's shapes and RoPE (`model.mla.*`); the head count is the model's n_heads."""

  q_lora_rank: int = key(
    0, "rank of the query's low-rank path q_a_proj -> q_a_layernorm -> q_b_proj (0: q_proj)", ge=0
  )
  kv_lora_rank: int = key(64, "width of the key/value latent (what decode caches)", ge=1)
  qk_nope_head_dim: int = key(32, "per-head query/key width without RoPE", ge=0)
  qk_rope_head_dim: int = key(
    16, "per-head query/key width with RoPE (one rope key shared by all heads); even", ge=2
  )
  v_head_dim: int = key(32, "per-head value width", ge=1)
  rope_interleave: bool = key(
    True, "RoPE on adjacent pairs (2i, 2i+1) as DeepSeek; False: on halves (i, i+dr/2)"
  )
  rope_type: str = key(
    "default", "RoPE frequencies: default, or yarn (the rope_* keys)", ROPE_TYPES
  )
  rope_factor: float = key(1.0, "yarn: context extension factor", gt=0)
  rope_original_max_position_embeddings: int = key(
    4096, "yarn: the context length the frequencies were trained at", ge=1
  )
  rope_beta_fast: float = key(32.0, "yarn: rotations where the ramp leaves extrapolation", gt=0)
  rope_beta_slow: float = key(1.0, "yarn: rotations where the ramp reaches interpolation", gt=0)
  rope_mscale: float = key(0.0, "yarn: mscale of cos/sin's multiplier (0: unset)", ge=0)
  rope_mscale_all_dim: float = key(
    0.0, "yarn: mscale_all_dim, the softmax scale's m and cos/sin's divisor (0: unset)", ge=0
  )

  def __post_init__(self):
    check_fields(self, "model.mla")
    if self.qk_rope_head_dim % 2:
      raise UserError(
        f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} is not allowed; RoPE needs an even"
        " width"
      )

  @property
  def qk_head_dim(self) -> int:
    """A query's (and key's) whole width dn + dr."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def rope_scaling(self) -> yarn.Yarn | None:
    """YaRN's parameters under rope_type yarn, else None (default RoPE)."""
    if self.rope_type != "yarn":
      return None
    return yarn.Yarn(
      self.rope_factor,
      self.rope_original_max_position_embeddings,
      self.rope_beta_fast,
      self.rope_beta_slow,
      self.rope_mscale,
      self.rope_mscale_all_dim,
    )

  @property
  def softmax_scale(self) -> float:
    """(dn + dr)^-1/2 · m²."""
    return self.qk_head_dim**-0.5 * yarn.softmax_factor(self.rope_scaling)


def matmul_params(d_model: int, n_heads: int, cfg: MLAConfig) -> int:
  """N of one MLA layer: the projection weights a token is multiplied by (no norms)."""
  D, H, C = d_model, n_heads, cfg.kv_lora_rank
  qk, dn, dr, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  q = D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk if cfg.q_lora_rank else D * H * qk
  return q + D * (C + dr) + C * H * (dn + dv) + H * dv * D


def param_count(d_model: int, n_heads: int, cfg: MLAConfig) -> int:
  """One MLA layer's parameters: N plus the two a-norms' scales (q_lora_rank + kv_lora_rank)."""
  return matmul_params(d_model, n_heads, cfg) + cfg.q_lora_rank + cfg.kv_lora_rank


def score_flops_per_token(n_heads: int, cfg: MLAConfig, seq_len: int) -> int:
  """Training FLOPs of QKᵀ (width dn+dr) and PV (width dv) per token and layer, full L×L:
  2·L·(dn+dr) + 2·L·dv per head, forward, × 3 (flops.py's convention)."""
  return 6 * n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len


def decode_flops_per_token(d_model: int, n_heads: int, cfg: MLAConfig, context: int) -> int:
  """Forward FLOPs of one decode step (absorbed form) over `context` cached slots, per layer:
  the projections but kv_b_proj, its two halves on the query and on õ (H·C·(dn+dv)), the
  scores H·(C+dr)·S and the weighted latents H·C·S, 2 FLOPs per multiply-add."""
  H, C, dr = n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
  projections = matmul_params(d_model, n_heads, cfg) - C * H * (dn + dv)
  return 2 * (projections + H * C * (dn + dv) + H * (2 * C + dr) * context)


def cache_per_token(cfg: MLAConfig) -> int:
  """Numbers cached per token and layer: the latent and the rope key, C + dr."""
  return cfg.kv_lora_rank + cfg.qk_rope_head_dim


class MLACache(NamedTuple):
  """One layer's decode state: what MLA caches instead of per-head keys and values."""

  latent_BxSxC: jax.Array  # kv_a_layernorm(latent)
  rope_key_BxSxR: jax.Array  # the shared rope key, RoPE applied


def causal_mask_1xLxL(L: int) -> jax.Array:
  """Query t reads keys s <= t (a batch axis of 1)."""
  return jnp.tril(jnp.ones((L, L), dtype=bool))[None]


def softmax_probs(s_BxHxLxS: jax.Array, mask_BxLxS: jax.Array, scale: float, dtype) -> jax.Array:
  """softmax(scale·s) over the allowed keys, float32, cast to `dtype`."""
  s_BxHxLxS = jnp.where(mask_BxLxS[:, None], s_BxHxLxS * scale, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(s_BxHxLxS, axis=-1).astype(dtype)


def expand_latent(latent_BxSxC: jax.Array, w_kv_b_CxHxNV: jax.Array, dn: int):
  """kv_b_proj on the latent: per-head k_nope [B, S, H, dn] and v [B, S, H, dv]."""
  kv_BxSxHxNV = jnp.einsum("bsc,chk->bshk", latent_BxSxC, w_kv_b_CxHxNV)
  return kv_BxSxHxNV[..., :dn], kv_BxSxHxNV[..., dn:]


def attend_expanded(
  q_nope_BxLxHxN: jax.Array,
  q_rope_BxLxHxR: jax.Array,
  k_nope_BxSxHxN: jax.Array,
  k_rope_BxSxR: jax.Array,
  v_BxSxHxV: jax.Array,
  mask_BxLxS: jax.Array,
  scale: float,
) -> jax.Array:
  """Attention with per-head k_nope and v and the shared rope key: o [B, L, H, dv]."""
  f32 = jnp.float32
  s_BxHxLxS = jnp.einsum(
    "blhn,bshn->bhls", q_nope_BxLxHxN, k_nope_BxSxHxN, preferred_element_type=f32
  ) + jnp.einsum("blhr,bsr->bhls", q_rope_BxLxHxR, k_rope_BxSxR, preferred_element_type=f32)
  p_BxHxLxS = softmax_probs(s_BxHxLxS, mask_BxLxS, scale, v_BxSxHxV.dtype)
  return jnp.einsum("bhls,bshv->blhv", p_BxHxLxS, v_BxSxHxV)


def attend_absorbed(
  q_nope_BxLxHxN: jax.Array,
  q_rope_BxLxHxR: jax.Array,
  latent_BxSxC: jax.Array,
  k_rope_BxSxR: jax.Array,
  w_kv_b_CxHxNV: jax.Array,
  mask_BxLxS: jax.Array,
  scale: float,
) -> jax.Array:
  """The same attention read from the latents: kv_b_proj's key half absorbed into the query
  and its value half applied after the weighted sum (module docstring). o [B, L, H, dv]."""
  f32 = jnp.float32
  dn = q_nope_BxLxHxN.shape[-1]
  w_uk_CxHxN, w_uv_CxHxV = w_kv_b_CxHxNV[..., :dn], w_kv_b_CxHxNV[..., dn:]
  q_lat_BxLxHxC = jnp.einsum("blhn,chn->blhc", q_nope_BxLxHxN, w_uk_CxHxN)
  s_BxHxLxS = jnp.einsum(
    "blhc,bsc->bhls", q_lat_BxLxHxC, latent_BxSxC, preferred_element_type=f32
  ) + jnp.einsum("blhr,bsr->bhls", q_rope_BxLxHxR, k_rope_BxSxR, preferred_element_type=f32)
  p_BxHxLxS = softmax_probs(s_BxHxLxS, mask_BxLxS, scale, latent_BxSxC.dtype)
  o_lat_BxLxHxC = jnp.einsum("bhls,bsc->blhc", p_BxHxLxS, latent_BxSxC)
  return jnp.einsum("blhc,chv->blhv", o_lat_BxLxHxC, w_uv_CxHxV)


class MLAttention(nnx.Module):
  """MLA as a mixer (`moejax.nn.mixer`): float32 parameters named as transformers', cast to
  the compute dtype at use; `cache=None` is the expanded causal form, a cache the absorbed."""

  def __init__(
    self,
    d_model: int,
    n_heads: int,
    cfg: MLAConfig,
    *,
    rope_theta: float = 10000.0,
    dtype: str = "float32",
    init_std: float = 0.02,
    out_std: float | None = None,
    rngs: nnx.Rngs,
  ):
    self.cfg, self.n_heads, self.rope_theta, self.dtype = cfg, n_heads, rope_theta, dtype
    H, C, R = n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim

    def proj(n_in: int, n_out: int, std: float = init_std) -> nnx.Linear:
      return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=jnp.dtype(dtype),
        param_dtype=jnp.float32,
        kernel_init=init_normal(std),
        rngs=rngs,
      )

    q_out = H * cfg.qk_head_dim
    if cfg.q_lora_rank:
      self.q_proj = None
      self.q_a_proj = proj(d_model, cfg.q_lora_rank)
      self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS, rngs=rngs)
      self.q_b_proj = proj(cfg.q_lora_rank, q_out)
    else:
      self.q_proj = proj(d_model, q_out)
      self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
    self.kv_a_proj_with_mqa = proj(d_model, C + R)
    self.kv_a_layernorm = RMSNorm(C, eps=LATENT_NORM_EPS, rngs=rngs)
    self.kv_b_proj = proj(C, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    self.o_proj = proj(H * cfg.v_head_dim, d_model, init_std if out_std is None else out_std)

  def _rope(self, x_BxLxHxR: jax.Array, positions_BxL: jax.Array) -> jax.Array:
    y = self.cfg.rope_scaling
    freq_F = yarn.inv_freq(self.cfg.qk_rope_head_dim, self.rope_theta, y)
    cos, sin = yarn.cos_sin(positions_BxL, freq_F, yarn.cos_sin_scale(y))
    rotate = yarn.rope_pairs if self.cfg.rope_interleave else yarn.rope_halves
    return rotate(x_BxLxHxR, cos, sin)

  def queries(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
    """q_nope [B, L, H, dn] and the roped q_rope [B, L, H, dr]."""
    B, L, _ = x_BxLxD.shape
    if self.q_proj is not None:
      q_BxLxHQ = self.q_proj(x_BxLxD)
    else:
      q_BxLxHQ = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BxLxD)))
    q_BxLxHxQ = q_BxLxHQ.reshape(B, L, self.n_heads, self.cfg.qk_head_dim)
    dn = self.cfg.qk_nope_head_dim
    return q_BxLxHxQ[..., :dn], self._rope(q_BxLxHxQ[..., dn:], positions_BxL)

  def latents(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
    """The normalized latent [B, L, C] and the roped shared rope key [B, L, dr]."""
    C = self.cfg.kv_lora_rank
    ckv_BxLxCR = self.kv_a_proj_with_mqa(x_BxLxD)
    latent_BxLxC = self.kv_a_layernorm(ckv_BxLxCR[..., :C])
    rope_key_BxLxR = self._rope(ckv_BxLxCR[..., None, C:], positions_BxL)[:, :, 0]
    return latent_BxLxC, rope_key_BxLxR

  def kv_b_kernel(self) -> jax.Array:
    """kv_b_proj's kernel as [C, H, dn+dv], in the compute dtype."""
    w = self.kv_b_proj.kernel[...].astype(jnp.dtype(self.dtype))
    return w.reshape(self.cfg.kv_lora_rank, self.n_heads, -1)

  def __call__(
    self,
    x_BxLxD: jax.Array,
    positions_BxL: jax.Array,
    *,
    cache: MLACache | None = None,
    at: DecodeAt | None = None,
  ) -> tuple[jax.Array, MLACache | None]:
    if (cache is None) != (at is None):
      raise ValueError("MLAttention: a decode call takes both cache and at")
    B, L, _ = x_BxLxD.shape
    x_BxLxD = x_BxLxD.astype(jnp.dtype(self.dtype))
    q_nope, q_rope = self.queries(x_BxLxD, positions_BxL)
    latent_BxLxC, rope_key_BxLxR = self.latents(x_BxLxD, positions_BxL)
    scale, w_kv_b = self.cfg.softmax_scale, self.kv_b_kernel()
    if cache is None:
      k_nope, v = expand_latent(latent_BxLxC, w_kv_b, self.cfg.qk_nope_head_dim)
      o_BxLxHxV = attend_expanded(
        q_nope, q_rope, k_nope, rope_key_BxLxR, v, causal_mask_1xLxL(L), scale
      )
    else:
      cache = MLACache(
        write_slots(cache.latent_BxSxC, latent_BxLxC, at.index),
        write_slots(cache.rope_key_BxSxR, rope_key_BxLxR, at.index),
      )
      cdt, S = latent_BxLxC.dtype, cache.latent_BxSxC.shape[1]
      latent_BxSxC, rope_key_BxSxR = (c.astype(cdt) for c in cache)
      o_BxLxHxV = attend_absorbed(
        q_nope, q_rope, latent_BxSxC, rope_key_BxSxR, w_kv_b, at.mask_BxLxS(L, S), scale
      )
    return self.o_proj(o_BxLxHxV.reshape(B, L, -1)), cache

  def init_cache(self, batch: int, max_len: int, dtype) -> MLACache:
    """An empty cache of `max_len` slots: the latent and the rope key, in `dtype`."""
    return MLACache(
      jnp.zeros((batch, max_len, self.cfg.kv_lora_rank), dtype),
      jnp.zeros((batch, max_len, self.cfg.qk_rope_head_dim), dtype),
    )
