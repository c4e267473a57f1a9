"""MLA (moejax.nn.mla) and its RoPE (moejax.nn.yarn) against transformers 5.24's own code.

* YaRN's inverse frequencies, cos/sin multiplier and softmax-scale factor against
  `ROPE_INIT_FUNCTIONS['yarn']` and `DeepseekV2Attention.scaling`, for DeepSeek's mscale
  settings and the unset ones.
* The adjacent-pair rotation against V2's `apply_rotary_emb` (complex) and V3's
  `apply_rotary_pos_emb_interleave` (which writes the rotated pairs as [evens | odds]).
* The mixer against `DeepseekV2Attention` (plain q, q LoRA) and `DeepseekV3Attention`
  (q LoRA; pairs and halves) in float32 with random weights and random norm weights.
* The decode cache (latent and rope key, absorbed form) against the no-cache forward of each
  row's unpadded sequence, on a left-padded batch; bfloat16 compute near float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import FULL
import torch  # the test extra pins torch and transformers: this file always runs
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from moejax.errors import UserError
from moejax.nn import yarn
from moejax.nn.mixer import DecodeAt, start_at
from moejax.nn.mla import (
  MLAConfig,
  MLAttention,
  cache_per_token,
  decode_flops_per_token,
  matmul_params,
  param_count,
  score_flops_per_token,
)

D, H, B, L = 32, 4, 2, 7
SHAPES = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6)
# (mscale, mscale_all_dim): V2-Lite's, V3's, and the two unset cases (0: not in the config)
MSCALES = [(0.707, 0.707), (1.0, 1.0), (1.0, 0.0), (0.0, 0.707), (1.0, 0.5)]
V2_LITE_YARN = dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707)


def rope_parameters(mscale: float, mscale_all_dim: float, theta: float = 10000.0) -> dict:
  """A DeepSeek config's `rope_parameters` for YaRN at factor 40 (unset mscales left out)."""
  p = dict(rope_type="yarn", rope_theta=theta, factor=40.0, original_max_position_embeddings=4096)
  p.update(beta_fast=32, beta_slow=1)
  p.update({k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)) if v})
  return p


def yarn_of(p: dict) -> yarn.Yarn:
  return yarn.Yarn(
    p["factor"],
    p["original_max_position_embeddings"],
    p["beta_fast"],
    p["beta_slow"],
    p.get("mscale", 0.0),
    p.get("mscale_all_dim", 0.0),
  )


def mla_config(rope: dict | None, q_lora_rank: int = 0, interleave: bool = True) -> MLAConfig:
  """moejax's MLAConfig for the transformers config built from the same numbers."""
  extra = {}
  if rope is not None:
    y = yarn_of(rope)
    extra = dict(
      rope_type="yarn",
      rope_factor=y.factor,
      rope_original_max_position_embeddings=y.original_max_position_embeddings,
      rope_beta_fast=y.beta_fast,
      rope_beta_slow=y.beta_slow,
      rope_mscale=y.mscale,
      rope_mscale_all_dim=y.mscale_all_dim,
    )
  return MLAConfig(q_lora_rank=q_lora_rank, rope_interleave=interleave, **SHAPES, **extra)


def hf_config(family: str, rope: dict | None, q_lora_rank: int = 0, interleave: bool = True):
  cls = transformers.DeepseekV2Config if family == "v2" else transformers.DeepseekV3Config
  kw = dict(rope_interleave=interleave) if family == "v3" else {}
  cfg = cls(
    hidden_size=D,
    num_attention_heads=H,
    num_key_value_heads=H,
    q_lora_rank=q_lora_rank or None,
    max_position_embeddings=163840,
    rope_parameters=rope or dict(rope_type="default", rope_theta=10000.0),
    **SHAPES,
    **kw,
  )
  cfg._attn_implementation = "eager"
  return cfg


@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("mscale,mscale_all_dim", MSCALES)
def test_yarn_matches_transformers_rope_init(dim, mscale, mscale_all_dim):
  rope = rope_parameters(mscale, mscale_all_dim)
  cfg = transformers.DeepseekV2Config(
    hidden_size=D, num_attention_heads=H, qk_rope_head_dim=dim, rope_parameters=rope
  )
  inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
  y = yarn_of(rope)
  np.testing.assert_allclose(yarn.yarn_inv_freq(dim, 10000.0, y), inv_freq.numpy(), rtol=1e-6)
  assert yarn.cos_sin_scale(y) == pytest.approx(attention_factor, rel=1e-12)
  # the attention's softmax scale, (dn + dr)^-1/2 · m², as DeepseekV2Attention sets it
  attn = hf_v2.DeepseekV2Attention(cfg, 0)
  ours = (cfg.qk_nope_head_dim + dim) ** -0.5 * yarn.softmax_factor(y)
  assert ours == pytest.approx(attn.scaling, rel=1e-12)


def test_yarn_softmax_factor_published_values():
  """The issue's numbers, from the formula m = 0.1·mscale_all_dim·ln 40 + 1 written here."""
  for all_dim, expected in ((0.707, 1.5896), (1.0, 1.8739)):
    m = 0.1 * all_dim * math.log(40) + 1
    y = yarn.Yarn(**V2_LITE_YARN, mscale_all_dim=all_dim)
    assert yarn.softmax_factor(y) == pytest.approx(m * m, rel=1e-12)
    assert yarn.softmax_factor(y) == pytest.approx(expected, abs=5e-5)
  assert yarn.softmax_factor(None) == 1.0 and yarn.cos_sin_scale(None) == 1.0


def test_default_inv_freq_matches_transformers():
  cfg = hf_config("v3", None)
  inv_freq, scale = hf_v3.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(cfg)
  np.testing.assert_allclose(yarn.default_inv_freq(8, 10000.0), inv_freq.numpy(), rtol=1e-6)
  assert scale == 1.0


@pytest.fixture(scope="module")
def rope_inputs():
  """q [B, L, H, dr], k [B, L, 1, dr], positions with a per-row offset, YaRN (V2-Lite)."""
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(B, L, H, 8)), rng.normal(size=(B, L, 1, 8))
  positions = np.arange(L)[None] + np.array([[0], [3000]])
  return q.astype(np.float32), k.astype(np.float32), positions


def ours_rope(x, positions, cfg, rotate):
  freq = yarn.inv_freq(8, 10000.0, cfg.rope_scaling)
  cos, sin = yarn.cos_sin(jnp.asarray(positions), freq, yarn.cos_sin_scale(cfg.rope_scaling))
  return np.asarray(rotate(jnp.asarray(x), cos, sin))


def test_rope_pairs_match_v2_complex_rotation(rope_inputs):
  q, k, positions = rope_inputs
  rope = rope_parameters(1.0, 0.0)  # cos/sin × 1.3689: the multiplier shows
  hf = hf_config("v2", rope)
  freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(hf)(torch.tensor(q), torch.tensor(positions))
  tq, tk = (torch.tensor(a).transpose(1, 2) for a in (q, k))  # HF's [B, heads, L, dr]
  hq, hk = (a.transpose(1, 2).numpy() for a in hf_v2.apply_rotary_emb(tq, tk, freqs_cis))
  cfg = mla_config(rope)
  np.testing.assert_allclose(ours_rope(q, positions, cfg, yarn.rope_pairs), hq, atol=2e-6)
  np.testing.assert_allclose(ours_rope(k, positions, cfg, yarn.rope_pairs), hk, atol=2e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_matches_v3_rotation(rope_inputs, interleave):
  """V3 writes the interleaved rotation's pairs as [evens | odds]: ours, so permuted, is it."""
  q, k, positions = rope_inputs
  rope = rope_parameters(1.0, 0.0)
  hf = hf_config("v3", rope, interleave=interleave)
  cos, sin = hf_v3.DeepseekV3RotaryEmbedding(hf)(torch.tensor(q), torch.tensor(positions))
  apply = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
  tq, tk = (torch.tensor(a).transpose(1, 2) for a in (q, k))
  hq, hk = (a.transpose(1, 2).numpy() for a in apply(tq, tk, cos, sin))
  cfg = mla_config(rope, interleave=interleave)
  rotate = yarn.rope_pairs if interleave else yarn.rope_halves
  order = np.r_[0:8:2, 1:8:2] if interleave else np.arange(8)
  np.testing.assert_allclose(ours_rope(q, positions, cfg, rotate)[..., order], hq, atol=2e-6)
  np.testing.assert_allclose(ours_rope(k, positions, cfg, rotate)[..., order], hk, atol=2e-6)


def randomize_norms(module: torch.nn.Module, seed: int) -> None:
  """Every RMSNorm weight drawn from U(0.5, 1.5): a 1-initialized norm hides bugs."""
  g = torch.Generator().manual_seed(seed)
  for name, p in module.named_parameters():
    if "layernorm" in name:
      with torch.no_grad():
        p.copy_(0.5 + torch.rand(p.shape, generator=g))


def copy_from_hf(ours: MLAttention, hf: torch.nn.Module) -> None:
  """transformers' weights into the moejax module: Linear [out, in] -> kernel [in, out]."""
  for name, p in hf.named_parameters():
    mod_name, kind = name.rsplit(".", 1)
    target = getattr(ours, mod_name)
    value = jnp.asarray(p.detach().numpy())
    if kind == "weight" and "layernorm" in mod_name:
      target.scale[...] = value
    else:
      target.kernel[...] = value.T


CASES = {
  # family, q_lora_rank, rope_interleave, (mscale, mscale_all_dim) or None (default RoPE)
  "v2_plain_q_yarn_v2lite": ("v2", 0, True, (0.707, 0.707)),
  "v2_q_lora_default_rope": ("v2", 12, True, None),
  "v3_q_lora_yarn_v3": ("v3", 12, True, (1.0, 1.0)),
  "v3_q_lora_halves_yarn_unset_all_dim": ("v3", 12, False, (1.0, 0.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mla_matches_transformers_attention(case):
  family, q_rank, interleave, mscales = CASES[case]
  rope = None if mscales is None else rope_parameters(*mscales)
  hf_cfg = hf_config(family, rope, q_rank, interleave)
  torch.manual_seed(0)
  prefix = "DeepseekV2" if family == "v2" else "DeepseekV3"
  module = hf_v2 if family == "v2" else hf_v3
  attn_cls, rotary_cls = (getattr(module, prefix + n) for n in ("Attention", "RotaryEmbedding"))
  hf_attn = attn_cls(hf_cfg, 0).eval()
  randomize_norms(hf_attn, 1)
  x = torch.randn(B, L, D)
  positions = torch.arange(L)[None] + torch.tensor([[0], [5]])  # row 1 starts at position 5
  mask = torch.full((L, L), float("-inf")).triu(1)[None, None].expand(B, 1, L, L)
  with torch.no_grad():
    pe = rotary_cls(hf_cfg)(x, positions)
    kw = dict(position_embeddings=pe, attention_mask=mask)
    expected = hf_attn(x, **kw)[0].numpy()
  ours = MLAttention(D, H, mla_config(rope, q_rank, interleave), rngs=nnx.Rngs(0))
  copy_from_hf(ours, hf_attn)
  y, cache = jitted(ours)(x.numpy(), jnp.asarray(positions.numpy()))
  assert cache is None and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5, rtol=0)
  assert np.abs(expected).max() > 0.1  # the comparison is not between near-zero outputs


# ---- decode ----------------------------------------------------------------------------------

P, T = 5, 3  # the prompt's padded length and the steps decoded after it
START_B = np.array([0, 2, 4])  # rows' left padding: prompts of 5, 3 and 1 real tokens


def random_mixer(cfg: MLAConfig, dtype: str = "float32") -> MLAttention:
  """An MLAttention with std-0.3 weights (non-trivial attention) and random norm scales."""
  m = MLAttention(D, H, cfg, dtype=dtype, init_std=0.3, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(4)
  for norm in (m.q_a_layernorm, m.kv_a_layernorm):
    if norm is not None:
      norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  return m


@functools.partial(jax.jit, static_argnums=0)
def _call(graphdef, state, x, positions, cache, at):
  return nnx.merge(graphdef, state)(x, positions, cache=cache, at=at)


def jitted(m: MLAttention):
  """The mixer's call compiled once per graph and shapes (eager op-by-op dispatch is slower)."""
  graphdef, state = nnx.split(m)
  return lambda x, positions, cache=None, at=None: _call(
    graphdef, state, jnp.asarray(x), positions, cache, at
  )


def decode(m: MLAttention, x_BxNxD: np.ndarray, dtype=jnp.float32) -> np.ndarray:
  """Prefill slots 0..P-1 (left-padded rows), then T single-token steps; outputs [B, P+T, D]."""
  call = jitted(m)
  cache = m.init_cache(len(START_B), P + T, dtype)
  at = start_at(jnp.asarray(START_B))
  y, cache = call(x_BxNxD[:, :P], at.positions_BxL(P), cache, at)
  outs = [y]
  for t in range(P, P + T):
    at = DecodeAt(jnp.asarray(t, jnp.int32), jnp.asarray(START_B, jnp.int32))
    y, cache = call(x_BxNxD[:, t : t + 1], at.positions_BxL(1), cache, at)
    outs.append(y)
  assert cache.latent_BxSxC.shape == (len(START_B), P + T, SHAPES["kv_lora_rank"])
  assert cache.rope_key_BxSxR.shape == (len(START_B), P + T, SHAPES["qk_rope_head_dim"])
  return np.asarray(jnp.concatenate(outs, axis=1).astype(jnp.float32))


def per_row_reference(m: MLAttention, x_BxNxD: np.ndarray) -> list[np.ndarray]:
  """The no-cache forward of each row's real tokens alone (positions 0, 1, ...)."""
  outs, call = [], jitted(m)
  for b, start in enumerate(START_B):
    real = x_BxNxD[b : b + 1, start:]
    y, _ = call(real, jnp.arange(real.shape[1])[None])
    outs.append(np.asarray(y[0].astype(jnp.float32)))
  return outs


@pytest.mark.parametrize("q_lora_rank", [pytest.param(0, marks=FULL), 12])
def test_cached_decode_equals_full_forward(q_lora_rank):
  cfg = mla_config(rope_parameters(0.707, 0.707), q_lora_rank)
  m = random_mixer(cfg)
  x = np.random.default_rng(5).normal(size=(len(START_B), P + T, D)).astype(np.float32)
  got, want = decode(m, x), per_row_reference(m, x)
  for b, start in enumerate(START_B):
    np.testing.assert_allclose(got[b, start:], want[b], atol=2e-5, rtol=1e-5)
  # the padding slots' inputs are read by no real query: new garbage there changes nothing
  x2 = x.copy()
  x2[1, :2] = 100.0
  np.testing.assert_array_equal(decode(m, x2)[1, 2:], got[1, 2:])


@FULL  # 11 s; the float32 checks stay in the default tier
def test_bfloat16_forward_and_decode_near_float32():
  cfg = mla_config(rope_parameters(1.0, 1.0), q_lora_rank=12)
  m32, m16 = random_mixer(cfg), random_mixer(cfg, "bfloat16")
  x = np.random.default_rng(6).normal(size=(len(START_B), P + T, D)).astype(np.float32)
  pos = jnp.broadcast_to(jnp.arange(P + T), (len(START_B), P + T))
  y32, _ = jitted(m32)(x, pos)
  y16, _ = jitted(m16)(x, pos)
  assert y16.dtype == jnp.bfloat16 and y16.shape == y32.shape
  scale = float(jnp.abs(y32).max())
  np.testing.assert_allclose(np.asarray(y16.astype(jnp.float32)), y32, atol=0.03 * scale)
  got, want = decode(m16, x, jnp.bfloat16), per_row_reference(m32, x)
  for b, start in enumerate(START_B):
    np.testing.assert_allclose(got[b, start:], want[b], atol=0.03 * scale)


def test_mla_config_refuses_bad_values():
  with pytest.raises(UserError, match=r"model\.mla\.qk_rope_head_dim=7"):
    MLAConfig(qk_rope_head_dim=7)
  with pytest.raises(UserError, match=r"model\.mla\.rope_type='ntk'"):
    MLAConfig(rope_type="ntk")
  with pytest.raises(UserError, match=r"model\.mla\.kv_lora_rank=0"):
    MLAConfig(kv_lora_rank=0)
  assert MLAConfig().rope_scaling is None
  assert MLAConfig(rope_type="yarn", rope_factor=40.0).softmax_scale == pytest.approx(48**-0.5)


# ---- parameters and FLOPs (docs/mla.md) --------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_param_counts_match_transformers_module(q_lora_rank):
  hf_attn = hf_v2.DeepseekV2Attention(hf_config("v2", None, q_lora_rank), 0)
  cfg = mla_config(None, q_lora_rank)
  total = sum(p.numel() for p in hf_attn.parameters())
  linear = sum(m.weight.numel() for m in hf_attn.modules() if isinstance(m, torch.nn.Linear))
  assert param_count(D, H, cfg) == total
  assert matmul_params(D, H, cfg) == linear
  assert cache_per_token(cfg) == SHAPES["kv_lora_rank"] + SHAPES["qk_rope_head_dim"]


def dot_flops(jaxpr) -> int:
  """2·(multiply-adds) of every dot_general in a jaxpr and the jaxprs inside it."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      out = eqn.outvars[0].aval.shape
      total += 2 * math.prod(out) * math.prod(lhs[i] for i in lhs_contract)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += dot_flops(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += dot_flops(sub)
  return total


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_flops_formulas_count_the_traced_matmuls(q_lora_rank):
  cfg = mla_config(rope_parameters(1.0, 1.0), q_lora_rank)
  m = MLAttention(D, H, cfg, rngs=nnx.Rngs(0))
  pos = jnp.zeros((B, L), jnp.int32)
  forward = jax.make_jaxpr(lambda x: m(x, pos)[0])(jnp.zeros((B, L, D)))
  per_token = 2 * matmul_params(D, H, cfg) + score_flops_per_token(H, cfg, L) // 3
  assert dot_flops(forward.jaxpr) == B * L * per_token
  S = 11
  cache, at = m.init_cache(B, S, jnp.float32), DecodeAt(jnp.asarray(4), jnp.zeros(B, jnp.int32))
  step = jax.make_jaxpr(lambda x: m(x, pos[:, :1], cache=cache, at=at)[0])(jnp.zeros((B, 1, D)))
  assert dot_flops(step.jaxpr) == B * decode_flops_per_token(D, H, cfg, S)
