"""Dispatch vs independent NumPy references: naive per-token loops and priority policies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from expert_weights import expert_weights

from moejax.errors import UserError
from moejax.kernels import dispatch as dsp
from moejax.kernels import plans
from moejax.kernels.permute import gather_sum, take_rows

D, F = 8, 6


def _silu(a):
  return a / (1.0 + np.exp(-a))


def naive_moe(x, experts, weights, W, kept=None):
  """y[t] = Σ_k r_tk · SwiGLU_{e_tk}(x[t]) over kept assignments, a plain float64 loop."""
  wg, wu, wd = (np.asarray(w, np.float64) for w in W)
  x = np.asarray(x, np.float64)
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(experts.shape[1]):
      if kept is not None and not kept[t, j]:
        continue
      e = experts[t, j]
      h = _silu(x[t] @ wg[e]) * (x[t] @ wu[e])
      y[t] += weights[t, j] * (h @ wd[e])
  return y


def make_case(T, E, K, seed=0, skew=False):
  r = np.random.default_rng(seed)
  x = r.normal(size=(T, D)).astype(np.float32)
  W = tuple(r.normal(size=s).astype(np.float32) * 0.5 for s in [(E, D, F), (E, D, F), (E, F, D)])
  logits = r.normal(size=(T, E))
  if skew:  # most tokens pick expert 0 first: stresses padding of one long run
    logits[:, 0] += 5.0
  experts = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
  weights = r.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
  return x, experts, weights, W


@functools.cache
def _dropless_fn(impl, block):
  f = lambda x, e, w, W: dsp.dropless(x, e, w, expert_weights(*W), impl=impl, block=block)
  return jax.jit(f)


@pytest.mark.parametrize(
  "impl,block", [("fused", 4), ("fused", 16), ("blocked", 4), ("blocked", 16), ("ragged", 1)]
)
@pytest.mark.parametrize("E,K,skew", [(8, 2, False), (16, 4, True), (4, 1, False)])
def test_dropless_matches_naive_loop(impl, block, E, K, skew):
  x, experts, weights, W = make_case(48, E, K, skew=skew)
  y = _dropless_fn(impl, block)(x, experts, weights, W)
  np.testing.assert_allclose(y, naive_moe(x, experts, weights, W), atol=1e-5, rtol=1e-5)


def _naive_grads(x, experts, weights, W, g, kept=None):
  """Gradients of Σ g·y from the naive loop, by hand (float64): dx, per-expert weight
  gradients and d r (each assignment's combine weight). Unkept assignments add nothing."""
  wg, wu, wd = (np.asarray(w, np.float64) for w in W)
  dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
  dx, dr = np.zeros(x.shape), np.zeros(weights.shape)
  for t in range(x.shape[0]):
    for j in range(experts.shape[1]):
      if kept is not None and not kept[t, j]:
        continue
      e, r = experts[t, j], weights[t, j]
      a, b = x[t] @ wg[e], x[t] @ wu[e]
      sig = 1 / (1 + np.exp(-a))
      h = a * sig * b
      dr[t, j] = g[t] @ (h @ wd[e])
      dy = r * g[t]
      dwd[e] += np.outer(h, dy)
      dh = wd[e] @ dy
      db = dh * a * sig
      da = dh * b * sig * (1 + a * (1 - sig))
      dwg[e] += np.outer(x[t], da)
      dwu[e] += np.outer(x[t], db)
      dx[t] += wg[e] @ da + wu[e] @ db
  return dx, (dwg, dwu, dwd), dr


def _check_grads(got, want, experts):
  """dx and d r globally; expert weights relative per expert (a global atol could hide one
  wrong expert)."""
  (dx, dW, dr), (ref_dx, ref_dW, ref_dr) = got, want
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dr, ref_dr, rtol=1e-4, atol=1e-5)
  used = np.unique(experts)
  for name, got_w, want_w in zip(("gate", "up", "down"), dW, ref_dW):
    for e in range(want_w.shape[0]):
      err = np.linalg.norm(got_w[e] - want_w[e]) / max(np.linalg.norm(want_w[e]), 1e-12)
      assert err < 1e-4 if e in used else np.all(got_w[e] == 0), (name, e, err)


@pytest.mark.parametrize(
  "impl,block", [("fused", 4), ("blocked", 4), ("ragged", 1), ("megablox", 1)]
)
def test_dropless_gradients_per_expert(impl, block):
  E, K = 8, 2
  x, experts, weights, W = make_case(40, E, K, seed=3, skew=True)
  g = np.random.default_rng(9).normal(size=x.shape).astype(np.float32)
  loss = lambda x, W, r: jnp.sum(
    g * dsp.dropless(x, experts, r, expert_weights(*W), impl=impl, block=block)
  )
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, W, weights)
  _check_grads(got, _naive_grads(x, experts, weights, W, g), experts)


@pytest.mark.parametrize("impl", ["fused", "blocked"])
def test_capacity_gradients_match_naive_loop_on_kept_assignments(impl):
  T, E, K, group = 32, 4, 2, 16
  x, experts, weights, W = make_case(T, E, K, seed=5, skew=True)
  g = np.random.default_rng(4).normal(size=x.shape).astype(np.float32)
  cap = plans.capacity(1.0, K, group, E, min_capacity=2)
  order = plans.drop_order("position", experts, weights, None, group)

  def loss(x, W, r):
    y, kept = dsp.capacity_dispatch(
      x, experts, r, expert_weights(*W), cap=cap, group_size=group, order=order, impl=impl
    )
    return jnp.sum(g * y), kept

  got, kept = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, W, weights)
  kept = np.asarray(kept)
  assert 0 < kept.sum() < kept.size  # the case really drops something
  _check_grads(got, _naive_grads(x, experts, weights, W, g, kept), experts)


def ref_capacity_keep(experts, sort_key, E, cap, group_size, keep=None):
  """Which assignments survive: per group and expert, the first `cap` by `sort_key(t, j)`.
  Assignments with keep False (an unsampled GShard second choice) are no candidates."""
  T, K = experts.shape
  kept = np.zeros((T, K), bool)
  for g0 in range(0, T, group_size):
    cands = [(t, j) for t in range(g0, g0 + group_size) for j in range(K)]
    cands = [(t, j) for t, j in cands if keep is None or keep[t, j]]
    for e in range(E):
      mine = sorted((tj for tj in cands if experts[tj] == e), key=lambda tj: sort_key(*tj))
      for t, j in mine[:cap]:
        kept[t, j] = True
  return kept


def ref_sort_key(policy, group_size, top1=None, weights=None):
  """Each policy's order, written from its source's definition (ties: token order)."""
  K = 2 if weights is None else weights.shape[1]
  if policy == "position":  # Switch/GShard: first choices first, then earlier tokens
    return lambda t, j: (j, t % group_size)
  if policy == "batch_priority":  # V-MoE: first choices first, then tokens by top-1 gate
    return lambda t, j: (j, -top1[t], t % group_size)
  return lambda t, j: (-weights[t, j], (t % group_size) * K + j)  # Megatron "probs"


def _kept(policy, experts, weights, scores, cap, group_size, keep=None):
  E = scores.shape[1]
  order = plans.drop_order(
    policy, jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(scores), group_size
  )
  keep = None if keep is None else jnp.asarray(keep)
  plan = plans.capacity_plan(jnp.asarray(experts), order, E, cap, group_size, keep)
  return np.asarray(plan.kept_A).reshape(experts.shape)


# A hand-worked case: 4 tokens, top-2 of 2 experts, capacity 2 per expert.
HAND_EXPERTS = np.array([[0, 1], [1, 0], [0, 1], [0, 1]], np.int32)
HAND_WEIGHTS = np.array([[0.5, 0.3], [0.6, 0.35], [0.9, 0.05], [0.7, 0.2]], np.float32)


def _hand_scores():
  """Router scores whose top-1 entries are the first column of HAND_WEIGHTS."""
  s = np.zeros((4, 2), np.float32)
  for t in range(4):
    s[t, HAND_EXPERTS[t, 0]] = HAND_WEIGHTS[t, 0]
    s[t, HAND_EXPERTS[t, 1]] = HAND_WEIGHTS[t, 1]
  return s


# Worked by hand from each definition (rows: tokens t0..t3; columns: 1st, 2nd choice):
#  position: expert 0 takes the first choices of t0, t2 (t3's is 3rd in line; t1's second
#    choice comes after all firsts); expert 1 takes t1's first, then t0's second.
#  batch_priority: top-1 gates order the tokens t2 (.9), t3 (.7), t1 (.6), t0 (.5); expert 0
#    takes the firsts of t2, t3; expert 1 takes t1's first, then t2's second (t2 leads).
#  weight: expert 0 keeps its two largest weights (t2 .9, t3 .7); expert 1 keeps t1 .6 and
#    t0 .3 (t3 .2 and t2 .05 drop), whatever the choice rank.
HAND_KEPT = {
  "position": [[1, 1], [1, 0], [1, 0], [0, 0]],
  "batch_priority": [[0, 0], [1, 0], [1, 1], [1, 0]],
  "weight": [[0, 1], [1, 0], [1, 0], [1, 0]],
}


@pytest.mark.parametrize("policy", sorted(HAND_KEPT))
def test_drop_policy_hand_worked_example(policy):
  kept = _kept(policy, HAND_EXPERTS, HAND_WEIGHTS, _hand_scores(), cap=2, group_size=4)
  np.testing.assert_array_equal(kept, np.array(HAND_KEPT[policy], bool))


def test_unsampled_second_expert_takes_no_slot():
  # Expert 1 gets t2's first choice, then the second choices of t0 (not sampled) and t1.
  # lingvo clears t0's before the position cumsum, so t1's second choice fits (capacity 2).
  experts = np.array([[0, 1], [0, 1], [1, 0]], np.int32)
  weights = np.array([[0.6, 0.4], [0.7, 0.3], [0.8, 0.2]], np.float32)
  keep = np.array([[1, 0], [1, 1], [1, 1]], bool)
  kept = _kept("position", experts, weights, np.full((3, 2), 0.5, np.float32), 2, 3, keep)
  np.testing.assert_array_equal(kept, np.array([[1, 0], [1, 1], [1, 0]], bool))


@pytest.mark.parametrize("policy", ["position", "batch_priority", "weight"])
@pytest.mark.parametrize("group_size", [32, 16])
def test_capacity_keeps_exactly_the_reference_assignments(policy, group_size):
  T, E, K = 32, 4, 2
  x, experts, weights, W = make_case(T, E, K, seed=5, skew=True)
  scores = np.random.default_rng(2).uniform(size=(T, E)).astype(np.float32)
  top1 = scores[np.arange(T), experts[:, 0]]
  keep = np.random.default_rng(3).uniform(size=(T, K)) < 0.8
  keep[:, 0] = True  # only second choices are ever unsampled
  cap = plans.capacity(1.0, K, group_size, E, min_capacity=2)
  assert cap == max(2, int(np.ceil(1.0 * K * group_size / E)))
  order = plans.drop_order(policy, experts, weights, jnp.asarray(scores), group_size)
  y, kept = dsp.capacity_dispatch(
    x,
    experts,
    weights,
    expert_weights(*W),
    cap=cap,
    group_size=group_size,
    order=order,
    keep_TxK=jnp.asarray(keep),
  )
  key = ref_sort_key(policy, group_size, top1, np.asarray(weights))
  want = ref_capacity_keep(experts, key, E, cap, group_size, keep)
  assert 0 < want.sum() < keep.sum()  # the case really drops something
  np.testing.assert_array_equal(np.asarray(kept), want)
  np.testing.assert_allclose(y, naive_moe(x, experts, weights, W, kept=want), atol=1e-5)


def test_large_capacity_equals_dropless():
  T, E, K = 48, 8, 2
  x, experts, weights, W = make_case(T, E, K, seed=1, skew=True)
  cap = plans.capacity(100.0, K, T, E, 4)
  y_cap, kept = dsp.capacity_dispatch(
    x,
    experts,
    weights,
    expert_weights(*W),
    cap=cap,
    group_size=T,
    order=plans.drop_order("position", experts, weights, jnp.zeros((T, E)), T),
  )
  assert bool(kept.all())
  y_dl = _dropless_fn("blocked", 4)(x, experts, weights, W)
  np.testing.assert_allclose(y_cap, y_dl, atol=1e-6, rtol=1e-6)


def test_capacity_formula_and_cap_at_group():
  assert plans.capacity(1.25, 2, 64, 8, 4) == 20  # ceil(1.25·2·64/8)
  assert plans.capacity(0.01, 2, 64, 8, 4) == 4  # min_capacity
  assert plans.capacity(100.0, 2, 64, 8, 4) == 64  # never more than the group


def test_random_second_expert_rate():
  T = 20000
  g1 = np.full((T,), 0.8, np.float32)
  g2 = np.where(np.arange(T) < T // 2, 0.1, 0.3).astype(np.float32)  # renormalized 1/9, 3/11
  w = jnp.asarray(np.stack([g1, g2], 1))
  keep = np.asarray(plans.random_second_expert(w, jax.random.key(0)))
  assert keep[:, 0].all()
  for sl, g in ((slice(0, T // 2), 0.1 / 0.9), (slice(T // 2, T), 0.3 / 1.1)):
    rate = keep[sl, 1].mean()
    assert abs(rate - min(1.0, g / 0.5)) < 0.02, rate


def test_take_rows_vjp_is_the_gather_transpose():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(5, 3)), jnp.float32)
  src = jnp.asarray([4, 0, 5, 2, 0, 1], jnp.int32)  # 5 = zero row
  # Inverse map: rows of out reading each input row (6 = none).
  dst = jnp.asarray([[1, 4], [5, 6], [3, 6], [6, 6], [0, 6]], jnp.int32)
  g = jnp.asarray(r.normal(size=(6, 3)), jnp.float32)
  plain = lambda x: jnp.sum(g * jnp.concatenate([x, jnp.zeros((1, 3))])[src])
  ours = lambda x: jnp.sum(g * take_rows(x, src, dst))
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), atol=1e-6)
  np.testing.assert_allclose(take_rows(x, src, dst)[2], 0.0)


def test_gather_sum_is_a_sum_of_row_reads_with_a_zero_sentinel():
  r = np.random.default_rng(1)
  x = r.normal(size=(6, 4)).astype(np.float32)
  idx = r.integers(0, 7, size=(5, 3)).astype(np.int32)  # 6 = the zero row
  want = np.zeros((5, 4), np.float32)
  for m in range(5):
    for j in range(3):
      if idx[m, j] < 6:
        want[m] += x[idx[m, j]]
  np.testing.assert_allclose(gather_sum(jnp.asarray(x), jnp.asarray(idx)), want, rtol=1e-6)


@pytest.mark.parametrize(
  "kwargs,field",
  [
    (dict(dispatch="foo"), "dispatch"),
    (dict(drop_policy="x"), "drop_policy"),
    (dict(second_expert="x"), "second_expert"),
    (dict(eval_second_expert="x"), "eval_second_expert"),
    (dict(impl="x"), "impl"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"),
    (dict(min_capacity=-1), "min_capacity"),
    (dict(group_size=-1), "group_size"),
  ],
)
def test_dispatch_validation_names_the_field(kwargs, field):
  from moejax.nn.moe import MoEConfig

  MoEConfig(d_model=D)  # the defaults pass
  with pytest.raises(UserError, match=f"model.moe.{field}="):
    MoEConfig(d_model=D, **kwargs)


def test_a_group_size_that_does_not_tile_the_tokens_names_the_key():
  dsp.check_group_size(4, 12)
  with pytest.raises(UserError, match="model.moe.group_size=5 .* 12 tokens"):
    dsp.check_group_size(5, 12)


def test_auto_impl_on_this_host_is_the_table_entry_of_its_backend():
  assert dsp.resolve_impl("auto") == dsp.AUTO["dropless"][jax.default_backend()]


def test_block_drop_fraction_matches_reference_policy():
  from flax import nnx

  from moejax.nn.moe import MoEBlock, MoEConfig

  T, E, K = 32, 4, 2
  cfg = MoEConfig(
    d_model=D,
    n_experts=E,
    top_k=K,
    d_expert=F,
    dispatch="capacity",
    capacity_factor=0.5,
    eval_capacity_factor=0.5,
    min_capacity=1,
  )
  block = MoEBlock(cfg, rngs=nnx.Rngs(0))
  r = np.random.default_rng(7)
  block.router.kernel[...] = jnp.asarray(r.normal(size=(D, E)) * 2.0, jnp.float32)
  x = r.normal(size=(T, D)).astype(np.float32)
  _, ro = block(jnp.asarray(x))
  logits = x.astype(np.float64) @ np.asarray(block.router.kernel[...], np.float64)
  experts = np.argsort(-logits, axis=1)[:, :K]
  cap = max(1, int(np.ceil(0.5 * K * T / E)))
  kept = ref_capacity_keep(experts, ref_sort_key("position", T), E, cap, T)
  assert kept.mean() < 1.0
  np.testing.assert_allclose(float(ro.diag.drop_fraction), 1.0 - kept.mean(), atol=1e-7)
