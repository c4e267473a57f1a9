"""Elastic-k training (`model.moe.train_k*`): routed weights at a drawn k against a NumPy
reference, the draws, the dispatch plan at small k, neutrality at k = K, and exact resume."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failure_helpers import (  # noqa: F401  (fast_compiles: module-scoped fixture)
  assert_trees_equal,
  fast_compiles,
  metric_rows,
  override,
  tiny,
)
from tiers import FULL, one_default

from moejax import sharding
from moejax.errors import UserError
from moejax.kernels import plans
from moejax.nn import elastic, routing
from moejax.nn.moe import MoEConfig
from moejax.training import step as step_lib
from moejax.training import trainer
from runconfig import as_run

T, E, K = 24, 8, 4


def reference_weights(logits, rule, k_T, train_k2, bias=None):
  """r_i per token by a loop: select the top-K on s + b within the kept groups (NumPy),
  keep the first k, divide as the rule (or the top-K score mass) says, scale by α."""
  z = np.asarray(logits, np.float64)
  s = np.exp(z - z.max(-1, keepdims=True))
  s = s / s.sum(-1, keepdims=True) if rule.score == "softmax" else 1 / (1 + np.exp(-z))
  out = np.zeros((z.shape[0], K))
  for t in range(z.shape[0]):
    key = s[t] + (0 if bias is None or not rule.selection_bias else bias)
    if rule.n_groups > 1:
      g = key.reshape(rule.n_groups, -1)
      score = g.max(-1) if rule.group_score == "max" else np.sort(g, -1)[:, -2:].sum(-1)
      kept = np.argsort(-score, kind="stable")[: rule.topk_groups]
      mask = np.full(g.shape, -np.inf)
      mask[kept] = 0
      key = (g + mask).reshape(-1)
    top = np.argsort(-key, kind="stable")[:K]
    used = s[t, top[: k_T[t]]]
    if train_k2 == "K":
      denom = s[t, top].sum()
    elif rule.norm == "sum":
      denom = used.sum()
    elif rule.norm == "lp":
      denom = (used**rule.lp).sum() ** (1 / rule.lp)
    else:
      denom = 1.0
    alpha = K if rule.scale == "k" else rule.scale
    if rule.shared == "kplus1":
      alpha *= K / (K + 1)
    out[t, : k_T[t]] = alpha * used / denom
  return out


@pytest.mark.parametrize(
  "rule", ["qwen3_moe", "olmoe", "deepseek_v3", "dbrx", "megablocks_lp2", "olmo", "kplus1"]
)
@pytest.mark.parametrize("train_k2", ["k", "K"])
def test_routed_weights_at_a_drawn_k_match_a_numpy_reference(rule, train_k2):
  r = np.random.default_rng(0)
  logits = jnp.asarray(r.normal(size=(T, E)), jnp.float32)
  bias = jnp.asarray(r.normal(size=(E,)) * 0.05, jnp.float32)
  k_T = r.integers(1, K + 1, size=T)
  rr = routing.get_rule(rule)
  if rr.n_groups > 1:  # E = 8 in 4 groups of 2, keep 2 groups (4 experts >= K)
    rr = routing.compose_rule(rule, {"n_groups": 4, "topk_groups": 2})
  ro = routing.route(logits, rr, K, bias_E=bias)
  got = routing.elastic_weights(ro, rr, jnp.asarray(k_T), train_k2)
  np.testing.assert_allclose(got, reference_weights(logits, rr, k_T, train_k2, bias), rtol=2e-5)


def test_uniform_draws_cover_k_min_to_K_by_scope():
  e = elastic.ElasticK("uniform", k_min=2, scope="token")
  k = np.asarray(elastic.draw(e, K, jax.random.key(0), None, 3, 4000))
  assert set(np.unique(k)) == {2, 3, 4} and k.shape == (3, 4000)
  assert abs(k.mean() - 3.0) < 0.05  # uniform on {2, 3, 4}
  by_layer = elastic.ElasticK("uniform", 1, "layer")
  layer = np.asarray(elastic.draw(by_layer, K, jax.random.key(1), None, 64, 5))
  assert (layer == layer[:, :1]).all() and len(np.unique(layer[:, 0])) > 1  # per layer
  by_step = elastic.ElasticK("uniform", 1, "step")
  step = np.asarray(elastic.draw(by_step, K, jax.random.key(2), None, 3, 5))
  assert (step == step[0, 0]).all()
  again = np.asarray(elastic.draw(e, K, jax.random.key(0), None, 3, 4000))
  assert (again == k).all()  # a function of the step's RNG: a resumed run draws the same


def test_schedule_takes_the_last_pair_reached():
  sched = elastic.parse_schedule("0:4, 3:2,5:1")
  e = elastic.ElasticK("schedule", schedule=sched)
  ks = [int(elastic.draw(e, K, None, jnp.asarray(s), 1, 1)[0, 0]) for s in range(7)]
  assert ks == [4, 4, 4, 2, 2, 1, 1]


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("train_k", "random", "train_k"),
    ("train_k_scope", "batch", "train_k_scope"),
    ("train_k2", "E", "train_k2"),
    ("train_k_min", 5, "train_k_min"),
    ("train_k_min", 0, "train_k_min"),
    ("train_k_schedule", "0:9", "train_k_schedule"),
    ("train_k_schedule", "3:2", "train_k_schedule"),
    ("train_k_schedule", "0-2", "train_k_schedule"),
  ],
)
def test_bad_elastic_keys_name_the_key(field, value, match):
  extra = {"train_k": "schedule"} if field == "train_k_schedule" else {}
  with pytest.raises(UserError, match=match):
    MoEConfig(d_model=8, n_experts=E, top_k=K, d_expert=8, **extra, **{field: value})
  with pytest.raises(UserError, match="train_k_schedule"):
    MoEConfig(d_model=8, n_experts=E, top_k=K, d_expert=8, train_k="schedule")


def test_unused_assignments_leave_the_plan_so_fewer_blocks_run():
  r = np.random.default_rng(3)
  experts = jnp.asarray(np.argsort(-r.normal(size=(256, E)), -1)[:, :K], jnp.int32)
  sizes = plans.block_sizes(4, 256 * K, E)
  rows = {}
  for k in (K, 2, 1):
    used = jnp.broadcast_to(jnp.arange(K) < k, (256, K))
    plan, blocks, counts = plans.dropless_plan(experts, E, sizes, used)
    assert int(counts.sum()) == 256 * k  # only the used assignments are counted
    row = np.asarray(plan.row_of_A).reshape(256, K)
    assert (row[:, k:] == plan.token_of_R.shape[0]).all()  # unused: the dropped sentinel
    rows[k] = sum(int(b.n_used) * s for b, s in zip(blocks, sizes))  # rows the loop visits
  assert rows[1] < rows[2] < rows[K]


BASE = {"model.moe.n_experts": 8, "model.moe.top_k": 4, "data.seq_len": 16}


@functools.cache
def _step(**moe):
  c = tiny(**{k.replace(".", "__"): v for k, v in BASE.items()}, **moe)
  run = trainer.build(as_run(c), workdir=None)
  lc = as_run(c).with_shards(sharding.data_shards(run.mesh)).loss
  fn = jax.jit(step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule))
  return run, fn


def _train(n, **moe):
  run, fn = _step(**moe)
  state, it, out = run.state, run.data.train_iterator(), []
  for i in range(n):
    state, m = fn(state, next(it)["tokens"], jax.random.key(i))
    out.append(jax.device_get(m))
  return state, out


@FULL  # two 3-step trainings; the default tier checks the drawn-k weights against NumPy
def test_uniform_with_k_min_K_is_bitwise_the_fixed_step():
  """With every draw at K and the top-K denominator, the elastic path computes what the
  fixed path does, bitwise (qwen3_moe renormalizes over the same K experts)."""
  a, ma = _train(3, model__moe__rule="qwen3_moe")
  b, mb = _train(
    3,
    model__moe__rule="qwen3_moe",
    model__moe__train_k="uniform",
    model__moe__train_k_min=4,
    model__moe__train_k2="K",
  )
  assert_trees_equal(a["params"], b["params"], "params")
  assert [m["loss"] for m in ma] == [m["loss"] for m in mb]


@FULL
def test_elastic_step_logs_mean_k_and_counts_used_assignments_in_the_loads():
  _, ms = _train(3, model__moe__train_k="uniform", model__moe__train_k_scope="token")
  mean_k = [float(m["moe/mean_k"]) for m in ms]
  assert all(1.0 < k < 4.0 for k in mean_k) and len(set(mean_k)) > 1
  _, fixed = _train(1)
  assert float(fixed[0]["moe/mean_k"]) == 4.0


@FULL
def test_resumed_elastic_run_is_bitwise_the_uninterrupted_one(tmp_path):
  c = override(
    tiny(),
    {
      "model.moe.train_k": "uniform",
      "model.moe.train_k_scope": "token",
      "model.moe.train_k2": "K",
      "train.steps": 6,
    },
  )
  split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
  quiet = {"log": lambda *a: None}
  trainer.train(as_run(override(c, {"train.stop_at": 3})), split, **quiet)
  trainer.train(as_run(c), split, **quiet)
  trainer.train(as_run(c), whole, **quiet)
  rows_a, rows_b = metric_rows(split), metric_rows(whole)
  for key in ("loss", "moe/mean_k", "moe/aux_loss", "grad_norm"):
    assert [r[key] for r in rows_a] == [r[key] for r in rows_b], key
  shutil.rmtree(split)


@pytest.mark.parametrize("rule", one_default(["qwen3_moe", "olmoe"], "qwen3_moe"))
def test_native_eval_of_a_top_k_trained_model_divides_by_the_top_k_mass(rule):
  """train_k2=K: the grid's native cell at every k1 is the k2 = K cell; with train_k2=k it
  is the rule's own normalization (which for olmoe is no division at all)."""
  from flax import nnx

  from moejax.nn.moe import MoEBlock
  from moejax.nn.overrides import Overrides

  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)
  out = {}
  for k2_mode in ("K", "k"):
    cfg = MoEConfig(d_model=16, n_experts=E, top_k=K, d_expert=8, rule=rule, train_k2=k2_mode)
    block = MoEBlock(cfg, rngs=nnx.Rngs(0))
    out[k2_mode] = [np.asarray(block(x, ov=Overrides(k=2, k2=k2))[0]) for k2 in (None, K)]
  np.testing.assert_array_equal(out["K"][0], out["K"][1])
  assert not np.allclose(out["k"][0], out["k"][1])


@FULL
def test_fixed_k_with_the_top_k_denominator_normalizes_an_unnormalized_rule():
  """olmoe with train_k2=K divides by the top-K mass during training too: Σ r_i = 1."""
  _, ms = _train(1, model__moe__rule="olmoe", model__moe__train_k2="K")
  _, plain = _train(1, model__moe__rule="olmoe")
  assert abs(float(ms[0]["moe/routed_mass"]) - 1.0) < 1e-5
  assert float(plain[0]["moe/routed_mass"]) < 0.9
