"""The `batched` capacity kernel (moejax/kernels/batched.py): capacity mode as one batched
einsum per projection, no loop.

It must be `fused` in capacity mode: the same kept assignments (same drop order, same C),
values and gradients equal to float32 rounding, on every drop policy, with routing groups
and a GShard random second expert; and both against the naive per-token loop on the kept
assignments (tests/test_dispatch.py's, an independent reference). Its compiled program has
no while loop, where `fused` has its per-block loop.

Bitwise equality of the values is not a property two float32 programs with different
matmul shapes have on XLA:CPU: one einsum `gecd,edf->gecf` and the same [C, D] x [D, F]
dots block by block differ in most elements already, with no MoE code
(`python benchmarks/capacity_rounding.py`, docs/dispatch.md), and `fused`'s custom VJP sums
dW block by block. So the drops are compared bitwise and the values to 1e-6 of their scale.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dispatch import _check_grads, _naive_grads, make_case, naive_moe
from expert_weights import expert_weights

from moejax.errors import UserError
from moejax.kernels import dispatch as dsp
from moejax.kernels import plans
from moejax.nn.moe import MoEConfig

T, E = 64, 8


@functools.cache
def _grad_fn(impl: str, policy: str, K: int, group: int, factor: float, random_second: bool):
  def loss(x, W, r, experts, scores, g, rng):
    cap = plans.capacity(factor, K, group, E, min_capacity=2)
    order = plans.drop_order(policy, experts, r, scores, group)
    keep = plans.random_second_expert(r, rng) if random_second else None
    y, kept = dsp.capacity_dispatch(
      x, experts, r, expert_weights(*W), cap=cap, group_size=group, order=order,
      keep_TxK=keep, impl=impl,
    )  # fmt: skip
    return jnp.sum(g * y), (y, kept)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# each ~5-15 s of compiles on 2 cores; one case stays in the default tier
FULL = pytest.mark.full
CASES = [
  ("position", 2, 16, 1.25, False),
  pytest.param("position", 2, T, 1.0, False, marks=FULL),
  pytest.param("batch_priority", 2, 32, 1.0, False, marks=FULL),
  pytest.param("weight", 2, 16, 1.0, False, marks=FULL),
  pytest.param("position", 1, 32, 1.0, False, marks=FULL),
  pytest.param("position", 4, T, 0.5, False, marks=FULL),
  pytest.param("position", 2, 32, 1.0, True, marks=FULL),
]


def _args(K: int):
  x, experts, weights, W = make_case(T, E, K, seed=11, skew=True)
  scores = np.random.default_rng(12).uniform(size=(T, E)).astype(np.float32)
  g = np.random.default_rng(13).normal(size=x.shape).astype(np.float32)
  return x, W, weights, experts, scores, g, jax.random.key(3)


@functools.cache
def _compiled(impl: str, case: tuple):
  """The case's value-and-grad compiled once (run by one test, read by another)."""
  return _grad_fn(impl, *case).lower(*_args(case[1])).compile()


@pytest.mark.parametrize("policy,K,group,factor,random_second", CASES)
def test_batched_equals_fused_and_the_naive_loop(policy, K, group, factor, random_second):
  case = (policy, K, group, factor, random_second)
  args = _args(K)
  x, W, weights, experts, _, g, _ = args
  (_, (y0, kept0)), grads0 = _compiled("fused", case)(*args)
  (_, (y, kept)), grads = _compiled("batched", case)(*args)
  kept = np.asarray(kept)
  np.testing.assert_array_equal(kept, kept0)  # the same drops
  assert 0 < kept.sum() < kept.size  # the case really drops something
  scale = np.abs(np.asarray(y0)).max()
  np.testing.assert_allclose(y, y0, rtol=0, atol=1e-6 * scale)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(np.asarray(b)).max())
  np.testing.assert_allclose(y, naive_moe(x, experts, weights, W, kept), atol=1e-5, rtol=1e-5)
  _check_grads(grads, _naive_grads(x, experts, weights, W, g, kept), experts[kept])


def test_batched_compiles_to_no_while_loop_and_fused_to_one_per_block():
  """The default tier's case, forward and backward: no while loop in `batched`'s program."""
  texts = {impl: _compiled(impl, CASES[0]).as_text() for impl in ("batched", "fused")}
  assert " while(" not in texts["batched"]
  assert " while(" in texts["fused"]  # the counterpart, so the check can fail


@FULL
def test_bf16_in_bf16_out():
  K, group = 2, 32
  x, experts, weights, W = make_case(T, E, K, seed=2)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  cap = plans.capacity(1.0, K, group, E, 2)
  order = plans.drop_order("position", experts, weights, None, group)
  y, kept = jax.jit(
    lambda x, W: dsp.capacity_dispatch(
      x, experts, weights, expert_weights(*W), cap=cap, group_size=group, order=order,
      impl="batched",
    )
  )(bf(x), tuple(map(bf, W)))  # fmt: skip
  assert y.dtype == jnp.bfloat16
  want = naive_moe(x, experts, weights, W, np.asarray(kept))
  assert np.abs(np.asarray(y, np.float32) - want).max() < 0.03 * np.abs(want).max()


def test_dropless_with_batched_is_refused_in_one_line():
  with pytest.raises(UserError, match="impl='batched' is not allowed with dispatch='dropless'"):
    MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=8, dispatch="dropless", impl="batched")
