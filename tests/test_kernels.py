"""The expert-kernel table (`dispatch.KERNELS`) and `impl="auto"` per lowering platform:
the default train step exported for NVIDIA GPUs never holds XLA's densified ragged dot."""

import functools

import jax
import pytest
from jax import export

from failure_helpers import fast_compiles, tiny  # noqa: F401  (module-scoped fixture)
from moejax import dispatch as dsp
from moejax import sharding, trainer
from moejax import step as step_lib
from moejax.errors import UserError
from moejax.moe import MoEConfig


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
  for p in ("cpu", "cuda", "rocm"):
    assert dsp.resolve_impl("auto", "dropless", p) == "fused"
  assert dsp.resolve_impl("auto", "dropless", "tpu") == "megablox"
  assert all(dsp.resolve_impl("auto", "capacity", p) == "fused" for p in dsp.PLATFORMS)
  assert dsp.resolve_impl("ragged", "dropless", "cuda") == "ragged"


@pytest.mark.parametrize("impl", ["ragged", "megablox"])
def test_capacity_with_a_grouped_matmul_kernel_is_refused_in_one_line(impl):
  with pytest.raises(UserError, match=f"impl='{impl}' is not allowed with dispatch='capacity'"):
    MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=8, dispatch="capacity", impl=impl)


@functools.cache
def _exported(impl: str, platform: str) -> str:
  """StableHLO of the trainer's jitted train step (tiny config), exported for `platform`."""
  c = tiny(model__moe__impl=impl)
  run = trainer.build(c, workdir=None)
  lc = step_lib.LossConfig.from_config(c, n_shards=sharding.data_shards(run.mesh))
  step_fn = step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule)
  tokens = next(run.data.train_iterator())["tokens"]
  exp = export.export(jax.jit(step_fn), platforms=(platform,))(run.state, tokens, jax.random.key(0))
  return exp.mlir_module()


RAGGED_OP = "chlo.ragged_dot"  # what jax.lax.ragged_dot lowers to for XLA's rewriter


def test_default_train_step_exported_for_cuda_holds_no_ragged_dot():
  assert RAGGED_OP not in _exported("auto", "cuda")


def test_ragged_train_step_exported_for_cuda_holds_ragged_dot():
  """The counterpart, so the test above can fail."""
  assert RAGGED_OP in _exported("ragged", "cuda")


def test_default_train_step_exported_for_tpu_runs_the_megablox_kernel():
  text = _exported("auto", "tpu")
  assert "tpu_custom_call" in text and RAGGED_OP not in text
