"""Tests for moejax.nn.layers and moejax.nn.model: NumPy references, causality, param tree, jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiers import FULL

from moejax.errors import UserError
from moejax.nn.layers import Attention, DenseFFN, RMSNorm, rope
from moejax.nn.model import ModelConfig, Transformer, is_moe_layer
from moejax.nn.moe import MoEBlock, MoEConfig

TINY = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def np_rope(x_BxLxHxK: np.ndarray, positions_BxL: np.ndarray, theta: float) -> np.ndarray:
  """Rotate-half RoPE, one position at a time."""
  out = np.empty_like(x_BxLxHxK, dtype=np.float64)
  K = x_BxLxHxK.shape[-1]
  inv_freq = theta ** (-np.arange(K // 2) * 2.0 / K)
  for b in range(x_BxLxHxK.shape[0]):
    for l in range(x_BxLxHxK.shape[1]):
      ang = positions_BxL[b, l] * inv_freq
      cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
      x = x_BxLxHxK[b, l].astype(np.float64)
      rot = np.concatenate([-x[:, K // 2 :], x[:, : K // 2]], axis=-1)
      out[b, l] = x * cos + rot * sin
  return out


def np_rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def test_rope_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
  pos = np.array([[0, 1, 2, 3, 4], [7, 3, 100, 0, 11]])
  got = rope(jnp.asarray(x), jnp.asarray(pos), 10000.0)
  np.testing.assert_allclose(np.asarray(got), np_rope(x, pos, 10000.0), atol=2e-5)
  np.testing.assert_allclose(np.asarray(got[0, 0]), x[0, 0], atol=0)  # position 0: identity


def test_rope_relative_position():
  rng = np.random.default_rng(1)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))

  def dot(m: int, n: int) -> float:
    rq = rope(q, jnp.array([[m]]), 500.0)
    rk = rope(k, jnp.array([[n]]), 500.0)
    return float(jnp.sum(rq * rk))

  ref = dot(5, 2)
  for m, n in [(3, 0), (10, 7), (40, 37)]:
    np.testing.assert_allclose(dot(m, n), ref, rtol=1e-4, atol=1e-5)
  assert abs(dot(5, 1) - ref) > 1e-3  # a different offset gives a different score


def np_attention(attn: Attention, x: np.ndarray, theta: float, eps: float) -> np.ndarray:
  """Reference GQA: project, QK-norm, RoPE, repeat kv heads, causal softmax, project."""
  B, L, _ = x.shape
  H, G, K = attn.n_heads, attn.n_kv_heads, attn.head_dim
  w = {
    n: np.asarray(getattr(attn, n).kernel[...], np.float64)
    for n in ("q_proj", "k_proj", "v_proj", "o_proj")
  }
  q = (x @ w["q_proj"]).reshape(B, L, H, K)
  k = (x @ w["k_proj"]).reshape(B, L, G, K)
  v = (x @ w["v_proj"]).reshape(B, L, G, K)
  if attn.q_norm is not None:
    q = np_rms(q, np.asarray(attn.q_norm.scale[...]), eps)
    k = np_rms(k, np.asarray(attn.k_norm.scale[...]), eps)
  pos = np.broadcast_to(np.arange(L), (B, L))
  q, k = np_rope(q, pos, theta), np_rope(k, pos, theta)
  k, v = np.repeat(k, H // G, axis=2), np.repeat(v, H // G, axis=2)
  o = np.zeros((B, L, H, K))
  for b in range(B):
    for h in range(H):
      s = q[b, :, h] @ k[b, :, h].T / np.sqrt(K)
      s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      o[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h]
  return o.reshape(B, L, H * K) @ w["o_proj"]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_matches_numpy(qk_norm: bool):
  attn = Attention(12, 4, 2, 6, qk_norm=qk_norm, rope_theta=100.0, init_std=0.3, rngs=nnx.Rngs(0))
  if qk_norm:  # non-trivial norm scales so the test sees them
    attn.q_norm.scale[...] = jnp.linspace(0.5, 1.5, 6)
    attn.k_norm.scale[...] = jnp.linspace(1.5, 0.5, 6)
  x = np.random.default_rng(2).normal(size=(2, 7, 12)).astype(np.float32)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  got, _ = attn(jnp.asarray(x), pos)
  assert got.shape == (2, 7, 12) and got.dtype == jnp.float32
  np.testing.assert_allclose(
    np.asarray(got), np_attention(attn, x, 100.0, 1e-6), rtol=1e-4, atol=1e-5
  )


def test_rmsnorm_and_ffn():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 8)), jnp.bfloat16)
  norm = RMSNorm(8, eps=1e-6, rngs=nnx.Rngs(0))
  y = norm(x)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(y, np.float32), np_rms(np.asarray(x, np.float32), 1.0, 1e-6), rtol=1e-2
  )
  ffn = DenseFFN(8, 12, dtype="bfloat16", rngs=nnx.Rngs(0))
  assert ffn.w_gate_up[...].dtype == jnp.float32 and ffn.w_gate_up[...].shape == (8, 24)
  assert ffn.w_down[...].shape == (12, 8)
  assert ffn(x).dtype == jnp.bfloat16


def test_causality():
  cfg = ModelConfig(**TINY, qk_norm=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 32, size=(2, 9)))
  fwd = nnx.jit(lambda m, tokens: m(tokens)[0])
  base = fwd(model, tokens)
  t = 5
  changed = fwd(model, tokens.at[:, t].set((tokens[:, t] + 1) % 32))
  np.testing.assert_array_equal(np.asarray(changed[:, :t]), np.asarray(base[:, :t]))
  assert not np.allclose(np.asarray(changed[:, t:]), np.asarray(base[:, t:]))


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return {".".join(map(str, path)): tuple(v[...].shape) for path, v in flat}


def _block_shapes(prefix: str, lead: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
  one = {
    "attn_norm.scale": (16,),
    "mlp_norm.scale": (16,),
    "attn.q_proj.kernel": (16, 32),
    "attn.k_proj.kernel": (16, 16),
    "attn.v_proj.kernel": (16, 16),
    "attn.o_proj.kernel": (32, 16),
    "attn.q_norm.scale": (8,),
    "attn.k_norm.scale": (8,),
    "mlp.w_gate_up": (16, 48),
    "mlp.w_down": (24, 16),
  }
  return {prefix + k: lead + v for k, v in one.items()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("scan", [False, True])
def test_param_tree(tie: bool, scan: bool):
  """Unrolled: one entry per layer. Scanned: the 2 dense layers as one stack, a leading
  layer axis of 2 on every block parameter."""
  cfg = ModelConfig(**TINY, head_dim=8, qk_norm=True, tie_embeddings=tie, scan_layers=scan)
  shapes = param_shapes(Transformer(cfg, rngs=nnx.Rngs(0)))
  expected = {"embed.embedding": (32, 16), "final_norm.scale": (16,)}
  if scan:
    expected |= _block_shapes("stacks.0.blocks.0.", (2,))
  else:
    for i in range(2):
      expected |= _block_shapes(f"layers.{i}.", ())
  if not tie:
    expected["lm_head.kernel"] = (16, 32)
  assert shapes == expected


def test_init_std():
  cfg = ModelConfig(
    vocab_size=64, d_model=64, n_layers=8, n_heads=4, n_kv_heads=4, d_ff=128, scan_layers=False
  )
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  std = lambda p: float(jnp.std(p[...]))  # noqa: E731
  assert 0.015 < std(model.layers[0].attn.q_proj.kernel) < 0.025
  assert 0.015 / 4 < std(model.layers[0].mlp.w_down) < 0.025 / 4  # 0.02 / sqrt(2 * 8)


def test_moe_placement():
  moe = MoEConfig(d_model=16, n_experts=4, top_k=2, d_expert=8)
  place = lambda **kw: [
    is_moe_layer(ModelConfig(**(TINY | kw), moe=moe), i)  # noqa: E731
    for i in range(kw.get("n_layers", 2))
  ]
  assert place(n_layers=4) == [True] * 4
  assert place(n_layers=4, moe_every=2) == [True, False, True, False]
  assert place(n_layers=4, moe_every=2, first_dense=1) == [False, True, False, True]
  assert place(n_layers=4, first_dense=2) == [False, False, True, True]
  assert place(n_layers=4, moe_every=0) == [False] * 4
  assert not any(is_moe_layer(ModelConfig(**TINY), i) for i in range(2))


@pytest.mark.parametrize(
  "bad, field",
  [
    (dict(n_heads=3), "model.n_heads"),
    (dict(n_kv_heads=3), "model.n_kv_heads"),
    (dict(moe_every=-1), "model.moe_every"),
    (dict(first_dense=3), "model.first_dense"),
    (dict(first_dense=-1), "model.first_dense"),
    (dict(dtype="float16"), "model.dtype"),
    (dict(head_dim=5), "model.head_dim"),
    (dict(d_ff=0), "model.d_ff"),
  ],
)
def test_config_validation(bad: dict, field: str):
  with pytest.raises(UserError, match=field):
    ModelConfig(**(TINY | bad))


def test_head_dim_default_and_override():
  assert ModelConfig(**TINY).resolved_head_dim == 4
  assert ModelConfig(**TINY, head_dim=6).resolved_head_dim == 6
  assert ModelConfig(**(TINY | dict(n_heads=3, n_kv_heads=1)), head_dim=8).resolved_head_dim == 8


def test_bfloat16_close_to_float32():
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 32, size=(2, 8)))
  logits = {}
  for dtype in ("float32", "bfloat16"):
    model = Transformer(ModelConfig(**TINY, dtype=dtype, init_std=0.2), rngs=nnx.Rngs(0))
    logits[dtype], _ = jit_round_trip(model, tokens)
    assert logits[dtype].dtype == jnp.float32
    assert model.embed.embedding[...].dtype == jnp.float32
  np.testing.assert_allclose(
    np.asarray(logits["bfloat16"]),
    np.asarray(logits["float32"]),
    atol=0.05 * float(jnp.max(jnp.abs(logits["float32"]))),
  )


def jit_round_trip(model: nnx.Module, tokens: jax.Array, **kw):
  """Split, jit a pure function of (graphdef, state), merge inside: the trainer's pattern."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, tokens):
    return nnx.merge(graphdef, state)(tokens, **kw)

  return fwd(state, tokens)


@pytest.mark.parametrize("tie", [True, False])
def test_split_jit_merge_matches_eager(tie: bool):
  model = Transformer(ModelConfig(**TINY, tie_embeddings=tie), rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 32, size=(2, 8)))
  eager, _ = model(tokens)
  jitted, routers = jit_round_trip(model, tokens)
  assert routers == {}
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-6)
  hash(nnx.graphdef(model))  # graphdef usable as a static jit argument


# --- MoE layers (moejax.nn.moe) ---------------------------------------------------------------


def moe_config(**kw) -> ModelConfig:
  moe = MoEConfig(d_model=16, n_experts=4, top_k=2, d_expert=8)
  return ModelConfig(**(TINY | dict(n_layers=4, moe_every=2, first_dense=1) | kw), moe=moe)


def test_moe_layer_types_and_params():
  model = Transformer(moe_config(scan_layers=False), rngs=nnx.Rngs(0))
  types_ = [type(b.mlp) for b in model.layers]
  assert types_ == [DenseFFN, MoEBlock, DenseFFN, MoEBlock]
  shapes = param_shapes(model)
  assert shapes["layers.1.mlp.router.kernel"] == (16, 4)
  assert shapes["layers.1.mlp.experts.w_gate_up"] == (4, 16, 16)
  assert "layers.0.mlp.router.kernel" not in shapes


def test_scanned_moe_layer_types_and_params():
  """first_dense 1, moe_every 2, 4 layers: a dense prefix stack (layer 0), the period
  [MoE, dense] once (layers 1, 2), then the period's remainder [MoE] once (layer 3)."""
  model = Transformer(moe_config(), rngs=nnx.Rngs(0))
  types_ = [[type(b.mlp) for b in st.blocks] for st in model.stacks]
  assert types_ == [[DenseFFN], [MoEBlock, DenseFFN], [MoEBlock]]
  shapes = param_shapes(model)
  assert shapes["stacks.1.blocks.0.mlp.router.kernel"] == (1, 16, 4)
  assert shapes["stacks.2.blocks.0.mlp.experts.w_gate_up"] == (1, 4, 16, 16)
  assert shapes["stacks.0.blocks.0.mlp.w_gate_up"] == (1, 16, 48)


def test_moe_forward_and_router_grad():
  model = Transformer(moe_config(), rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, 32, size=(2, 8)))
  logits, routers = jit_round_trip(model, tokens, rng=jax.random.key(0))
  assert logits.shape == (2, 8, 32) and logits.dtype == jnp.float32
  assert list(routers) == [1, 3]
  for ro in routers.values():
    assert all(jnp.shape(v) == () for v in ro.diag)
    assert ro.logits.shape == ro.probs.shape == (2, 8, 4) and ro.experts.shape == (2, 8, 2)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens, train=True, rng=jax.random.key(1))
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])  # LM term only: r_i carry the grad

  grads = jax.jit(jax.grad(loss))(params)
  for s in (1, 2):  # the MoE layers 1 and 3 (test_scanned_moe_layer_types_and_params)
    g = grads["stacks"][s]["blocks"][0]["mlp"]["router"]["kernel"][...]
    assert g.shape == (1, 16, 4) and float(jnp.abs(g).sum()) > 0


@FULL
def test_moe_jit_round_trip_and_bf16():
  tokens = jnp.asarray(np.random.default_rng(8).integers(0, 32, size=(2, 8)))
  model = Transformer(moe_config(), rngs=nnx.Rngs(0))
  eager, eager_outs = model(tokens)
  assert list(eager_outs) == [1, 3]
  jitted, routers = jit_round_trip(model, tokens)
  assert list(routers) == [1, 3]
  hash(nnx.graphdef(model))
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-4, atol=1e-5)
  bf16 = Transformer(moe_config(dtype="bfloat16"), rngs=nnx.Rngs(0))
  logits, _ = jit_round_trip(bf16, tokens)
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
