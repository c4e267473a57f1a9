"""Dispatch vs independent NumPy references: naive per-token loops and priority policies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import dispatch as dsp
from moejax.errors import UserError
from moejax.permute import take_rows

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


@functools.lru_cache(maxsize=None)
def _dropless_fn(impl, block):
  f = lambda x, e, w, W: dsp.dropless(x, e, w, dsp.ExpertWeights(*W), impl=impl, block=block)
  return jax.jit(f)


@pytest.mark.parametrize("impl,block", [("blocked", 4), ("blocked", 16), ("ragged", 1)])
@pytest.mark.parametrize("E,K,skew", [(8, 2, False), (16, 4, True), (4, 1, False)])
def test_dropless_matches_naive_loop(impl, block, E, K, skew):
  x, experts, weights, W = make_case(48, E, K, skew=skew)
  y = _dropless_fn(impl, block)(x, experts, weights, W)
  np.testing.assert_allclose(y, naive_moe(x, experts, weights, W), atol=1e-5, rtol=1e-5)


def _naive_grads(x, experts, weights, W, g):
  """Per-expert weight gradients of Σ g·y from the naive loop, by hand (float64)."""
  wg, wu, wd = (np.asarray(w, np.float64) for w in W)
  dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
  dx = np.zeros(x.shape)
  for t in range(x.shape[0]):
    for j in range(experts.shape[1]):
      e, r = experts[t, j], weights[t, j]
      a, b = x[t] @ wg[e], x[t] @ wu[e]
      sig = 1 / (1 + np.exp(-a))
      h = a * sig * b
      dy = r * g[t]
      dwd[e] += np.outer(h, dy)
      dh = wd[e] @ dy
      db = dh * a * sig
      da = dh * b * sig * (1 + a * (1 - sig))
      dwg[e] += np.outer(x[t], da)
      dwu[e] += np.outer(x[t], db)
      dx[t] += wg[e] @ da + wu[e] @ db
  return dx, (dwg, dwu, dwd)


@pytest.mark.parametrize("impl,block", [("blocked", 4), ("ragged", 1)])
def test_dropless_gradients_per_expert(impl, block):
  E, K = 8, 2
  x, experts, weights, W = make_case(40, E, K, seed=3, skew=True)
  g = np.random.default_rng(9).normal(size=x.shape).astype(np.float32)
  loss = lambda x, W: jnp.sum(
    g * dsp.dropless(x, experts, weights, dsp.ExpertWeights(*W), impl=impl, block=block)
  )
  dx, dW = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, W)
  ref_dx, ref_dW = _naive_grads(x, experts, weights, W, g)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  used = np.unique(experts)
  for name, got, want in zip(("w_gate", "w_up", "w_down"), dW, ref_dW):
    for e in range(E):  # relative per expert: a global atol could hide one wrong expert
      err = np.linalg.norm(got[e] - want[e]) / max(np.linalg.norm(want[e]), 1e-12)
      if e in used:
        assert err < 1e-4, (name, e, err)
      else:
        assert np.abs(got[e]).max() == 0.0, (name, e)


def ref_capacity_keep(experts, priority, E, cap, group_size, keep=None):
  """Which assignments survive: per group and expert, the `cap` highest priorities."""
  T, K = experts.shape
  kept = np.zeros((T, K), bool)
  for g0 in range(0, T, group_size):
    cands = [(t, j) for t in range(g0, g0 + group_size) for j in range(K)]
    for e in range(E):
      mine = [(t, j) for t, j in cands if experts[t, j] == e]
      mine.sort(key=lambda tj: (-priority[tj], tj[0] * K + tj[1]))
      for t, j in mine[:cap]:
        kept[t, j] = True
  return kept if keep is None else kept & keep


def ref_position_priority(T, K, group_size):
  """Switch/GShard: every first choice before any second choice, earlier tokens first."""
  pri = np.zeros((T, K))
  for t in range(T):
    for j in range(K):
      pri[t, j] = -(j * group_size + t % group_size)
  return pri


@pytest.mark.parametrize("policy", ["position", "score"])
@pytest.mark.parametrize("group_size", [32, 16])
def test_capacity_keeps_exactly_the_reference_assignments(policy, group_size):
  T, E, K = 32, 4, 2
  x, experts, weights, W = make_case(T, E, K, seed=5, skew=True)
  scores = np.random.default_rng(2).uniform(size=(T, K)).astype(np.float32)
  pri = ref_position_priority(T, K, group_size) if policy == "position" else scores
  np.testing.assert_array_equal(
    dsp.position_priority(T, K, group_size), ref_position_priority(T, K, group_size)
  )
  cap = dsp.capacity(1.0, K, group_size, E, min_capacity=2)
  assert cap == max(2, int(np.ceil(1.0 * K * group_size / E)))
  y, kept = dsp.capacity_dispatch(
    x,
    experts,
    weights,
    dsp.ExpertWeights(*W),
    cap=cap,
    group_size=group_size,
    priority_TxK=jnp.asarray(pri),
  )
  want = ref_capacity_keep(experts, pri, E, cap, group_size)
  assert 0 < want.sum() < want.size  # the case really drops something
  np.testing.assert_array_equal(np.asarray(kept), want)
  np.testing.assert_allclose(y, naive_moe(x, experts, weights, W, kept=want), atol=1e-5)


def test_score_priority_keeps_highest_scores():
  T, E, K = 16, 2, 1
  x, _, weights, W = make_case(T, E, K)
  experts = np.zeros((T, K), np.int32)  # everyone wants expert 0
  scores = np.random.default_rng(4).uniform(size=(T, K)).astype(np.float32)
  _, kept = dsp.capacity_dispatch(
    x,
    experts,
    weights,
    dsp.ExpertWeights(*W),
    cap=4,
    group_size=T,
    priority_TxK=jnp.asarray(scores),
  )
  top4 = np.argsort(-scores[:, 0])[:4]
  assert set(np.flatnonzero(np.asarray(kept)[:, 0])) == set(top4)


def test_large_capacity_equals_dropless():
  T, E, K = 48, 8, 2
  x, experts, weights, W = make_case(T, E, K, seed=1, skew=True)
  cap = dsp.capacity(100.0, K, T, E, 4)
  y_cap, kept = dsp.capacity_dispatch(
    x,
    experts,
    weights,
    dsp.ExpertWeights(*W),
    cap=cap,
    group_size=T,
    priority_TxK=dsp.position_priority(T, K, T),
  )
  assert bool(kept.all())
  y_dl = _dropless_fn("blocked", 4)(x, experts, weights, W)
  np.testing.assert_allclose(y_cap, y_dl, atol=1e-6, rtol=1e-6)


def test_capacity_formula_and_cap_at_group():
  assert dsp.capacity(1.25, 2, 64, 8, 4) == 20  # ceil(1.25·2·64/8)
  assert dsp.capacity(0.01, 2, 64, 8, 4) == 4  # min_capacity
  assert dsp.capacity(100.0, 2, 64, 8, 4) == 64  # never more than the group


def test_random_second_expert_rate():
  T = 20000
  g1 = np.full((T,), 0.8, np.float32)
  g2 = np.where(np.arange(T) < T // 2, 0.1, 0.3).astype(np.float32)  # renormalized 1/9, 3/11
  w = jnp.asarray(np.stack([g1, g2], 1))
  keep = np.asarray(dsp.random_second_expert(w, jax.random.key(0)))
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


@pytest.mark.parametrize(
  "kwargs,field",
  [
    (dict(mode="foo"), "dispatch"),
    (dict(drop_policy="x"), "drop_policy"),
    (dict(second_expert="x"), "second_expert"),
    (dict(impl="x"), "impl"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"),
    (dict(min_capacity=-1), "min_capacity"),
    (dict(group_size=0), "group_size"),
    (dict(group_size=5, n_tokens=12), "group_size"),
  ],
)
def test_dispatch_validation_names_the_field(kwargs, field):
  args = dict(
    mode="dropless",
    drop_policy="position",
    second_expert="all",
    impl="auto",
    capacity_factor=1.0,
    eval_capacity_factor=2.0,
    min_capacity=4,
    group_size=None,
  )
  args.update(kwargs)
  with pytest.raises(UserError, match=field):
    dsp.validate_dispatch(
      args.pop("mode"),
      args.pop("drop_policy"),
      args.pop("second_expert"),
      args.pop("impl"),
      args.pop("capacity_factor"),
      args.pop("eval_capacity_factor"),
      args.pop("min_capacity"),
      args.pop("group_size"),
      args.pop("n_tokens", None),
    )


def test_auto_impl_on_cpu_is_blocked():
  assert dsp.resolve_impl("auto") == ("blocked" if jax.default_backend() == "cpu" else "ragged")


def test_block_drop_fraction_matches_reference_policy():
  from flax import nnx

  from moejax.moe import MoEBlock, MoEConfig

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
  _, aux = block(jnp.asarray(x))
  logits = x.astype(np.float64) @ np.asarray(block.router.kernel[...], np.float64)
  experts = np.argsort(-logits, axis=1)[:, :K]
  cap = max(1, int(np.ceil(0.5 * K * T / E)))
  kept = ref_capacity_keep(experts, ref_position_priority(T, K, T), E, cap, T)
  assert kept.mean() < 1.0
  np.testing.assert_allclose(float(aux["drop_fraction"]), 1.0 - kept.mean(), atol=1e-7)
