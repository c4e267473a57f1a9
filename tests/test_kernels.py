"""The expert-kernel table (`dispatch.KERNELS`) and `impl="auto"` per lowering platform:
the default train step exported for NVIDIA GPUs never holds XLA's densified ragged dot."""

import functools

import jax
import pytest
from failure_helpers import (  # noqa: F401  (fast_compiles: module-scoped fixture)
  fast_compiles,
  results_on_host_devices,
  tiny,
)
from jax import export

from moejax import build, compat, sharding
from moejax.errors import UserError
from moejax.kernels import dispatch as dsp
from moejax.nn.moe import MoEConfig
from moejax.training import step as step_lib
from moejax.training import trainer


def test_every_kernel_declares_backends_modes_and_a_description():
  assert dsp.IMPLS == ("auto", *dsp.KERNELS)
  assert {"fused", "blocked", "ragged", "megablox"} <= set(dsp.KERNELS)
  for name, k in dsp.KERNELS.items():
    assert k.backends and set(k.backends) <= set(dsp.PLATFORMS), name
    assert k.modes and set(k.modes) <= set(dsp.MODES), name
    assert k.description, name
  lines = dsp.describe_kernels()
  assert len(lines) == len(dsp.KERNELS) and lines[0].startswith("fused: ")


def test_auto_is_a_lookup_per_platform_and_never_ragged_off_tpu():
  assert dsp.resolve_impl("auto", "dropless", "rocm") == "fused"
  assert dsp.CPU_AUTO in ("native", "fused")  # native where built (tests/test_native.py)
  assert all(dsp.resolve_impl("auto", m, "cpu") == dsp.CPU_AUTO for m in dsp.MODES)
  assert dsp.resolve_impl("auto", "dropless", "cuda") == "tokamax"
  assert dsp.resolve_impl("auto", "dropless", "tpu") == "megablox"
  assert dsp.resolve_impl("auto", "capacity", "cuda") == "batched"
  assert all(dsp.resolve_impl("auto", "capacity", p) == "fused" for p in ("rocm", "tpu"))
  assert dsp.resolve_impl("ragged", "dropless", "cuda") == "ragged"
  for mode, table in dsp.AUTO.items():  # auto only picks a kernel that serves the mode
    assert all(mode in dsp.KERNELS[name].modes for name in table.values()), mode


@pytest.mark.parametrize("impl", ["ragged", "megablox"])
def test_capacity_with_a_grouped_matmul_kernel_is_refused_in_one_line(impl):
  with pytest.raises(UserError, match=f"impl='{impl}' is not allowed with dispatch='capacity'"):
    MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=8, dispatch="capacity", impl=impl)


@functools.cache
def _exported(impl: str, platform: str) -> str:
  """StableHLO of the trainer's jitted train step (tiny config), exported for `platform`."""
  c = tiny(model__moe__impl=impl)
  run = trainer.build(c, workdir=None)
  lc = build.loss_config(c, n_shards=sharding.data_shards(run.mesh))
  step_fn = step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule)
  tokens = next(run.data.train_iterator())["tokens"]
  with compat.lowering_for((platform,)):
    exp = export.export(
      jax.jit(step_fn), platforms=(platform,), disabled_checks=dsp.EXPORT_DISABLED_CHECKS
    )(run.state, tokens, jax.random.key(0))
  return exp.mlir_module()


RAGGED_OP = "chlo.ragged_dot"  # what jax.lax.ragged_dot lowers to for XLA's rewriter


def test_default_train_step_exported_for_cuda_holds_no_ragged_dot():
  """`auto` on CUDA is tokamax's grouped matmuls (Triton kernels, traced on a host without a
  GPU), not XLA's densified ragged dot."""
  text = _exported("auto", "cuda")
  assert RAGGED_OP not in text and "__gpu$xla.gpu.triton" in text


def test_ragged_train_step_exported_for_cuda_holds_ragged_dot():
  """The counterpart, so the test above can fail."""
  assert RAGGED_OP in _exported("ragged", "cuda")


def test_default_train_step_exported_for_tpu_runs_the_megablox_kernel():
  text = _exported("auto", "tpu")
  assert "tpu_custom_call" in text and RAGGED_OP not in text


MEGABLOX_MESH_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from moejax import sharding
from moejax.kernels import dispatch as dsp
mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 1), ("data", "fsdp", "expert"))
r = np.random.default_rng(0)
T, D, F, E, K = 64, 16, 8, 4, 2
x = jnp.asarray(r.normal(size=(T, D)), jnp.float32)
e = jnp.asarray(np.argsort(-r.normal(size=(T, E)), -1)[:, :K], jnp.int32)
w = jnp.asarray(r.uniform(0.1, 1, size=(T, K)), jnp.float32)
W = dsp.ExpertWeights(*(jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
                        for s in [(E, D, 2 * F), (E, F, D)]))
f = lambda x, e, w, W: dsp.dropless(x, e, w, W, impl="megablox")
want = jax.jit(f)(x, e, w, W)
rows = NamedSharding(mesh, P(("data", "fsdp")))
xs, es, ws = (jax.device_put(a, rows) for a in (x, e, w))
traced = sharding.tracing_mesh(f, mesh)
got = jax.jit(traced)(xs, es, ws, W)
print("RESULTS " + json.dumps({
  "shard_map": "shard_map" in str(jax.make_jaxpr(traced)(xs, es, ws, W)),
  "max_diff": float(jnp.abs(got - want).max()),
}))
"""


def test_megablox_runs_per_device_in_a_shard_map_under_the_tracing_mesh(tmp_path):
  """A Mosaic kernel cannot be partitioned by GSPMD: under the trainer's tracing mesh the
  megablox kernel plans and runs each device's own tokens (4 host devices, 2 x 2 data x
  fsdp), with the single-device result."""
  r = results_on_host_devices(MEGABLOX_MESH_SCRIPT, tmp_path / "megablox_mesh.py", 4)
  assert r["shard_map"] and r["max_diff"] < 1e-5
