"""moejax.nn.routing against a plain-NumPy reference written from docs/design.md §2.

The reference (`ref_route`) is a per-token loop in float64 that takes the rule's fields as
plain arguments (written from the table in docs/design.md §2, never read from `RULES`), so every
convention is checked against an independent implementation, not against the code itself.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.nn import routing
from moejax.nn.routing import (
  RULES,
  MergeRule,
  get_rule,
  jitter,
  route,
  shared_coefficient,
  validate,
)
from runconfig import as_run

# docs/design.md §2, one row per named rule. Fields not given take the dataclass defaults
# (lp=1.0, selection_bias=False, n_groups=topk_groups=1).
_DEFAULTS = dict(lp=1.0, selection_bias=False, n_groups=1, topk_groups=1, group_score=None)
TABLE = {
  "mixtral": dict(score="softmax", norm="sum", scale=1.0, shared="none"),
  "qwen3_moe": dict(score="softmax", norm="sum", scale=1.0, shared="none"),
  "olmoe": dict(score="softmax", norm="none", scale=1.0, shared="none"),
  "qwen2_moe": dict(score="softmax", norm="none", scale=1.0, shared="sigmoid"),
  "qwen3_5_moe": dict(score="softmax", norm="sum", scale=1.0, shared="sigmoid"),
  "megatron": dict(score="softmax", norm="sum", scale=1.0, shared="unit"),
  "olmo": dict(score="softmax", norm="sum", scale="k", shared="unit"),
  "deepseek_v3": dict(
    score="sigmoid",
    norm="sum",
    scale=2.5,
    shared="unit",
    selection_bias=True,
    n_groups=8,
    topk_groups=4,
    group_score="top2_sum",
  ),
  "deepseek_v2_lite": dict(score="softmax", norm="none", scale=1.0, shared="unit"),
  "dbrx": dict(score="softmax", norm="lp", lp=1.0, scale=1.0, shared="none"),
  "megablocks": dict(score="softmax", norm="none", scale=1.0, shared="none"),
  "megablocks_lp2": dict(score="softmax", norm="lp", lp=2.0, scale=1.0, shared="none"),
  "kplus1": dict(score="softmax", norm="none", scale=1.0, shared="kplus1"),
  "switch": dict(score="softmax", norm="none", scale=1.0, shared="none"),
  "gshard": dict(score="softmax", norm="sum", scale=1.0, shared="none"),
}
TABLE = {name: {**_DEFAULTS, **row} for name, row in TABLE.items()}

T = 64


# --------------------------------------------------------------------------- reference


def _np_scores(z: np.ndarray, score: str) -> np.ndarray:
  z = z.astype(np.float64)
  if score == "softmax":
    e = np.exp(z - z.max())
    return e / e.sum()
  return 1.0 / (1.0 + np.exp(-z))


def ref_route(
  logits,
  *,
  score,
  norm,
  scale,
  shared,
  lp=1.0,
  selection_bias=False,
  n_groups=1,
  topk_groups=1,
  group_score=None,
  k,
  k2=None,
  bias=None,
  train_k=None,
):
  """docs/design.md §2, one token at a time. Returns (experts [T,k], weights [T,k], s [T,E],
  kept_groups: list of sets of group ids (all groups when n_groups == 1))."""
  logits = np.asarray(logits, np.float64)
  n_tok, E = logits.shape
  K = k if train_k is None else train_k
  experts = np.zeros((n_tok, k), np.int64)
  weights = np.zeros((n_tok, k), np.float64)
  s_all = np.zeros((n_tok, E), np.float64)
  kept_all = []
  for t in range(n_tok):
    s = _np_scores(logits[t], score)
    s_all[t] = s
    key = s.copy()
    if selection_bias and bias is not None:
      key = key + np.asarray(bias, np.float64)
    kept = set(range(n_groups))
    if n_groups > 1:
      size = E // n_groups
      group_scores = []
      for g in range(n_groups):
        members = sorted(key[g * size : (g + 1) * size], reverse=True)
        group_scores.append(members[0] if group_score == "max" else members[0] + members[1])
      kept = set(np.argsort(-np.asarray(group_scores), kind="stable")[:topk_groups].tolist())
      for g in range(n_groups):
        if g not in kept:
          key[g * size : (g + 1) * size] = -np.inf
    kept_all.append(kept)
    order = np.argsort(-key, kind="stable")
    sel = order[:k]
    s_sel = s[sel]
    if k2 is not None:
      p = s_sel / s[order[:k2]].sum()
    elif norm == "sum":
      p = s_sel / s_sel.sum()
    elif norm == "lp":
      p = s_sel / (s_sel**lp).sum() ** (1.0 / lp)
    else:
      p = s_sel
    alpha = float(K) if scale == "k" else float(scale)
    if shared == "kplus1":
      alpha *= K / (K + 1.0)
    experts[t] = sel
    weights[t] = alpha * p
  return experts, weights, s_all, kept_all


def expected_valid(row: dict, E: int, k: int) -> bool:
  """Validity from docs/design.md §2 (k <= E, groups divide E, k fits in the kept groups)."""
  if not 1 <= k <= E:
    return False
  if row["n_groups"] > 1:
    if E % row["n_groups"]:
      return False
    size = E // row["n_groups"]
    if row["group_score"] == "top2_sum" and size < 2:
      return False  # a group needs two members to be scored by its top-2 sum
    if k > row["topk_groups"] * size:
      return False
  return True


def _logits(E: int, seed: int, n: int = T, scale: float = 2.0) -> np.ndarray:
  return (np.random.default_rng(seed).normal(size=(n, E)) * scale).astype(np.float32)


def _fields(name: str) -> dict:
  return dict(TABLE[name])


def _assert_matches(out: routing.Routing, ref, *, tol: float = 1e-6, ordered: bool = True):
  experts, weights, s, _ = ref
  got_e = np.asarray(out.experts_TxK)
  got_w = np.asarray(out.weights_TxK)
  assert out.experts_TxK.dtype == jnp.int32
  assert out.weights_TxK.dtype == jnp.float32
  assert out.scores_TxE.dtype == jnp.float32
  assert got_e.shape == experts.shape and got_w.shape == weights.shape
  # Selected sets, order-insensitive; weights aligned by expert id.
  for t in range(experts.shape[0]):
    assert sorted(got_e[t].tolist()) == sorted(experts[t].tolist()), (t, got_e[t], experts[t])
    ref_w = dict(zip(experts[t].tolist(), weights[t].tolist()))
    np.testing.assert_allclose(
      got_w[t], [ref_w[e] for e in got_e[t].tolist()], rtol=tol, atol=tol, err_msg=f"token {t}"
    )
  if ordered:  # "best first"
    np.testing.assert_array_equal(got_e, experts)
  np.testing.assert_allclose(np.asarray(out.scores_TxE), s, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- RULES table


def test_rules_names_are_the_design_table():
  assert sorted(RULES) == sorted(TABLE)
  assert len(RULES) == 15


@pytest.mark.parametrize("name", sorted(TABLE))
def test_rule_fields_match_design_table(name):
  rule = RULES[name]
  assert isinstance(rule, MergeRule)
  row = TABLE[name]
  for field in ("score", "norm", "shared", "selection_bias", "n_groups", "topk_groups"):
    assert getattr(rule, field) == row[field], (name, field, getattr(rule, field), row[field])
  if row["scale"] == "k":
    assert rule.scale == "k"
  else:
    assert not isinstance(rule.scale, str) and float(rule.scale) == row["scale"], rule.scale
  if row["norm"] == "lp":
    assert float(rule.lp) == row["lp"]
  if row["n_groups"] > 1:
    assert rule.group_score == row["group_score"]
  assert get_rule(name) is rule
  assert get_rule(rule) is rule
  with pytest.raises(dataclasses.FrozenInstanceError):
    rule.norm = "none"  # type: ignore[misc]


# --------------------------------------------------------------------------- route vs ref


@pytest.mark.parametrize("name", sorted(TABLE))
def test_route_matches_reference_all_E_K(name):
  row = _fields(name)
  for E, k in itertools.product((8, 16, 64), (1, 2, 4, 8)):
    logits = _logits(E, seed=E * 10 + k)
    if not expected_valid(row, E, k):
      with pytest.raises(ValueError):
        route(jnp.asarray(logits), name, k)
      continue
    out = route(jnp.asarray(logits), name, k)
    _assert_matches(out, ref_route(logits, **row, k=k))


def test_deepseek_v3_validity_grid():
  """The released V3 grouping (8 groups, keep 4, top2_sum) needs >= 2 experts a group."""
  row = TABLE["deepseek_v3"]
  assert not expected_valid(row, 8, 1)
  with pytest.raises(ValueError):
    route(jnp.asarray(_logits(8, 0)), "deepseek_v3", 1)
  assert expected_valid(row, 16, 8) and expected_valid(row, 64, 8)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_route_with_bias_matches_reference(name):
  """A random nonzero bias steers selection only for selection_bias rules."""
  row = _fields(name)
  rng = np.random.default_rng(7)
  for E, k in ((16, 2), (64, 4), (64, 8)):
    logits = _logits(E, seed=100 + E + k)
    bias = rng.normal(scale=0.3, size=E).astype(np.float32)
    out = route(jnp.asarray(logits), name, k, bias_E=jnp.asarray(bias))
    ref = ref_route(logits, **row, k=k, bias=bias)
    _assert_matches(out, ref)
    if row["selection_bias"]:  # the bias must matter here, or the test proves nothing
      unbiased = ref_route(logits, **row, k=k)
      assert (np.sort(ref[0], 1) != np.sort(unbiased[0], 1)).any()


def test_selection_bias_weights_use_unbiased_scores():
  """Select on s + b, weight with s (no norm, so r_i must equal s_i exactly)."""
  rule = MergeRule(score="softmax", norm="none", selection_bias=True)
  E, k = 8, 2
  logits = _logits(E, seed=3)
  bias = np.zeros(E, np.float32)
  bias[[5, 6]] = 10.0  # forces experts 5 and 6 to be selected for every token
  out = route(jnp.asarray(logits), rule, k, bias_E=jnp.asarray(bias))
  s = np.stack([_np_scores(z, "softmax") for z in logits])
  got_e = np.asarray(out.experts_TxK)
  assert (np.sort(got_e, 1) == [5, 6]).all()
  np.testing.assert_allclose(
    np.asarray(out.weights_TxK), np.take_along_axis(s, got_e, 1), rtol=1e-6, atol=1e-7
  )
  np.testing.assert_allclose(np.asarray(out.scores_TxE), s, rtol=1e-6, atol=1e-7)
  # deepseek_v3 (sigmoid, sum, 2.5): r_i = 2.5 s_i / Σ_S s_j with unbiased s.
  E = 64
  logits = _logits(E, seed=4)
  bias = np.zeros(E, np.float32)
  bias[:8] = 5.0  # group 0 always kept and its experts always chosen at k = 8
  out = route(jnp.asarray(logits), "deepseek_v3", 8, bias_E=jnp.asarray(bias))
  s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  got_e = np.asarray(out.experts_TxK)
  assert (np.sort(got_e, 1) == np.arange(8)).all()
  s_sel = np.take_along_axis(s, got_e, 1)
  np.testing.assert_allclose(
    np.asarray(out.weights_TxK), 2.5 * s_sel / s_sel.sum(1, keepdims=True), rtol=1e-6, atol=1e-6
  )


# --------------------------------------------------------------------------- k2 and train_k


def test_k2_equal_k_is_sum_renormalization_for_none_rule():
  E, k = 16, 4
  logits = _logits(E, seed=11)
  out = route(jnp.asarray(logits), "olmoe", k, k2=k)
  s = np.stack([_np_scores(z, "softmax") for z in logits])
  top = np.argsort(-s, 1, kind="stable")[:, :k]
  s_top = np.take_along_axis(s, top, 1)
  np.testing.assert_array_equal(np.asarray(out.experts_TxK), top)
  np.testing.assert_allclose(
    np.asarray(out.weights_TxK), s_top / s_top.sum(1, keepdims=True), rtol=1e-6, atol=1e-6
  )
  np.testing.assert_allclose(np.asarray(out.weights_TxK).sum(1), 1.0, rtol=1e-6)


def test_k2_equal_E_with_softmax_is_no_renormalization():
  E, k = 16, 4
  logits = _logits(E, seed=12)
  s = np.stack([_np_scores(z, "softmax") for z in logits])
  top = np.argsort(-s, 1, kind="stable")[:, :k]
  for name in ("mixtral", "dbrx", "megablocks_lp2", "olmoe"):
    out = route(jnp.asarray(logits), name, k, k2=E)
    np.testing.assert_allclose(
      np.asarray(out.weights_TxK), np.take_along_axis(s, top, 1), rtol=1e-6, atol=1e-7, err_msg=name
    )


@pytest.mark.parametrize("name", sorted(TABLE))
def test_k2_override_matches_reference(name):
  row = _fields(name)
  rng = np.random.default_rng(13)
  for E, k, k2 in ((16, 2, 4), (16, 1, 8), (64, 2, 8), (64, 4, 32), (64, 8, 16)):
    logits = _logits(E, seed=E + k + k2)
    bias = rng.normal(scale=0.3, size=E).astype(np.float32)
    out = route(jnp.asarray(logits), name, k, k2=k2, bias_E=jnp.asarray(bias))
    _assert_matches(out, ref_route(logits, **row, k=k, k2=k2, bias=bias))


_route_traced_k2 = jax.jit(
  lambda logits, bias, k2, *, name, k: route(logits, name, k, k2=k2, bias_E=bias),
  static_argnames=("name", "k"),
)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_traced_k2_own_or_top_k2_matches_reference(name):
  """One compiled forward per k (the grid's): a traced k2 holding OWN_K2 routes as the rule
  itself (k2=None in the reference), any other value as that integer k2."""
  row = _fields(name)
  rng = np.random.default_rng(17)
  for E, k, k2s in ((16, 2, (routing.OWN_K2, 4, 2)), (64, 4, (-3, 32, routing.OWN_K2))):
    logits = _logits(E, seed=E + k)
    bias = rng.normal(scale=0.3, size=E).astype(np.float32)
    for k2 in k2s:
      out = _route_traced_k2(jnp.asarray(logits), jnp.asarray(bias), jnp.int32(k2), name=name, k=k)
      ref_k2 = None if k2 <= routing.OWN_K2 else k2
      _assert_matches(out, ref_route(logits, **row, k=k, k2=ref_k2, bias=bias))


def test_train_k_constants_olmo_and_kplus1():
  """K-dependent constants use the trained K (8), never k1 (2)."""
  E, k, K = 16, 2, 8
  logits = _logits(E, seed=21)
  s = np.stack([_np_scores(z, "softmax") for z in logits])
  top = np.argsort(-s, 1, kind="stable")[:, :k]
  s_top = np.take_along_axis(s, top, 1)
  out = route(jnp.asarray(logits), "olmo", k, train_k=K)
  np.testing.assert_allclose(
    np.asarray(out.weights_TxK), 8.0 * s_top / s_top.sum(1, keepdims=True), rtol=1e-6, atol=1e-6
  )
  np.testing.assert_allclose(np.asarray(out.weights_TxK).sum(1), 8.0, rtol=1e-6)
  out = route(jnp.asarray(logits), "olmo", k, k2=K, train_k=K)
  top8 = np.sort(s, 1)[:, ::-1][:, :K].sum(1, keepdims=True)
  np.testing.assert_allclose(np.asarray(out.weights_TxK), 8.0 * s_top / top8, rtol=1e-6, atol=1e-6)
  out = route(jnp.asarray(logits), "kplus1", k, train_k=K)
  np.testing.assert_allclose(np.asarray(out.weights_TxK), s_top * 8.0 / 9.0, rtol=1e-6, atol=1e-7)
  # Default train_k is k: olmo's alpha becomes 2 and kplus1's factor 2/3.
  out = route(jnp.asarray(logits), "olmo", k)
  np.testing.assert_allclose(np.asarray(out.weights_TxK).sum(1), 2.0, rtol=1e-6)
  out = route(jnp.asarray(logits), "kplus1", k)
  np.testing.assert_allclose(np.asarray(out.weights_TxK), s_top * 2.0 / 3.0, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- groups


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_group_routing_stays_in_kept_groups(group_score):
  E, n_groups, topk_groups = 64, 8, 4
  rule = MergeRule(
    score="sigmoid",
    norm="sum",
    scale=2.5,
    shared="unit",
    selection_bias=True,
    n_groups=n_groups,
    topk_groups=topk_groups,
    group_score=group_score,
  )
  row = dict(
    score="sigmoid",
    norm="sum",
    scale=2.5,
    shared="unit",
    selection_bias=True,
    n_groups=n_groups,
    topk_groups=topk_groups,
    group_score=group_score,
  )
  rng = np.random.default_rng(31)
  size = E // n_groups
  for trial, offset in enumerate((0.0, -5.0)):  # -5: every key s + b is negative
    logits = _logits(E, seed=40 + trial, n=128)
    bias = (offset + rng.normal(scale=0.5, size=E)).astype(np.float32)
    for k in (1, 4, 8, 32):
      out = route(jnp.asarray(logits), rule, k, bias_E=jnp.asarray(bias))
      ref = ref_route(logits, **row, k=k, bias=bias)
      got_e = np.asarray(out.experts_TxK)
      for t in range(logits.shape[0]):
        groups = set((got_e[t] // size).tolist())
        assert groups <= ref[3][t], (t, k, groups, ref[3][t])
      _assert_matches(out, ref)


def test_group_masking_uses_minus_inf_not_zero():
  """All kept-group keys are ≈ −1e3 and masked ones ≈ −2e3: a mask at 0 would select masked
  experts (0 > −1e3); a mask at −inf never does."""
  E, size = 64, 8
  logits = _logits(E, seed=50, n=128)
  bias = np.full(E, -2e3, np.float32)
  bias[: 4 * size] = -1e3  # groups 0..3 win the group vote by ~2e3
  out = route(jnp.asarray(logits), "deepseek_v3", 8, bias_E=jnp.asarray(bias))
  got_e = np.asarray(out.experts_TxK)
  assert (got_e < 4 * size).all(), np.unique(got_e // size)
  for t in range(got_e.shape[0]):
    assert len(set(got_e[t].tolist())) == 8  # distinct experts
  # Weights still come from the unbiased sigmoid scores of the chosen experts.
  s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  s_sel = np.take_along_axis(s, got_e, 1)
  np.testing.assert_allclose(
    np.asarray(out.weights_TxK), 2.5 * s_sel / s_sel.sum(1, keepdims=True), rtol=1e-6, atol=1e-6
  )
  # Same with k2: the denominator must not include masked experts' scores either.
  out = route(jnp.asarray(logits), "deepseek_v3", 8, k2=16, bias_E=jnp.asarray(bias))
  got_e = np.asarray(out.experts_TxK)
  assert (got_e < 4 * size).all()
  # With "max" group scoring and the same all-negative keys.
  rule = dataclasses.replace(RULES["deepseek_v3"], group_score="max")
  out = route(jnp.asarray(logits), rule, 8, bias_E=jnp.asarray(bias))
  assert (np.asarray(out.experts_TxK) < 4 * size).all()


# --------------------------------------------------------------------------- shared coefficient


def test_shared_coefficient():
  n = 6
  gate = np.linspace(-3, 3, n).astype(np.float32)
  c = shared_coefficient(RULES["mixtral"], 2, None, n)
  np.testing.assert_array_equal(np.asarray(c), np.zeros(n))
  assert c.shape == (n,) and c.dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(shared_coefficient(RULES["megatron"], 2, None, n)), np.ones(n)
  )
  np.testing.assert_array_equal(
    np.asarray(shared_coefficient(RULES["olmo"], 8, None, n)), np.ones(n)
  )
  c = shared_coefficient(RULES["qwen2_moe"], 2, jnp.asarray(gate), n)
  np.testing.assert_allclose(
    np.asarray(c), 1.0 / (1.0 + np.exp(-gate.astype(np.float64))), rtol=1e-6
  )
  for K in (1, 2, 8):
    c = shared_coefficient(RULES["kplus1"], K, None, n)
    np.testing.assert_allclose(np.asarray(c), np.full(n, 1.0 / (K + 1)), rtol=1e-7)


# --------------------------------------------------------------------------- validation


def _raises(field_regex: str, fn, *args, **kwargs):
  with pytest.raises(ValueError, match=field_regex) as info:
    fn(*args, **kwargs)
  return str(info.value)


def test_validation_errors_name_the_field():
  z8 = jnp.asarray(_logits(8, 0, n=4))
  z12 = jnp.asarray(_logits(12, 0, n=4))
  z16 = jnp.asarray(_logits(16, 0, n=4))
  msg = _raises(r"\bk\b", route, z8, "mixtral", 9)
  assert "8" in msg  # the allowed range names n_experts
  _raises(r"\bk\b", route, z8, "mixtral", 0)
  _raises(r"\bk2\b", route, z8, "mixtral", 4, k2=2)
  _raises(r"\bk2\b", route, z8, "mixtral", 4, k2=9)
  grouped = MergeRule(n_groups=8, topk_groups=2)
  _raises(r"n_groups", route, z12, grouped, 1)
  _raises(r"topk_groups", MergeRule, n_groups=2, topk_groups=3)
  # kept groups hold topk_groups·E/n_groups = 2·2 = 4 experts < k = 5
  _raises(r"\bk\b", route, z16, grouped, 5)
  route(z16, grouped, 4)  # exactly fills the kept groups: fine
  _raises(r"\blp\b", MergeRule, norm="lp", lp=0.0)
  _raises(r"\blp\b", MergeRule, norm="lp", lp=-2.0)
  msg = _raises(r"\brule\b", route, z8, "no_such_rule", 2)
  assert "mixtral" in msg  # the allowed values
  _raises(r"\brule\b", get_rule, "Mixtral")
  msg = _raises(r"\bscore\b", MergeRule, score="relu")
  assert "softmax" in msg and "sigmoid" in msg
  msg = _raises(r"\bnorm\b", MergeRule, norm="l2")
  assert "sum" in msg
  msg = _raises(r"\bshared\b", MergeRule, shared="half")
  assert "kplus1" in msg
  _raises(r"group_score", MergeRule, n_groups=2, group_score="mean")
  # validate() directly.
  _raises(r"\bk\b", validate, RULES["mixtral"], 8, 9)
  _raises(r"\bk2\b", validate, RULES["mixtral"], 8, 4, 3)
  _raises(r"n_groups", validate, RULES["deepseek_v3"], 12, 2)
  validate(RULES["deepseek_v3"], 64, 8, 16)


# --------------------------------------------------------------------------- jitter, jit


def test_jitter_bounds():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32))
  eps = 0.1
  y = jitter(x, eps, jax.random.key(0))
  xn, yn = np.asarray(x, np.float64), np.asarray(y, np.float64)
  assert y.shape == x.shape and y.dtype == x.dtype
  lo, hi = np.minimum(xn * (1 - eps), xn * (1 + eps)), np.maximum(xn * (1 - eps), xn * (1 + eps))
  assert (yn >= lo - 1e-6).all() and (yn <= hi + 1e-6).all()
  assert not np.array_equal(xn, yn)
  ratio = yn / xn
  assert ratio.min() < 1 - eps / 2 and ratio.max() > 1 + eps / 2  # spans the range
  assert abs(ratio.mean() - 1.0) < 0.01
  y2 = jitter(x, eps, jax.random.key(1))
  assert not np.array_equal(np.asarray(y2), yn)


_route_jit = jax.jit(route, static_argnums=(1, 2), static_argnames=("k2", "train_k"))


def test_route_jit_equals_eager():
  E = 64
  logits = jnp.asarray(_logits(E, seed=60))
  bias = jnp.asarray(np.random.default_rng(61).normal(scale=0.3, size=E).astype(np.float32))
  cases = [
    ("mixtral", 2, {}),
    ("olmo", 2, dict(k2=8, train_k=8)),
    ("deepseek_v3", 8, dict(bias_E=bias)),
    ("megablocks_lp2", 4, {}),
  ]
  for name, k, kw in cases:
    eager = route(logits, name, k, **kw)
    jitted = _route_jit(logits, RULES[name], k, **kw)
    np.testing.assert_array_equal(np.asarray(jitted.experts_TxK), np.asarray(eager.experts_TxK))
    np.testing.assert_allclose(
      np.asarray(jitted.weights_TxK), np.asarray(eager.weights_TxK), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
      np.asarray(jitted.scores_TxE), np.asarray(eager.scores_TxE), rtol=1e-6, atol=1e-7
    )
    assert jitted.experts_TxK.dtype == jnp.int32 and jitted.weights_TxK.dtype == jnp.float32


# --------------------------------------------------------------------------- composed rules

# Conventions that are a config, not a named rule (seed facts: Megatron-Core examples use
# routed scale 2.827 for Kimi K2 and 2.5 or 5.0 for Nemotron 3). The reference fields are
# written here; the rule under test is composed through the config, as a run would.
COMPOSED = {
  "kimi_k2": (
    dict(rule="megatron", score="sigmoid", scale=2.827, selection_bias=True),
    dict(score="sigmoid", norm="sum", scale=2.827, shared="unit", selection_bias=True),
  ),
  "nemotron3": (
    dict(rule="megatron", scale=5.0),
    dict(score="softmax", norm="sum", scale=5.0, shared="unit"),
  ),
}


def _composed_rule(overrides: dict) -> MergeRule:
  from moejax import config  # pylint: disable=import-outside-toplevel

  c = config.base_config()
  c.model.moe.update(overrides)
  return as_run(c).rule


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_composed_rules_route_as_reference(name):
  overrides, fields = COMPOSED[name]
  rule = _composed_rule(overrides)
  E, K = 16, 4
  bias = np.random.default_rng(5).normal(scale=0.3, size=E).astype(np.float32)
  for k, k2 in ((K, None), (2, None), (2, K), (1, 8), (2, E)):
    logits = _logits(E, seed=31 + k + (k2 or 0))
    out = route(jnp.asarray(logits), rule, k, k2=k2, bias_E=jnp.asarray(bias), train_k=K)
    ref = ref_route(logits, **fields, k=k, k2=k2, bias=bias, train_k=K)
    _assert_matches(out, ref, tol=2e-6)
  # Σ r_i = α at k1 = K for both (renormalized, then scaled).
  out = route(jnp.asarray(_logits(E, 7)), rule, K, bias_E=jnp.asarray(bias))
  np.testing.assert_allclose(np.asarray(out.weights_TxK).sum(-1), fields["scale"], rtol=1e-5)


def test_compose_rule_errors_name_the_key():
  for overrides, key in (
    (dict(scale="two"), "model.moe.scale"),
    (dict(scale=-1.0), "model.moe.scale"),
    (dict(selection_bias="yes"), "model.moe.selection_bias"),
    (dict(score="relu"), "model.moe.score"),
    (dict(lp=2.0), "model.moe.lp"),  # mixtral normalizes by sum: lp has no effect
    (dict(group_score="top2_sum"), "model.moe.group_score"),  # no groups
    (dict(n_groups=3), "model.moe.n_groups"),  # does not divide E = 8 (validate)
  ):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
      rule = routing.compose_rule("mixtral", overrides)
      validate(rule, 8, 2)
  # Same value as the named rule: allowed, as config.from_saved writes every field.
  assert routing.compose_rule("mixtral", dict(lp=1.0, scale=1)) == RULES["mixtral"]
  assert routing.compose_rule("dbrx", dict(lp=2)).lp == 2.0
