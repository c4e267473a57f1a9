"""The Gated DeltaNet and gated attention mixers of Qwen3.5 / Qwen3-Next (issue 58).

References nobody here wrote: the token-by-token loop (the oracle for the chunked rule),
transformers 5.24's `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`, and
its own modules (`Qwen3_5MoeGatedDeltaNet`, `Qwen3NextGatedDeltaNet`, `Qwen3_5MoeAttention`,
`Qwen3NextAttention`, their norms and rotary embeddings) built from their config classes at
tiny sizes with random weights, norms included, copied into the moejax modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import FULL
import torch  # the test extra pins torch and transformers: this file always runs
import transformers
from flax import nnx
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext

from moejax.errors import UserError
from moejax.nn import gated_delta as gd
from moejax.nn.gated_attention import GatedAttention, partial_rope, rotary_dim
from moejax.nn.gated_deltanet import (
  GatedDeltaNet,
  GatedDeltaNetConfig,
  join_qwen3_next,
  split_qwen3_next,
)
from moejax.nn.mixer import DecodeAt, start_at
from moejax.nn.norms import gated_rms_norm, zero_centred_rms_norm

D, HK, HV, DK, DV, W = 32, 2, 4, 8, 6, 4  # tiny: 2 key heads, 4 value heads
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # gated attention; rotary dims 16 · 0.25 = 4
LINEAR = {
  "linear_num_key_heads": HK, "linear_num_value_heads": HV, "linear_key_head_dim": DK,
  "linear_value_head_dim": DV, "linear_conv_kernel_dim": W,
}  # fmt: skip
COMMON = dict(
  vocab_size=64, hidden_size=D, num_hidden_layers=4, num_attention_heads=HEADS,
  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, num_experts=4,
  num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, **LINEAR,
)  # fmt: skip


# ---------------------------------------------------------------- the rule's inputs


def raw_inputs(seed: int, L: int, B: int = 2, hk: int = HK, hv: int = HV):
  """Unnormalized q, k [B, L, hk, DK], v [B, L, hv, DV], a, b [B, L, hv], A_log, dt_bias."""
  r = np.random.default_rng(seed)
  f = np.float32
  return {
    "q": r.normal(size=(B, L, hk, DK)).astype(f),
    "k": r.normal(size=(B, L, hk, DK)).astype(f),
    "v": r.normal(size=(B, L, hv, DV)).astype(f),
    "a": r.normal(size=(B, L, hv)).astype(f),
    "b": r.normal(size=(B, L, hv)).astype(f),
    "A_log": np.log(r.uniform(0.05, 2.0, size=hv)).astype(f),
    "dt_bias": r.normal(size=hv).astype(f),
  }


def rule_args(x: dict):
  """moejax's convention from raw inputs: normalized q, k repeated to the value heads; g, β."""
  q, k = gd.normalize_qk(jnp.asarray(x["q"]), jnp.asarray(x["k"]))
  hv = x["v"].shape[2]
  g, beta = gd.decay_and_beta(x["a"], x["b"], x["A_log"], x["dt_bias"])
  return gd.repeat_heads(q, hv), gd.repeat_heads(k, hv), jnp.asarray(x["v"]), g, beta


def state0(seed: int, B: int = 2, h: int = HV) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(B, h, DK, DV)).astype(np.float32) * 0.5


# jitted (a CPU test host runs eager ops one by one, far slower than one compile)
chunk_rule = jax.jit(gd.chunk_gated_delta, static_argnames="chunk")
recurrent_rule = jax.jit(gd.recurrent_gated_delta)


@nnx.jit
def call(mixer, x_BxLxD, positions_BxL, cache=None, at=None):
  """A mixer's call, compiled."""
  return mixer(x_BxLxD, positions_BxL, cache=cache, at=at)


def np_close(a, b, tol: float) -> None:
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=0)


# ---------------------------------------------------------------- the rule: chunked vs oracle


@pytest.mark.parametrize("L", [*(pytest.param(n, marks=FULL) for n in (1, 63, 64)), 65, pytest.param(200, marks=FULL)])
def test_chunked_rule_equals_the_sequential_oracle(L: int):
  """Forward within 1e-5, gradients (of q, k, v, a, b and the initial state) within 1e-4."""
  x = raw_inputs(L, L)
  S0 = state0(L)
  r = np.random.default_rng(99)
  wo, ws = r.normal(size=(2, L, HV, DV)), r.normal(size=(2, HV, DK, DV))

  def loss(rule, q, k, v, a, b, S):
    args = rule_args(dict(x, q=q, k=k, v=v, a=a, b=b))
    o, S_end = rule(*args, initial_state=S)
    return jnp.sum(o * wo) + jnp.sum(S_end * ws), (o, S_end)

  chunked = lambda *a, **kw: gd.chunk_gated_delta(*a, **kw, chunk=64)
  primal = (x["q"], x["k"], x["v"], x["a"], x["b"], S0)
  grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4, 5, 6), has_aux=True), static_argnums=0)
  (g_seq, (o_seq, S_seq)) = grad(gd.recurrent_gated_delta, *primal)
  (g_chk, (o_chk, S_chk)) = grad(chunked, *primal)
  np_close(o_chk, o_seq, 1e-5)
  np_close(S_chk, S_seq, 1e-5)
  for a, b in zip(g_chk, g_seq):
    np_close(a, b, 1e-4)
  assert float(jnp.abs(o_seq).max()) > 0.1  # the outputs are not trivially zero


@pytest.mark.parametrize("chunk", [pytest.param(4, marks=FULL), pytest.param(64, marks=FULL)])
def test_left_padding_leaves_the_state_unchanged(chunk: int):
  """A left-padded row (junk tokens with valid=False) gives the unpadded row's outputs and
  final state: exactly for the sequential rule, within 1e-5 chunked."""
  L, P = 23, 5
  x = raw_inputs(7, L + P)
  valid_BxL = jnp.arange(L + P)[None, :] >= jnp.array([[P], [0]])  # row 0 padded, row 1 not
  q, k, v, g, beta = rule_args(x)
  g, beta = gd.mask_padding(g, beta, valid_BxL)
  alone = tuple(a[:1, P:] for a in rule_args(x))  # row 0's real tokens, unpadded
  for rule, exact in (
    (recurrent_rule, True),
    (lambda *a: chunk_rule(*a, chunk=chunk), False),
  ):
    o_pad, S_pad = rule(q, k, v, g, beta)
    o_one, S_one = rule(*alone)
    if exact:
      np.testing.assert_array_equal(o_pad[:1, P:], o_one)
      np.testing.assert_array_equal(S_pad[:1], S_one)
    else:
      np_close(o_pad[:1, P:], o_one, 1e-5)
      np_close(S_pad[:1], S_one, 1e-5)
  # without the mask the junk would have changed the state: the check can fail
  o_unmasked, _ = recurrent_rule(*rule_args(x))
  assert float(jnp.abs(o_unmasked[:1, P] - o_one[:, 0]).max()) > 1e-3


@pytest.mark.parametrize("L", [65, pytest.param(100, marks=FULL)])
def test_both_rules_match_transformers(L: int):
  """The same raw inputs through transformers' chunked and recurrent torch rules (their
  in-kernel l2norm, grouped value heads, an initial state) and through moejax's."""
  x = raw_inputs(L + 1, L)
  S0 = state0(L + 1)
  g, beta = gd.decay_and_beta(x["a"], x["b"], x["A_log"], x["dt_bias"])
  t = {n: torch.from_numpy(x[n]) for n in "qkv"}
  tg, tb = torch.tensor(np.asarray(g)), torch.tensor(np.asarray(beta))
  kw = {"initial_state": torch.from_numpy(S0), "output_final_state": True}
  kw["use_qk_l2norm_in_kernel"] = True
  o_hc, S_hc = hfnext.torch_chunk_gated_delta_rule(t["q"], t["k"], t["v"], tg, tb, **kw)
  o_hr, S_hr = hfnext.torch_recurrent_gated_delta_rule(t["q"], t["k"], t["v"], tg, tb, **kw)
  args = rule_args(x)
  o_c, S_c = chunk_rule(*args, initial_state=S0)
  o_r, S_r = recurrent_rule(*args, initial_state=S0)
  np_close(o_c, o_hc.numpy(), 1e-5)
  np_close(S_c, S_hc.numpy(), 1e-5)
  np_close(o_r, o_hr.numpy(), 1e-5)
  np_close(S_r, S_hr.numpy(), 1e-5)


def _state_rows(rule, L: int) -> int:
  """How many [dk, dv] states (per batch row and head) autodiff keeps for the backward:
  the residuals of `jax.vjp` whose trailing axes are a state's."""
  x = raw_inputs(3, L, B=1)
  _, vjp = jax.vjp(jax.jit(rule), *rule_args(x))
  leaves = jax.tree_util.tree_leaves(vjp)
  return sum(a.size // (DK * DV) for a in leaves if a.shape[-2:] == (DK, DV)) // HV


def test_chunked_backward_keeps_a_state_per_chunk_not_per_token():
  L, C = 256, 16
  chunked = _state_rows(lambda *a: gd.chunk_gated_delta(*a, chunk=C), L)
  assert 0 < chunked <= 2 * (L // C)
  assert _state_rows(gd.recurrent_gated_delta, L) >= L  # the oracle does keep L: can fail


# ---------------------------------------------------------------- the mixers vs transformers


def randomize(module: torch.nn.Module, seed: int) -> None:
  """Weights far from init: plain norm weights around 1, zero-centred ones around 0."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      plain = name == "norm.weight"  # the gated norm's; q_norm/k_norm are zero-centred
      p.copy_(1.0 + 0.3 * noise if plain else 0.3 * noise)


def tensor(p: torch.Tensor) -> np.ndarray:
  return p.detach().numpy()


def load_gdn(hf: torch.nn.Module, cfg: GatedDeltaNetConfig, chunk: int) -> GatedDeltaNet:
  """A moejax GatedDeltaNet holding `hf`'s weights (Qwen3-Next's split per key head)."""
  m = GatedDeltaNet(D, cfg, chunk=chunk, rngs=nnx.Rngs(0))
  if hasattr(hf, "in_proj_qkvz"):
    qkvz, ba = tensor(hf.in_proj_qkvz.weight), tensor(hf.in_proj_ba.weight)
    parts = split_qwen3_next(qkvz, ba, cfg)
    back = join_qwen3_next(parts, cfg)
    np.testing.assert_array_equal(back[0], qkvz)
    np.testing.assert_array_equal(back[1], ba)
  else:
    parts = {n: tensor(getattr(hf, n).weight) for n in ("in_proj_qkv", "in_proj_z")}
    parts |= {n: tensor(getattr(hf, n).weight) for n in ("in_proj_b", "in_proj_a")}
  for name, w in parts.items():
    getattr(m, name).kernel[...] = jnp.asarray(w.T)
  m.out_proj.kernel[...] = jnp.asarray(tensor(hf.out_proj.weight).T)
  m.conv_kernel[...] = jnp.asarray(tensor(hf.conv1d.weight)[:, 0, :].T)
  m.A_log[...] = jnp.asarray(tensor(hf.A_log))
  m.dt_bias[...] = jnp.asarray(tensor(hf.dt_bias))
  m.norm_weight[...] = jnp.asarray(tensor(hf.norm.weight))
  return m


GDN_FAMILIES = {
  "qwen3_5_moe": lambda: (transformers.Qwen3_5MoeTextConfig(**COMMON), hf35.Qwen3_5MoeGatedDeltaNet),
  "qwen3_next": lambda: (transformers.Qwen3NextConfig(**COMMON), hfnext.Qwen3NextGatedDeltaNet),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(GDN_FAMILIES))
def test_gated_deltanet_matches_transformers(family: str):
  """The whole mixer (projections, conv, rule, gated norm, out_proj) at L = 70 over chunks
  of 64: within 1e-4 of transformers' module (its torch fallbacks)."""
  hf_cfg, cls = GDN_FAMILIES[family]()
  hf = cls(hf_cfg, layer_idx=0).eval()
  randomize(hf, 1)
  m = load_gdn(hf, GatedDeltaNetConfig(**LINEAR), chunk=64)
  x = np.random.default_rng(2).normal(size=(2, 70, D)).astype(np.float32)
  with torch.no_grad():
    want = hf(torch.from_numpy(x)).numpy()
  got, cache = call(m, jnp.asarray(x), jnp.zeros((2, 70), jnp.int32))
  assert cache is None
  np_close(got, want, 1e-4)
  assert np.abs(want).max() > 0.1


def rotary(hf_cfg, family: str):
  cls = hf35.Qwen3_5MoeTextRotaryEmbedding if family == "qwen3_5_moe" else None
  return (cls or hfnext.Qwen3NextRotaryEmbedding)(hf_cfg)


ATTN_FAMILIES = {
  "qwen3_5_moe": lambda: (transformers.Qwen3_5MoeTextConfig(**COMMON), hf35.Qwen3_5MoeAttention),
  "qwen3_next": lambda: (transformers.Qwen3NextConfig(**COMMON), hfnext.Qwen3NextAttention),
}  # fmt: skip


def load_attention(hf: torch.nn.Module) -> GatedAttention:
  m = GatedAttention(D, HEADS, KV_HEADS, HEAD_DIM, rngs=nnx.Rngs(0))
  for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
    getattr(m, n).kernel[...] = jnp.asarray(tensor(getattr(hf, n).weight).T)
  m.q_norm.weight[...] = jnp.asarray(tensor(hf.q_norm.weight))
  m.k_norm.weight[...] = jnp.asarray(tensor(hf.k_norm.weight))
  return m


def hf_positions(family: str, pos_BxL: torch.Tensor) -> torch.Tensor:
  """What each text model passes its rotary embedding: Qwen3.5's three equal mRoPE rows."""
  return pos_BxL[None].expand(3, -1, -1) if family == "qwen3_5_moe" else pos_BxL


@pytest.mark.parametrize("family", sorted(ATTN_FAMILIES))
def test_gated_attention_matches_transformers(family: str):
  hf_cfg, cls = ATTN_FAMILIES[family]()
  hf_cfg._attn_implementation = "eager"
  hf = cls(hf_cfg, layer_idx=3).eval()
  randomize(hf, 3)
  m = load_attention(hf)
  B, L = 2, 11
  x = np.random.default_rng(4).normal(size=(B, L, D)).astype(np.float32)
  pos = torch.arange(L)[None].expand(B, -1)
  mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, L, L)
  with torch.no_grad():
    xt = torch.from_numpy(x)
    cos_sin = rotary(hf_cfg, family)(xt, hf_positions(family, pos))
    want = hf(xt, position_embeddings=cos_sin, attention_mask=mask)[0].numpy()
  got, _ = call(m, jnp.asarray(x), jnp.asarray(pos.numpy()))
  np_close(got, want, 1e-4)
  assert np.abs(want).max() > 0.1


def test_text_mrope_is_1d_rope_on_the_rotary_dims():
  """Qwen3.5's mRoPE with equal temporal/height/width positions (text only) rotates q and k
  as 1-D RoPE on the first head_dim · 0.25 dims; with unequal rows it does not."""
  rope_params = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
  hf_cfg = transformers.Qwen3_5MoeTextConfig(
    **{**COMMON, "head_dim": 32}, rope_parameters={**rope_params, "mrope_section": [2, 1, 1]}
  )
  emb = hf35.Qwen3_5MoeTextRotaryEmbedding(hf_cfg)
  r = np.random.default_rng(5)
  B, L = 2, 9
  q = r.normal(size=(B, L, HEADS, 32)).astype(np.float32)
  pos = r.integers(0, 300, size=(B, L))
  tq = torch.from_numpy(q).transpose(1, 2)

  def hf_rotated(pos_3xBxL):
    cos, sin = emb(tq, torch.from_numpy(pos_3xBxL))
    return hf35.apply_rotary_pos_emb(tq, tq, cos, sin)[0].transpose(1, 2).numpy()

  rd = rotary_dim(32, 0.25)
  ours = np.asarray(partial_rope(jnp.asarray(q), jnp.asarray(pos), 500.0, rd))
  np_close(ours, hf_rotated(np.stack([pos] * 3)), 1e-4)  # f32 angles of positions < 300
  np.testing.assert_array_equal(ours[..., rd:], q[..., rd:])  # the rest passes unrotated
  assert np.abs(ours - hf_rotated(np.stack([pos, pos + 7, pos + 3]))).max() > 1e-2


def test_norms_match_transformers():
  r = np.random.default_rng(6)
  x, z = r.normal(size=(3, 5, 16)).astype(np.float32), r.normal(size=(3, 5, 16)).astype(np.float32)
  w = (0.3 * r.normal(size=16)).astype(np.float32)
  zc = hf35.Qwen3_5MoeRMSNorm(16, eps=1e-6)
  gated = hf35.Qwen3_5MoeRMSNormGated(16, eps=1e-6)
  with torch.no_grad():
    zc.weight.copy_(torch.from_numpy(w))
    gated.weight.copy_(torch.from_numpy(1 + w))
    want_zc = zc(torch.from_numpy(x)).numpy()
    want_g = gated(torch.from_numpy(x), torch.from_numpy(z)).numpy()
  np_close(zero_centred_rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6), want_zc, 1e-6)
  np_close(gated_rms_norm(jnp.asarray(x), jnp.asarray(z), jnp.asarray(1 + w), 1e-6), want_g, 1e-6)


# ---------------------------------------------------------------- decode


def assert_decode_equals_full(mixer, prompt: int = 9, steps: int = 4) -> None:
  """Prefill a left-padded batch (row 1 starts at slot 3, its first slots junk), then
  one-token steps: each row's outputs equal the full forward of its real tokens alone."""
  starts, B, S = [0, 3], 2, prompt + steps
  x = jnp.asarray(np.random.default_rng(8).normal(size=(B, S, D)).astype(np.float32))
  at = start_at(jnp.array(starts))
  cache = mixer.init_cache(B, S, jnp.float32)
  y, cache = call(mixer, x[:, :prompt], at.positions_BxL(prompt), cache, at)
  ys = [y]
  for i in range(steps):
    at_i = DecodeAt(jnp.int32(prompt + i), at.start_B)
    y, cache = call(mixer, x[:, prompt + i : prompt + i + 1], at_i.positions_BxL(1), cache, at_i)
    ys.append(y)
  y_dec = jnp.concatenate(ys, axis=1)
  for b, s in enumerate(starts):
    n = S - s
    want, _ = call(mixer, x[b : b + 1, s:], jnp.arange(n)[None])
    np_close(y_dec[b : b + 1, s:], want, 1e-5)


def test_gated_deltanet_decode_equals_the_full_forward():
  """Chunks of 4: the prefill spans three chunks; steps use the one-token recurrence."""
  mixer = GatedDeltaNet(D, GatedDeltaNetConfig(**LINEAR), chunk=4, rngs=nnx.Rngs(1))
  mixer.dt_bias[...] = jnp.full((HV,), -2.0)  # slow decay, so early tokens still matter
  assert_decode_equals_full(mixer)


def test_gated_attention_decode_equals_the_full_forward():
  mixer = GatedAttention(D, HEADS, KV_HEADS, HEAD_DIM, rngs=nnx.Rngs(2))
  mixer.q_norm.weight[...] = jnp.linspace(-0.5, 0.5, HEAD_DIM)
  assert_decode_equals_full(mixer)


# ---------------------------------------------------------------- bad shapes


@pytest.mark.parametrize(
  "bad, key",
  [
    ({"linear_num_key_heads": 3, "linear_num_value_heads": 4}, "linear_num_value_heads=4"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim=0"),
  ],
)
def test_bad_shapes_are_one_line(bad: dict, key: str):
  with pytest.raises(UserError, match=key) as e:
    GatedDeltaNetConfig(**bad)
  assert "\n" not in str(e.value)
  with pytest.raises(UserError, match="partial_rotary_factor=0.1"):
    rotary_dim(16, 0.1)
