"""`moejax.backend.platforms`: branches traced for the context mesh's platform only."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax import sharding
from moejax.backend import compat, platforms


def _branches(traced: list[str]) -> dict:
  """Branches that record their tracing and compute distinct functions."""

  def branch(name, scale):
    def fn(x):
      traced.append(name)
      return x * scale

    return fn

  return {"cpu": branch("cpu", 2.0), "tpu": branch("tpu", 3.0), "cuda": branch("cuda", 5.0)}


def _cpu_mesh():
  return compat.mesh(np.array(jax.devices()[:1]), ("data",))


def test_without_a_context_mesh_every_branch_is_traced():
  traced = []
  y = jax.jit(lambda x: platforms.platform_dependent(x, **_branches(traced)))(jnp.ones(3))
  assert sorted(traced) == ["cpu", "cuda", "tpu"]
  np.testing.assert_array_equal(np.asarray(y), 2.0 * np.ones(3))


def test_under_a_cpu_mesh_only_the_cpu_branch_is_traced():
  traced = []
  fn = sharding.tracing_mesh(
    lambda x: platforms.platform_dependent(x, **_branches(traced)), _cpu_mesh()
  )
  jaxpr = jax.make_jaxpr(fn)(jnp.ones(3))
  assert traced == ["cpu"]
  assert "platform_index" not in str(jaxpr)
  np.testing.assert_array_equal(np.asarray(jax.jit(fn)(jnp.ones(3))), 2.0 * np.ones(3))


def test_default_serves_a_platform_without_its_own_branch():
  traced = []
  branches = _branches(traced)
  cpu = branches.pop("cpu")

  def fn(x):
    return platforms.platform_dependent(x, default=cpu, **branches)

  y = jax.jit(sharding.tracing_mesh(fn, _cpu_mesh()))(jnp.ones(3))
  assert traced == ["cpu"]  # `cpu` is the default's name here
  np.testing.assert_array_equal(np.asarray(y), 2.0 * np.ones(3))


def test_a_gpu_context_keeps_the_cuda_and_rocm_branches():
  """JAX names CUDA and ROCm devices alike ("gpu"): both stay, in a platform_dependent."""
  traced = []
  branches = {**_branches(traced), "rocm": lambda x: (traced.append("rocm"), x * 7.0)[1]}
  with compat.gpu_target():
    assert platforms.context_platforms() == ("cuda", "rocm")
    jaxpr = jax.make_jaxpr(lambda x: platforms.platform_dependent(x, **branches))(jnp.ones(3))
  assert sorted(traced) == ["cuda", "rocm"]
  assert "platform_index" in str(jaxpr)


def test_the_lowering_platform_is_the_context_meshs_else_the_default_backends():
  assert platforms.lowering_platform() == jax.default_backend() == "cpu"
  with compat.gpu_target():
    assert platforms.lowering_platform() == "gpu"
  seen = []
  fn = sharding.tracing_mesh(
    lambda x: (seen.append(platforms.lowering_platform()), x)[1], _cpu_mesh()
  )
  jax.make_jaxpr(fn)(jnp.ones(3))
  assert seen == ["cpu"]
