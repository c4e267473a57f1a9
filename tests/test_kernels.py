"""The expert-kernel table (`dispatch.KERNELS`) and `impl="auto"` per lowering platform:
the default train step exported for NVIDIA GPUs never holds XLA's densified ragged dot."""

import functools
import os
import subprocess
import sys

import jax
import pytest
from failure_helpers import (  # noqa: F401  (fast_compiles: module-scoped fixture)
  fast_compiles,
  results_on_host_devices,
  tiny,
)
from jax import export
from requires import TOKAMAX, needs_tokamax
from tiers import FULL

from moejax import sharding
from moejax.backend import compat
from moejax.errors import UserError
from moejax.kernels import dispatch as dsp
from moejax.kernels import registry
from moejax.kernels.native import loader
from moejax.nn.moe import MoEConfig
from moejax.training import step as step_lib
from moejax.training import trainer
from runconfig import as_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_kernel_declares_backends_modes_and_a_description():
  assert dsp.IMPLS == ("auto", *dsp.KERNELS)
  assert {"fused", "blocked", "ragged", "megablox"} <= set(dsp.KERNELS)
  for name, k in dsp.KERNELS.items():
    assert k.backends and set(k.backends) <= set(dsp.PLATFORMS), name
    assert k.modes and set(k.modes) <= set(dsp.MODES), name
    assert k.description, name
    assert k.plan in registry.PLANS, name


def test_auto_is_a_lookup_per_platform_and_never_ragged_off_tpu():
  assert dsp.resolve_impl("auto", "dropless", "rocm") == "fused"
  cpu = "native" if loader.load() is None else "fused"  # native where built (test_native.py)
  assert all(dsp.resolve_impl("auto", m, "cpu") == cpu for m in dsp.MODES)
  cuda = "tokamax" if TOKAMAX else "fused"  # tokamax: the cuda extra
  assert dsp.resolve_impl("auto", "dropless", "cuda") == cuda
  assert dsp.resolve_impl("auto", "dropless", "tpu") == "megablox"
  assert dsp.resolve_impl("auto", "capacity", "cuda") == "batched"
  assert all(dsp.resolve_impl("auto", "capacity", p) == "fused" for p in ("rocm", "tpu"))
  assert dsp.resolve_impl("ragged", "dropless", "cuda") == "ragged"
  for mode, table in dsp.AUTO.items():  # auto only picks a kernel that serves the mode
    assert all(mode in dsp.KERNELS[name].modes for name in table.values()), mode


def test_preload_loads_what_impl_can_take_and_leaves_import_errors_to_the_trace(monkeypatch):
  """registry.preload (called when a MoE block is built): every platform's `auto` kernel
  that can run here, once each; an explicit impl alone; a library that fails to import is
  not raised here (the trace's kernel_run reports it)."""
  loaded = []

  def broken():
    raise ImportError("tokamax: a broken install")

  fake = {n: k._replace(load=functools.partial(loaded.append, n)) for n, k in dsp.KERNELS.items()}
  fake = {n: k._replace(missing=lambda: None) for n, k in fake.items()}
  fake["tokamax"] = fake["tokamax"]._replace(load=broken)
  fake["megablox"] = fake["megablox"]._replace(missing=lambda: "not installed")
  monkeypatch.setattr(registry, "KERNELS", fake)
  registry.preload.__wrapped__("auto", "dropless")  # AUTO: native, tokamax, fused, megablox
  assert loaded == ["native", "fused"]
  loaded.clear()
  registry.preload.__wrapped__("blocked", "dropless")
  assert loaded == ["blocked"]
  loaded.clear()  # a model built under a CPU mesh (the trainer's) loads CPU's kernels only
  registry.preload.__wrapped__("auto", "dropless", ("cpu",))
  assert loaded == ["native"]
  loaded.clear()
  registry.preload.__wrapped__("auto", "dropless", ("cuda", "rocm"))
  assert loaded == ["fused"]  # cuda's tokamax fails to import here; rocm's fused loads


def test_a_cpu_training_process_imports_no_gpu_or_tpu_kernel_library():
  """The trainer builds its model under its CPU mesh: tokamax and megablox stay unimported
  (issue 61: 1.9 s of a CPU run's startup), while the meshless build imports every one."""
  code = (
    "import sys, jax\n"
    "from moejax.training import trainer\n"
    "from runconfig import as_run\n"
    "from failure_helpers import tiny\n"
    "rc = as_run(tiny())\n"
    "trainer.build(rc, None)\n"
    "print(sorted(m for m in ('tokamax', 'moejax.kernels.megablox') if m in sys.modules))\n"
  )
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     timeout=300, check=False)  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout


@pytest.mark.parametrize("impl", ["ragged", "megablox"])
def test_capacity_with_a_grouped_matmul_kernel_is_refused_in_one_line(impl):
  with pytest.raises(UserError, match=f"impl='{impl}' is not allowed with dispatch='capacity'"):
    MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=8, dispatch="capacity", impl=impl)


@functools.cache
def _exported(impl: str, platform: str) -> str:
  """StableHLO of the trainer's jitted train step (tiny config), exported for `platform`."""
  c = tiny(model__moe__impl=impl)
  run = trainer.build(as_run(c), workdir=None)
  lc = as_run(c).with_shards(sharding.data_shards(run.mesh)).loss
  step_fn = step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule)
  tokens = next(run.data.train_iterator())["tokens"]
  with compat.lowering_for((platform,)):
    exp = export.export(
      jax.jit(step_fn), platforms=(platform,), disabled_checks=dsp.export_disabled_checks()
    )(run.state, tokens, jax.random.key(0))
  return exp.mlir_module()


RAGGED_OP = "chlo.ragged_dot"  # what jax.lax.ragged_dot lowers to for XLA's rewriter


@needs_tokamax
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


LAZY_SCRIPT = """
import sys
import jax, jax.numpy as jnp
{block}
import moejax.kernels.dispatch, moejax.nn.moe, moejax.nn.model
from moejax.kernels import dispatch as dsp

def loaded():
  kernels = ("jax.experimental.pallas", "moejax.kernels.megablox",
             "moejax.kernels.tokamax_ragged", "moejax.kernels.native.kernel")
  mods = [m for m, mod in sys.modules.items()  # None: a module hidden as not installed
          if mod is not None and (m.split(".")[0] == "tokamax" or m.startswith(kernels))]
  so = "_moejax_native" in open("/proc/self/maps").read()
  return sorted({{m.split(".")[0] if m.startswith("tokamax") else m for m in mods}}) + ["so"] * so

print("imported:", loaded())
if {trace}:
  pass
else:
  sys.exit(0)
x, e, w = jnp.ones((8, 4)), jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2))
ex = dsp.ExpertWeights(jnp.ones((2, 4, 8)), jnp.ones((2, 4, 4)))
y = jax.eval_shape(lambda *a: dsp.dropless(*a), x, e, w, ex)  # auto: every platform's branch
print("traced:", loaded(), y.shape)
for impl in ("tokamax", "native"):
  try:
    dsp.check_runnable(impl)
    print(impl, "runs")
  except Exception as err:
    print(impl, "refused:", type(err).__name__, err)
if "tokamax" in sys.modules and sys.modules["tokamax"] is None:  # hidden: describe --gpu
  from moejax.aot import targets
  try:
    targets.gpu_devices("h100:8")
  except Exception as err:
    print("gpu refused:", type(err).__name__, err)
"""


def _lazy_script(block: str = "", trace: bool = True) -> list[str]:
  code = LAZY_SCRIPT.format(block=block, trace=trace)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return out.stdout.splitlines()


def test_importing_the_model_imports_no_kernel_library():
  """`import moejax.nn.model` (and nn.moe, kernels.dispatch) imports no kernel module and
  no kernel library: no tokamax, no Pallas kernel, native `.so` not loaded (the full-tier
  test below shows a trace importing them, so this can fail)."""
  assert _lazy_script(trace=False) == ["imported: []"]


@FULL
def test_kernel_libraries_load_when_a_program_using_them_is_traced():
  """Tracing `auto` with no context mesh traces every platform's branch: that imports them."""
  lines = _lazy_script()
  assert lines[0] == "imported: []", lines
  traced = lines[1]
  for name in ("moejax.kernels.megablox", "jax.experimental.pallas", "'so'"):
    assert name in traced, traced
  assert ("tokamax" in traced) == TOKAMAX and traced.endswith("(8, 4)"), traced


def test_without_tokamax_auto_runs_fused_for_cuda_and_tokamax_is_one_user_error():
  """tokamax hidden (the cuda extra not installed): the model imports and traces, `auto`'s
  CUDA branch is `fused` (one log line), and `impl=tokamax` is one line naming the key and
  the extra."""
  lines = _lazy_script("sys.modules['tokamax'] = None  # as if not installed")
  assert lines[0] == "imported: []" and "tokamax" not in lines[1], lines
  refused = lines[2]
  assert refused.startswith("tokamax refused: UserError model.moe.impl='tokamax'"), refused
  assert "moejax[cuda]" in refused and "'fused'" in refused, refused
  gpu = lines[-1]  # describe --gpu: one line naming the extra, whatever else is missing
  assert gpu.startswith("gpu refused: UserError --gpu h100:8 needs the cuda extra"), lines
  assert "tokamax" in gpu and ".[cuda]" in gpu, gpu
  assert dsp.resolve_impl("auto", "dropless", "cuda") == ("tokamax" if TOKAMAX else "fused")
