"""Dropless dispatch is exact: forward and gradients against a per-token reference on skewed
routings (including every token to one expert), and the plan's sort and block cover."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from expert_weights import expert_weights

from moejax.kernels import dispatch as dsp
from moejax.kernels import plans

T, D, F, E, BLOCK = 64, 8, 6, 4, 4


def reference(x_TxD, experts_TxK, weights_TxK, wg, wu, wd):
  """y[t] = Σ_k r_tk · SwiGLU_{e_tk}(x[t]), each assignment with its own gathered weights:
  no sorting, no blocks, no padding."""
  g = jnp.einsum("td,tkdf->tkf", x_TxD, wg[experts_TxK])
  u = jnp.einsum("td,tkdf->tkf", x_TxD, wu[experts_TxK])
  y = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(g) * u, wd[experts_TxK])
  return jnp.einsum("tkd,tk->td", y, weights_TxK)


def _loss(fn, g_TxD):
  return lambda x, W, e, r: jnp.sum(g_TxD * fn(x, e, r, *W))


@functools.cache
def _grad_fns(impl, K):
  g_TxD = jnp.asarray(np.random.default_rng(7).normal(size=(T, D)), jnp.float32)
  ours = lambda x, e, r, *W: dsp.dropless(x, e, r, expert_weights(*W), impl=impl, block=BLOCK)
  grad = lambda fn: jax.jit(jax.value_and_grad(_loss(fn, g_TxD), argnums=(0, 1, 3)))
  return grad(ours), grad(reference)


def routing(kind, K, seed=0):
  r = np.random.default_rng(seed)
  logits = r.normal(size=(T, E))
  if kind == "skewed":
    logits[:, 0] += 4.0
  experts = np.argsort(-logits, axis=1)[:, :K]
  if kind == "all_to_one":  # every token's first choice is expert 2
    rest = np.array([e for e in range(E) if e != 2])
    experts[:, 0] = 2
    experts[:, 1:] = np.stack([r.permutation(rest)[: K - 1] for _ in range(T)])
  if kind == "all_to_same_set":  # every expert in {1, 3} gets every token
    experts = np.tile(np.array([3, 1]), (T, 1))
  return experts.astype(np.int32), r.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)


def _case(seed=1):
  r = np.random.default_rng(seed)
  x = r.normal(size=(T, D)).astype(np.float32)
  W = tuple(r.normal(size=s).astype(np.float32) * 0.5 for s in [(E, D, F), (E, D, F), (E, F, D)])
  return jnp.asarray(x), tuple(jnp.asarray(w) for w in W)


@pytest.mark.parametrize(
  "impl,K,kind",
  [
    ("fused", 2, "random"),
    ("fused", 2, "skewed"),
    ("fused", 2, "all_to_one"),
    ("fused", 2, "all_to_same_set"),
    ("fused", 1, "all_to_one"),
    ("blocked", 2, "random"),
    ("blocked", 2, "skewed"),
    ("blocked", 2, "all_to_one"),
    ("blocked", 2, "all_to_same_set"),
    ("blocked", 1, "all_to_one"),
    ("ragged", 2, "all_to_one"),
    # megablox in Pallas interpret mode (the TPU kernel's own code, run on CPU)
    ("megablox", 2, "random"),
    ("megablox", 2, "skewed"),
    ("megablox", 2, "all_to_one"),
    ("megablox", 2, "all_to_same_set"),
    ("megablox", 1, "all_to_one"),
  ],
)
def test_dropless_forward_and_gradients_match_per_token_reference(impl, K, kind):
  x, W = _case()
  experts, weights = routing(kind, K)
  ours, ref = _grad_fns(impl, K)
  (val, (dx, dW, dr)) = ours(x, W, experts, weights)
  (ref_val, (ref_dx, ref_dW, ref_dr)) = ref(x, W, experts, weights)
  np.testing.assert_allclose(val, ref_val, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dr, ref_dr, rtol=1e-4, atol=1e-4)
  used = np.unique(experts)
  for name, got, want in zip(("gate", "up", "down"), dW, ref_dW):
    for e in range(E):  # per expert, so one wrong expert cannot hide under a global tolerance
      if e in used:
        err = np.linalg.norm(got[e] - want[e]) / np.linalg.norm(want[e])
        assert err < 1e-5, (name, e, err)
      else:
        assert np.abs(np.asarray(got[e])).max() == 0.0, (name, e)


def test_dropless_forward_values_match_reference():
  x, W = _case(seed=5)
  experts, weights = routing("skewed", 2, seed=5)
  y = jax.jit(lambda *a: dsp.dropless(*a[:3], expert_weights(*a[3:]), block=BLOCK))(
    x, experts, weights, *W
  )
  np.testing.assert_allclose(y, reference(x, experts, weights, *W), rtol=1e-5, atol=1e-5)


def test_sort_by_expert_is_a_stable_argsort():
  e_A = np.random.default_rng(0).integers(0, 5, size=300).astype(np.int32)
  order, e_sorted = plans.sort_by_expert(jnp.asarray(e_A), 5)
  np.testing.assert_array_equal(order, np.argsort(e_A, kind="stable"))
  np.testing.assert_array_equal(e_sorted, np.sort(e_A))


@pytest.mark.parametrize("block,A,E", [(32, 16384, 64), (32, 4096, 8), (4, 128, 4), (32, 40, 8)])
def test_block_sizes_chain_and_cover(block, A, E):
  sizes = plans.block_sizes(block, A, E)
  assert sizes[-1] == block
  assert all(a % b == 0 for a, b in itertools.pairwise(sizes))
  assert sizes[0] <= max(A // E, block)
  if A // E >= 4 * block:  # an expert of average load takes at most a few large blocks
    assert sizes[0] * 4 > A // E


def test_plan_blocks_cover_each_expert_run_exactly_once():
  experts, _ = routing("all_to_one", 2)
  sizes = plans.block_sizes(BLOCK, experts.size, E)
  plan, blocks, counts = plans.dropless_plan(jnp.asarray(experts), E, sizes)
  owner = np.full(plan.token_of_R.shape[0], -1)
  for size, blk in zip(sizes, blocks):
    for i in range(int(blk.n_used)):
      s = int(blk.start_N[i])
      assert (owner[s : s + size] == -1).all()  # no row computed twice
      owner[s : s + size] = int(blk.expert_N[i])
  row_of_A = np.asarray(plan.row_of_A)
  np.testing.assert_array_equal(owner[row_of_A], experts.reshape(-1))
  np.testing.assert_array_equal(counts, np.bincount(experts.reshape(-1), minlength=E))
