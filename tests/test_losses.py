"""moejax.nn.losses against plain-NumPy loop references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.errors import UserError
from moejax.nn import balance, losses

_ce = jax.jit(losses.cross_entropy)
_lb = jax.jit(balance.load_balance_loss, static_argnames=("granularity", "n_shards"))
_z = jax.jit(losses.router_z_loss)


def _np_ce(logits, targets, mask):
  B, L, _ = logits.shape
  out = np.zeros((B, L))
  for b in range(B):
    for t in range(L):
      row = logits[b, t].astype(np.float64)
      lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
      out[b, t] = (lse - row[targets[b, t]]) * mask[b, t]
  return out.sum() / mask.sum(), out


def _np_balance(probs, assign, groups):
  """Mean over groups (lists of (b, t)) of E * sum_i f_i P_i."""
  E = probs.shape[-1]
  vals = []
  for g in groups:
    counts, psum = np.zeros(E), np.zeros(E)
    for b, t in g:
      counts += assign[b, t]
      psum += probs[b, t]
    vals.append(E * np.sum(counts / counts.sum() * psum / len(g)))
  return np.mean(vals)


def _groups(B, L, kind, n_shards=1):
  if kind == "sequence":
    return [[(b, t) for t in range(L)] for b in range(B)]
  if kind == "micro_batch":
    per = B // n_shards
    return [
      [(b, t) for b in range(s * per, (s + 1) * per) for t in range(L)] for s in range(n_shards)
    ]
  return [[(b, t) for b in range(B) for t in range(L)]]


@functools.cache
def _routing(B=4, L=6, E=4, K=2, seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(B, L, E)).astype(np.float32) * 2
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  assign = np.zeros_like(probs)
  top = np.argsort(-logits, axis=-1)[..., :K]
  for b in range(B):
    for t in range(L):
      assign[b, t, top[b, t]] = 1.0
  return probs.astype(np.float32), assign


def test_cross_entropy_matches_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, size=(2, 5))
  mask = (rng.random((2, 5)) > 0.3).astype(np.float32)
  mean, per = _ce(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  ref_mean, ref_per = _np_ce(logits, targets, mask)
  np.testing.assert_allclose(per, ref_per, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mean, ref_mean, rtol=1e-5)
  mean_all, _ = _ce(jnp.asarray(logits), jnp.asarray(targets), jnp.ones((2, 5)))
  np.testing.assert_allclose(mean_all, _np_ce(logits, targets, np.ones((2, 5)))[0], rtol=1e-5)
  mean_none, _ = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
  np.testing.assert_allclose(mean_none, mean_all, rtol=1e-6)
  # bf16 logits are upcast: output is float32.
  m16, per16 = losses.cross_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets))
  assert per16.dtype == jnp.float32 and m16.dtype == jnp.float32


def test_cross_entropy_gradient_matches_numpy():
  """d mean CE / d logits = mask · (softmax − onehot) / Σ mask, written out in NumPy (the
  loss has its own VJP, `losses.token_nll`); bf16 logits get the same gradient in bf16."""
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, size=(2, 5))
  mask = (rng.random((2, 5)) > 0.3).astype(np.float32)
  grad = jax.grad(lambda z: _ce(z, jnp.asarray(targets), jnp.asarray(mask))[0])(jnp.asarray(logits))
  e = np.exp(logits - logits.max(-1, keepdims=True))
  ref = (e / e.sum(-1, keepdims=True) - np.eye(7)[targets]) * mask[..., None] / mask.sum()
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-7)
  g16 = jax.grad(lambda z: losses.cross_entropy(z, jnp.asarray(targets))[0])(
    jnp.asarray(logits, jnp.bfloat16)
  )
  assert g16.dtype == jnp.bfloat16
  ref_all = (e / e.sum(-1, keepdims=True) - np.eye(7)[targets]) / targets.size
  np.testing.assert_allclose(np.asarray(g16, np.float32), ref_all, rtol=2e-2, atol=1e-3)


def test_accuracy():
  logits = np.array([[[0.1, 2.0, 0.0], [3.0, 0.0, 1.0]], [[0.0, 0.0, 5.0], [1.0, 2.0, 0.5]]])
  targets = np.array([[1, 2], [2, 0]])
  acc = losses.accuracy(jnp.asarray(logits), jnp.asarray(targets))
  ref = np.array(
    [[float(np.argmax(logits[b, t]) == targets[b, t]) for t in range(2)] for b in range(2)]
  )
  np.testing.assert_array_equal(acc, ref)
  assert acc.dtype == jnp.float32


@pytest.mark.parametrize(
  "kind,n_shards", [("sequence", 1), ("micro_batch", 2), ("micro_batch", 4), ("global_batch", 1)]
)
def test_load_balance_matches_numpy(kind, n_shards):
  probs, assign = _routing()
  got = _lb(jnp.asarray(probs), jnp.asarray(assign), granularity=kind, n_shards=n_shards)
  ref = _np_balance(probs, assign, _groups(4, 6, kind, n_shards))
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_granularities_differ_on_within_sequence_skew():
  # Sequences 0-2 route every token to expert 0, sequence 3 to expert 1 (K=1, E=2).
  B, L = 4, 3
  probs = np.zeros((B, L, 2), np.float32)
  assign = np.zeros((B, L, 2), np.float32)
  for b, e in enumerate([0, 0, 0, 1]):
    probs[b, :, e], probs[b, :, 1 - e] = 0.9, 0.1
    assign[b, :, e] = 1.0
  P, A = jnp.asarray(probs), jnp.asarray(assign)
  seq = float(_lb(P, A, granularity="sequence"))
  micro = float(_lb(P, A, granularity="micro_batch", n_shards=2))
  glob = float(_lb(P, A, granularity="global_batch"))
  # Hand values: sequence 2*0.9; shard0 1.8, shard1 1.0; global 2*(.75*.7 + .25*.3).
  np.testing.assert_allclose([seq, micro, glob], [1.8, 1.4, 1.2], rtol=1e-5)
  for kind, n, got in [("sequence", 1, seq), ("micro_batch", 2, micro), ("global_batch", 1, glob)]:
    np.testing.assert_allclose(got, _np_balance(probs, assign, _groups(B, L, kind, n)), rtol=1e-5)


def test_granularities_equal_when_every_sequence_routes_alike():
  probs, assign = _routing(B=1)
  P = jnp.asarray(np.tile(probs, (4, 1, 1)))
  A = jnp.asarray(np.tile(assign, (4, 1, 1)))
  vals = [
    _lb(P, A, granularity="sequence"),
    _lb(P, A, granularity="micro_batch", n_shards=2),
    _lb(P, A, granularity="global_batch"),
  ]
  np.testing.assert_allclose(vals, vals[0], rtol=1e-6)
  assert float(vals[0]) > 1.0  # skewed routing, not the trivial balanced value


def test_f_override():
  """Passing the batch's own assignment fractions as f_E gives the computed loss; uniform
  f_E gives 1 (Σ_i P_i = 1)."""
  probs, assign = _routing()
  f = jnp.asarray(assign.reshape(-1, 4).sum(0) / assign.sum())
  P, A = jnp.asarray(probs), jnp.asarray(assign)
  computed = _lb(P, A, granularity="global_batch")
  np.testing.assert_allclose(_lb(P, A, granularity="global_batch", f_E=f), computed, rtol=1e-6)
  uniform = jnp.full((4,), 0.25)
  np.testing.assert_allclose(_lb(P, A, granularity="global_batch", f_E=uniform), 1.0, rtol=1e-5)


def test_gradient_flows_only_through_probs():
  probs, assign = _routing()
  P, A = jnp.asarray(probs), jnp.asarray(assign)
  for kind in ("sequence", "micro_batch", "global_batch"):
    gP, gA = jax.grad(
      lambda p, a: balance.load_balance_loss(p, a, granularity=kind, n_shards=2), argnums=(0, 1)
    )(P, A)
    assert np.all(np.asarray(gA) == 0.0), kind
    assert np.abs(np.asarray(gP)).sum() > 0, kind
  # Global: d/dp[b,t,i] = E * f_i / (B*L).
  f = assign.reshape(-1, 4).sum(0) / assign.sum()
  gP = jax.grad(lambda p: balance.load_balance_loss(p, A, granularity="global_batch"))(P)
  np.testing.assert_allclose(gP, np.broadcast_to(4 * f / 24, probs.shape), rtol=1e-5)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(granularity="token"),
    dict(granularity="micro_batch", n_shards=3),
    dict(granularity="micro_batch", n_shards=0),
    dict(granularity="sequence", f_E=jnp.full((4,), 0.25)),
  ],
)
def test_load_balance_bad_arguments(kwargs):
  probs, assign = _routing()
  with pytest.raises(UserError):
    balance.load_balance_loss(jnp.asarray(probs), jnp.asarray(assign), **kwargs)


def test_router_z_loss_matches_numpy():
  z = np.random.default_rng(2).normal(size=(2, 3, 5)).astype(np.float32) * 4
  vals = [
    np.log(np.sum(np.exp(z[a, b].astype(np.float64)))) ** 2 for a in range(2) for b in range(3)
  ]
  np.testing.assert_allclose(_z(jnp.asarray(z)), np.mean(vals), rtol=1e-5)
  assert losses.router_z_loss(jnp.asarray(z, jnp.bfloat16)).dtype == jnp.float32


def test_bias_update_rule():
  bias = jnp.array([0.0, 0.5, -0.5, 0.0])
  load = jnp.array([10.0, 2.0, 4.0, 8.0])  # mean 6
  new = losses.bias_update(bias, load, 0.1)
  np.testing.assert_allclose(new, [-0.1, 0.6, -0.4, -0.1], rtol=1e-6)
  same = losses.bias_update(bias, jnp.array([5.0, 5.0, 5.0, 5.0]), 0.1)
  np.testing.assert_allclose(same, bias)


def test_bias_update_balances_a_skewed_router():
  T, E, K = 256, 8, 2
  rng = np.random.default_rng(3)
  logits_TxE = jnp.asarray(rng.normal(size=(T, E)) * 0.5 + np.linspace(1.5, 0.0, E), jnp.float32)

  def load_of(bias_E):
    _, idx_TxK = jax.lax.top_k(logits_TxE + bias_E, K)
    return jax.nn.one_hot(idx_TxK, E).sum((0, 1))

  def step(bias_E, _):
    load_E = load_of(bias_E)
    return losses.bias_update(bias_E, load_E, 1e-2), load_E.max() / load_E.mean()

  bias_E, ratios = jax.jit(lambda b: jax.lax.scan(step, b, None, length=200))(jnp.zeros(E))
  start = float(ratios[0])
  end_load = load_of(bias_E)
  end = float(end_load.max() / end_load.mean())
  assert start > 2.0, start
  assert end < 1.4 and start - end > 0.8, (start, end)


# --------------------------------------------------------------------------- conventions


def _np_convention_balance(probs, experts, E, *, choices, convention, groups):
  """E · Σ_i f_i P_i per group, averaged: f from the counted choices, over all counted
  assignments (fraction) or over the group's tokens (count); P the mean probability.
  Written from HF `load_balancing_loss_func` (count), Megatron `switch_load_balancing_
  loss_func` (fraction) and lingvo `top2_gating` (top-1 only, per group)."""
  out = []
  for idx in groups:
    ex = experts[idx][:, :1] if choices == "top1" else experts[idx]
    counts = np.zeros(E)
    for row in ex:
      for e in row:
        counts[e] += 1
    f = counts / (counts.sum() if convention == "fraction" else len(idx))
    out.append(E * np.sum(f * probs[idx].mean(0)))
  return np.mean(out)


@pytest.mark.parametrize("choices", ["all", "top1"])
@pytest.mark.parametrize("convention", ["fraction", "count"])
@pytest.mark.parametrize("granularity", ["global_batch", "sequence"])
def test_balance_conventions_match_numpy(choices, convention, granularity):
  B, L, E, K = 3, 5, 6, 3
  r = np.random.default_rng(11)
  probs = r.dirichlet(np.ones(E), size=(B, L)).astype(np.float32)
  experts = np.argsort(-(probs + r.uniform(size=probs.shape) * 0.2), -1)[..., :K]
  assign = balance.balance_assignments(jnp.asarray(experts), E, choices)
  got = balance.load_balance_loss(
    jnp.asarray(probs), assign, granularity=granularity, convention=convention
  )
  flat_p, flat_e = probs.reshape(-1, E), experts.reshape(-1, K)
  groups = [np.arange(B * L)] if granularity == "global_batch" else np.split(np.arange(B * L), B)
  want = _np_convention_balance(
    flat_p, flat_e, E, choices=choices, convention=convention, groups=groups
  )
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  # Balanced routing gives 1 (fraction) or the choices per token (count): the scale a
  # copied coefficient is calibrated to.
  flat = jnp.full((1, E, E), 1.0 / E)
  uniform = jnp.asarray([[[(t + j) % E for j in range(K)] for t in range(E)]])
  bal = balance.load_balance_loss(
    flat,
    balance.balance_assignments(uniform, E, choices),
    granularity=granularity,
    convention=convention,
  )
  per_token = 1 if choices == "top1" else K
  np.testing.assert_allclose(float(bal), per_token if convention == "count" else 1.0, rtol=1e-6)


def test_balance_fractions_global_override_and_bad_names():
  counts = jnp.asarray([[3.0, 1.0, 0.0, 4.0]])
  np.testing.assert_allclose(
    balance.balance_fractions(counts, 4, "fraction"), [[3 / 8, 1 / 8, 0, 4 / 8]]
  )
  np.testing.assert_allclose(balance.balance_fractions(counts, 4, "count"), [[3 / 4, 1 / 4, 0, 1]])
  with pytest.raises(ValueError, match="loss.balance_convention"):
    balance.balance_fractions(counts, 4, "tokens")
  with pytest.raises(ValueError, match="loss.balance_choices"):
    balance.balance_assignments(jnp.zeros((2, 2), jnp.int32), 4, "top2")


@pytest.mark.parametrize("choices", ["all", "top1"])
@pytest.mark.parametrize("convention", ["fraction", "count"])
@pytest.mark.parametrize("granularity", ["global_batch", "sequence", "micro_batch"])
def test_balance_from_a_layers_sums_matches_numpy(choices, convention, granularity):
  """What a train step computes from each MoE layer's `RouterOut.balance`: the per-sequence
  sums of `balance_sums`, grouped, against the NumPy reference over the tokens themselves.
  Some ranks are unused (expert id E, elastic-k): they count nowhere."""
  B, L, E, K = 4, 5, 6, 3
  r = np.random.default_rng(12)
  probs = r.dirichlet(np.ones(E), size=(B, L)).astype(np.float32)
  experts = np.argsort(-(probs + r.uniform(size=probs.shape) * 0.2), -1)[..., :K]
  experts[..., 1:] = np.where(r.uniform(size=(B, L, K - 1)) < 0.3, E, experts[..., 1:])
  sums = balance.balance_sums(jnp.asarray(probs), jnp.asarray(experts), E)
  got = balance.balance_from_sums(
    sums, granularity=granularity, choices=choices, n_shards=2, convention=convention
  )
  flat_p, flat_e = probs.reshape(-1, E), experts.reshape(-1, K)
  n_groups = {"global_batch": 1, "sequence": B, "micro_batch": 2}[granularity]
  groups = np.split(np.arange(B * L), n_groups)
  counted = [[e for e in row if e < E] for row in (flat_e[:, :1] if choices == "top1" else flat_e)]
  want = []
  for idx in groups:
    counts = np.bincount([e for i in idx for e in counted[i]], minlength=E)
    f = counts / (counts.sum() if convention == "fraction" else len(idx))
    want.append(E * np.sum(f * flat_p[idx].mean(0)))
  np.testing.assert_allclose(float(got), np.mean(want), rtol=1e-5)
  assert float(sums.tokens_S.sum()) == B * L and sums.probs_SxE.shape == (B, E)
