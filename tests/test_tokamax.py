"""The `tokamax` dropless kernel (moejax/kernels/tokamax_ragged.py) and tokamax flash attention
(`model.attention=tokamax`), wired on CPU through tokamax's own `implementation="xla"`.

The kernels' numerics on a GPU are tokamax's (tested by its authors on GPUs); what is tested
here is moejax's wiring: group sizes (empty experts, every token to one expert), the rows
left out of every group (elastic-k), the combine-weight gradient, per-expert dW, bf16 in with
a bf16 out, and the shard_map over fake devices. The attention impl's values and gradients
against the NumPy loop, causal and GQA, are in tests/test_attention.py (every ATTENTION_IMPLS
entry). What the GPU branch compiles to is benchmarks/gpu_kernels_compile.py's (needs the
CUDA jaxlib); here only that it lowers to Triton kernels from a CPU host.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from expert_weights import expert_weights
from failure_helpers import results_on_host_devices
from requires import needs_tokamax, tokamax_kernels
from test_dispatch import _check_grads, _naive_grads, naive_moe
from test_dropless import E, _case, _grad_fns, routing

from moejax import aot
from moejax.backend import compat
from moejax.errors import UserError
from moejax.kernels import dispatch as dsp
from moejax.kernels import plans
from moejax.nn.attention import tokamax_attention
from moejax.nn.moe import MoEConfig

# each ~5-15 s of compiles on 2 cores; one routing stays in the default tier
FULL = pytest.mark.full
pytestmark = needs_tokamax  # the cuda extra's
tokamax_ragged = tokamax_kernels()


@pytest.mark.parametrize(
  "K,kind",
  [
    (2, "all_to_same_set"),
    pytest.param(2, "random", marks=FULL),
    pytest.param(2, "skewed", marks=FULL),
    pytest.param(2, "all_to_one", marks=FULL),
    pytest.param(1, "all_to_one", marks=FULL),
  ],
)
def test_forward_dx_dw_and_combine_weight_gradient_match_per_token_reference(K, kind):
  """The routings megablox is tested on (tests/test_dropless.py): `all_to_same_set` leaves
  experts 0 and 2 empty, `all_to_one` gives one expert every token."""
  x, W = _case()
  experts, weights = routing(kind, K)
  ours, ref = _grad_fns("tokamax", K)
  val, (dx, dW, dr) = ours(x, W, experts, weights)
  ref_val, (ref_dx, ref_dW, ref_dr) = ref(x, W, experts, weights)
  np.testing.assert_allclose(val, ref_val, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dr, ref_dr, rtol=1e-4, atol=1e-4)
  used = np.unique(experts)
  for name, got, want in zip(("gate", "up", "down"), dW, ref_dW):
    for e in range(E):  # per expert: one wrong expert cannot hide under a global tolerance
      if e in used:
        err = np.linalg.norm(got[e] - want[e]) / np.linalg.norm(want[e])
        assert err < 1e-5, (name, e, err)
      else:
        assert np.abs(np.asarray(got[e])).max() == 0.0, (name, e)


@FULL
def test_rows_outside_every_group_contribute_nothing():
  """Elastic-k's unused assignments leave rows that no expert counts; they join the last
  group as zero rows: y and the gradients are those of the used assignments alone."""
  x, W = _case(seed=2)
  experts, weights = routing("skewed", 2, seed=2)
  used = np.random.default_rng(3).uniform(size=experts.shape) < 0.6
  used[:, 0] = True
  w_used = np.where(used, weights, 0.0).astype(np.float32)
  g = np.random.default_rng(5).normal(size=x.shape).astype(np.float32)

  def loss(x, W, r):
    y = dsp.dropless(x, experts, r, expert_weights(*W), impl="tokamax", used_TxK=used)
    return jnp.sum(g * y), y

  grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, W, w_used)
  np.testing.assert_allclose(y, naive_moe(x, experts, w_used, W, kept=used), atol=1e-5, rtol=1e-5)
  _check_grads(grads, _naive_grads(x, experts, w_used, W, g, used), experts[used])


@FULL
def test_bf16_inputs_give_bf16_output_near_the_f32_reference():
  x, W = _case(seed=4)
  experts, weights = routing("random", 2, seed=4)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  y = jax.jit(
    lambda x, W: dsp.dropless(x, experts, weights, expert_weights(*W), impl="tokamax")
  )(bf(x), tuple(map(bf, W)))
  assert y.dtype == jnp.bfloat16
  want = naive_moe(x, experts, weights, W)
  assert np.abs(np.asarray(y, np.float32) - want).max() < 0.03 * np.abs(want).max()


def test_capacity_with_tokamax_is_refused_in_one_line():
  with pytest.raises(UserError, match="impl='tokamax' is not allowed with dispatch='capacity'"):
    MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=8, dispatch="capacity", impl="tokamax")


def _lowered_text(fn, *args, platform: str) -> str:
  """`fn` lowered for `platform` on this host (for cuda: traced naming the GPU Triton
  kernels are lowered for, as jax 0.11 needs without a GPU: `compat.gpu_target`)."""
  with compat.lowering_for((platform,)):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_cuda_branch_lowers_to_triton_kernels_from_a_cpu_host():
  """Lowered for CUDA on a host without a GPU, forward, dx and dW are tokamax's Triton
  kernels (three ragged dots: gate+up, down; their dx and dW) and no ragged_dot is left for
  XLA's densifying rewriter; lowered for CPU there is no Triton call."""
  x, W = _case()
  experts, weights = routing("random", 2)

  def loss(x, W, r):
    return jnp.sum(dsp.dropless(x, experts, r, expert_weights(*W), impl="tokamax") ** 2)

  fn = jax.grad(loss, argnums=(0, 1, 2))
  cuda = _lowered_text(fn, x, W, weights, platform="cuda")
  triton = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", cuda)
  assert len(triton) >= 6 and "chlo.ragged_dot" not in cuda
  cpu = _lowered_text(fn, x, W, weights, platform="cpu")
  assert "__gpu$xla.gpu.triton" not in cpu


def test_flash_attention_lowers_to_triton_kernels_for_cuda():
  q = jnp.zeros((1, 128, 4, 8), jnp.float32)
  k = jnp.zeros((1, 128, 2, 8), jnp.float32)
  fn = jax.grad(lambda q, k, v: jnp.sum(tokamax_attention(q, k, v) ** 2), argnums=(0, 1, 2))
  cuda = _lowered_text(fn, q, k, k, platform="cuda")
  assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", cuda)) >= 2  # fwd and bwd


def test_implementations_per_platform():
  """The platform's own Mosaic kernel first where tokamax has it (it falls back on
  NotImplementedError), Triton on CUDA after it, XLA's ragged dot elsewhere."""
  assert tokamax_ragged.IMPLEMENTATIONS == {
    "cuda": ("mosaic_gpu", "triton"),
    "tpu": ("mosaic_tpu", "xla"),
    "default": ("xla",),
  }


MESH_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from moejax import sharding
from moejax.kernels import dispatch as dsp
from moejax.nn.attention import tokamax_attention
mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "expert"))
r = np.random.default_rng(0)
T, D, F, E, K = 128, 16, 8, 4, 2
x = jnp.asarray(r.normal(size=(T, D)), jnp.float32)
logits = r.normal(size=(T, E)); logits[:64, 1] += 9.0  # one device's tokens all to expert 1
e = jnp.asarray(np.argsort(-logits, -1)[:, :K], jnp.int32)
w = jnp.asarray(r.uniform(0.1, 1, size=(T, K)), jnp.float32)
W = dsp.ExpertWeights(*(jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
                        for s in [(E, D, 2 * F), (E, F, D)]))
def loss(x, w, W):
  return jnp.sum(dsp.dropless(x, e, w, W, impl="tokamax") ** 2)
f = jax.value_and_grad(loss, argnums=(0, 1, 2))
want = jax.jit(f)(x, w, W)
rows = NamedSharding(mesh, P(("data", "fsdp")))
xs, ws = jax.device_put(x, rows), jax.device_put(w, rows)
traced = sharding.tracing_mesh(f, mesh)
got = jax.jit(traced)(xs, ws, W)
diff = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
           for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
q = jnp.asarray(r.normal(size=(8, 128, 4, 8)), jnp.float32)
k = jnp.asarray(r.normal(size=(8, 128, 2, 8)), jnp.float32)
att_want = jax.jit(tokamax_attention)(q, k, k)
batch = NamedSharding(mesh, P(("data", "fsdp")))
qs, ks = jax.device_put(q, batch), jax.device_put(k, batch)
with jax.set_mesh(mesh):
  att_jaxpr = str(jax.make_jaxpr(tokamax_attention)(qs, ks, ks))
  att_got = jax.jit(tokamax_attention)(qs, ks, ks)
print("RESULTS " + json.dumps({
  "shard_map": "shard_map" in str(jax.make_jaxpr(traced)(xs, ws, W)),
  "max_diff": diff,  # relative
  "attention_shard_map": "shard_map" in att_jaxpr,
  "attention_diff": float(jnp.abs(att_got - att_want).max()),
  "attention_shards": sorted({tuple(s.data.shape) for s in att_got.addressable_shards}),
}))
"""


@FULL
def test_runs_per_device_in_a_shard_map_on_eight_fake_devices(tmp_path):
  """Under the trainer's tracing mesh (2 × 4 data × fsdp) the kernel plans and runs each
  device's own tokens, one device's tokens all routed to one expert (others empty there):
  the loss and the gradients of x, the combine weights and the experts equal the
  single-device ones. Attention runs one sequence per device."""
  r = results_on_host_devices(MESH_SCRIPT, tmp_path / "tokamax_mesh.py", 8)
  assert r["shard_map"] and r["max_diff"] < 1e-6  # relative to each leaf's largest entry
  assert r["attention_shard_map"] and r["attention_diff"] < 1e-5
  assert r["attention_shards"] == [[1, 128, 4, 8]]


@pytest.fixture(scope="module")
def h100():
  """One compile-only H100 (jax's CUDA plugin, the `cuda` extra; CI's full tier has it)."""
  if not aot.cuda_available() and not os.environ.get("MOEJAX_REQUIRE_GPU"):
    pytest.skip('no GPU compiler (pip install -e ".[cuda]"); CI sets MOEJAX_REQUIRE_GPU')
  return aot.gpu_devices("h100:1")[0]


def _gpu_program(device, fn, *shapes) -> str:
  """`fn`'s value and gradient compiled by XLA:GPU for `device`, traced with it as JAX's
  default device (so tokamax sees an sm90 GPU and takes its Mosaic kernels)."""
  sh = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
  with jax.default_device(device):
    grad = jax.value_and_grad(fn, argnums=tuple(range(len(args) - 1)))
    return jax.jit(grad).lower(*args).compile().as_text()


@FULL
def test_new_kernels_compile_for_an_h100_without_a_while_loop(h100):
  """Deviceless XLA:GPU, small shapes: tokamax's dropless layer is Mosaic GPU kernels,
  `batched` capacity has no loop where `fused` has one, tokamax attention is a kernel."""
  T, D, F, E, K, bf = 1024, 256, 128, 8, 2, jnp.bfloat16

  def moe(impl, mode):
    def loss(x, wg, wu, wd, e):
      w = jnp.full(e.shape, 0.5, jnp.float32)
      ex = expert_weights(wg, wu, wd)
      if mode == "dropless":
        y = dsp.dropless(x, e, w, ex, impl=impl)
      else:
        order = plans.drop_order("position", e, w, None, T)
        y, _ = dsp.capacity_dispatch(x, e, w, ex, cap=320, group_size=T, order=order, impl=impl)
      return jnp.sum(y.astype(jnp.float32) ** 2)

    return loss

  shapes = [((T, D), bf), ((E, D, F), bf), ((E, D, F), bf), ((E, F, D), bf), ((T, K), jnp.int32)]
  tok = _gpu_program(h100, moe("tokamax", "dropless"), *shapes)
  assert " while(" not in tok and tok.count('custom_call_target="mosaic_gpu') >= 6
  batched = _gpu_program(h100, moe("batched", "capacity"), *shapes)
  fused = _gpu_program(h100, moe("fused", "capacity"), *shapes)
  assert " while(" not in batched and " while(" in fused  # the check can fail
  qkv = [((2, 256, 4, 64), bf), ((2, 256, 2, 64), bf), ((2, 256, 2, 64), bf)]
  att = _gpu_program(h100, lambda q, k, v: jnp.sum(tokamax_attention(q, k, v) ** 2), *qkv)
  assert " while(" not in att and 'custom_call_target="mosaic_gpu' in att


def test_cache_miss_lines_are_kept_only_for_the_default_devices_own_ops():
  """tokamax's "Autotuning cache miss" line, shortened, once per op and device kind, and only
  for an op of the default device's platform: every host traces both accelerator branches."""
  import logging  # pylint: disable=import-outside-toplevel

  def record(op_name: str, kind: str) -> logging.LogRecord:
    op = type(op_name, (), {})()
    return logging.LogRecord("absl", logging.WARNING, "", 0, "Autotuning cache miss %s %s",
                             (op, kind), None)  # fmt: skip

  f = tokamax_ragged._CacheMisses()
  h100, v5e = "NVIDIA H100 80GB HBM3", "TPU v5 lite"
  kept = record("PallasMosaicGpuRaggedDot", h100)
  assert f.filter(kept) and kept.getMessage().startswith("tokamax PallasMosaicGpuRaggedDot on")
  assert not f.filter(record("PallasMosaicGpuRaggedDot", h100))  # once
  assert not f.filter(record("PallasTritonRaggedDot", v5e))
  assert not f.filter(record("PallasMosaicTpuRaggedDot", h100))
  assert f.filter(record("PallasMosaicTpuRaggedDot", v5e))
  assert not f.filter(record("PallasTritonRaggedDot", "cpu"))
