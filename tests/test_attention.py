"""Attention implementations (moejax.nn.attention, `model.attention`) against references.

Each impl is checked on CPU: the function against a NumPy loop (forward) and a plain jnp
formula written here (gradients), causal with grouped-query heads; the `Attention`
module with each impl against `xla` (today's attention), with and without QK-norm. The
splash kernel runs in Pallas interpret mode here; lowered for TPU it is a Mosaic kernel
(checked by export, without a TPU). L = 128: splash's smallest tile.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failure_helpers import results_on_host_devices
from flax import nnx
from requires import needs_tokamax

from moejax.errors import UserError
from moejax.nn.attention import ATTENTION_IMPLS, splash_attention
from moejax.nn.layers import Attention

B, L, H, G, K = 2, 128, 4, 2, 8
# tokamax's (the cuda extra) skip without it (tests/requires.py)
IMPLS = [pytest.param(i, marks=needs_tokamax) if i == "tokamax" else i for i in ATTENTION_IMPLS]


def np_attention(q, k, v) -> np.ndarray:
  """Causal GQA one query at a time: head h reads kv head h // (H/G), keys s <= t."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros(q.shape)
  r = q.shape[2] // k.shape[2]
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      for t in range(q.shape[1]):
        s = k[b, : t + 1, h // r] @ q[b, t, h] / np.sqrt(q.shape[3])
        p = np.exp(s - s.max())
        out[b, t, h] = (p / p.sum()) @ v[b, : t + 1, h // r]
  return out


def jnp_attention(q, k, v):
  """The same in jnp, for reference gradients: repeat kv heads, mask, softmax."""
  r = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
  s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[3])
  s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -jnp.inf)
  return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, -1), v)


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  shapes = ((B, L, H, K), (B, L, G, K), (B, L, G, K), (B, L, H, K))
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)  # q, k, v, dy


def value_and_vjp(fn, q, k, v, dy):
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(dy)


@pytest.fixture(scope="module")
def reference(qkv):
  q, k, v, dy = qkv
  _, grads = jax.jit(lambda *a: value_and_vjp(jnp_attention, *a))(q, k, v, dy)
  return np_attention(q, k, v), grads


@pytest.mark.parametrize("impl", IMPLS)
def test_impl_matches_references(impl, qkv, reference):
  q, k, v, dy = qkv
  want_out, want_grads = reference
  out, grads = jax.jit(lambda *a: value_and_vjp(ATTENTION_IMPLS[impl], *a))(q, k, v, dy)
  assert out.shape == (B, L, H, K) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, want_out, atol=2e-5)
  for name, g, want in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(g, want, atol=5e-5, err_msg=f"d{name}")


def module_out_and_grads(impl: str, qk_norm: str):
  """Attention module (GQA 4/2 heads of 8, d_model 32) output and parameter gradients."""
  attn = Attention(
    32, H, G, K, qk_norm=qk_norm != "off", qk_norm_scope=qk_norm if qk_norm != "off" else "head",
    impl=impl, rngs=nnx.Rngs(0),
  )  # fmt: skip
  graphdef, params = nnx.split(attn)
  x = jax.random.normal(jax.random.key(1), (1, L, 32), jnp.float32)
  pos = jnp.arange(L, dtype=jnp.int32)[None]
  dy = jax.random.normal(jax.random.key(2), (1, L, 32), jnp.float32)

  def loss(p):
    y, _ = nnx.merge(graphdef, p)(x, pos)
    return jnp.sum(y * dy), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return y, grads


@pytest.fixture(scope="module")
def xla_module():
  return {n: module_out_and_grads("xla", n) for n in ("off", "head", "proj")}


@pytest.mark.parametrize("qk_norm", ["off", "head", "proj"])
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "xla"])
def test_module_with_impl_matches_xla(impl, qk_norm, xla_module):
  y0, grads0 = xla_module[qk_norm]
  y, grads = module_out_and_grads(impl, qk_norm)
  np.testing.assert_allclose(y, y0, atol=1e-6)
  flat0 = jax.tree_util.tree_leaves_with_path(grads0)
  assert len(flat0) == (4 if qk_norm == "off" else 6)
  for (path, g0), g in zip(flat0, jax.tree.leaves(grads)):
    np.testing.assert_allclose(g, g0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs_give_bf16_output_near_f32(impl, qkv, reference):
  q, k, v, _ = qkv
  out = jax.jit(ATTENTION_IMPLS[impl])(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), reference[0], atol=0.05)


def test_splash_refuses_a_length_it_cannot_tile():
  q = jnp.zeros((1, 96, H, K))
  k = jnp.zeros((1, 96, G, K))
  with pytest.raises(UserError, match=r"model.attention='splash'.*multiple of 128; got 96"):
    splash_attention(q, k, k)


def test_splash_lowers_to_a_tpu_kernel(qkv):
  """Exported for TPU, forward and backward are Mosaic custom calls (the interpret-mode
  branch, a while loop over the grid, is not lowered)."""
  q, k, v, dy = qkv
  fn = jax.jit(lambda *a: value_and_vjp(splash_attention, *a))
  text = jax.export.export(fn, platforms=("tpu",))(q, k, v, dy).mlir_module()
  assert text.count("tpu_custom_call") == 3  # forward, dq, dkv
  assert "stablehlo.while" not in text


SHARD_SCRIPT = textwrap.dedent(r"""
  import json
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from moejax.nn.attention import splash_attention
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 1), ("data", "fsdp", "expert"))
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(4, 128, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(4, 128, 2, 8)), jnp.float32)
  want = jax.jit(splash_attention)(q, k, k)
  batch = NamedSharding(mesh, P(("data", "fsdp")))
  qs, ks = jax.device_put(q, batch), jax.device_put(k, batch)
  with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(splash_attention)(qs, ks, ks))
    got = jax.jit(splash_attention)(qs, ks, ks)
  print("RESULTS " + json.dumps({
    "shard_map": "shard_map" in jaxpr,
    "no_mesh_shard_map": "shard_map" in str(jax.make_jaxpr(splash_attention)(q, k, k)),
    "max_diff": float(jnp.abs(got - want).max()),
    "out_shards": sorted({tuple(s.data.shape) for s in got.addressable_shards}),
  }))
""")


def test_splash_runs_per_device_under_a_context_mesh(tmp_path):
  """Under `jax.set_mesh` splash runs in a shard_map over data × fsdp (a Pallas call is
  opaque to GSPMD): one sequence per device on 4 host devices, the same result."""
  r = results_on_host_devices(SHARD_SCRIPT, tmp_path / "splash_mesh.py", 4)
  assert r["shard_map"] and not r["no_mesh_shard_map"]
  assert r["out_shards"] == [[1, 128, 4, 8]]
  assert r["max_diff"] < 1e-6
