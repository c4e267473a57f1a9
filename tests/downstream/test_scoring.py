"""moejax.downstream.scoring: a request's log-likelihood against a full forward written here
(log_softmax of the model's logits on the unpadded window), alone and batched, for dropless and
capacity dispatch; shared contexts take one forward; truncation from the left."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from runconfig import as_run
from tiers import FULL

from moejax import build
from moejax import config as config_lib
from moejax.downstream import scoring
from moejax.nn.model import moe_layers
from moejax.nn.moe import RouterBias
from moejax.nn.overrides import Overrides

SEQ_LEN, V = 32, 257


def _model(dispatch: str, second_expert: str = "all"):
  c = config_lib.base_config()
  c.model.update(n_layers=2, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
  c.model.moe.update(rule="mixtral", n_experts=8, top_k=4, d_expert=16, dispatch=dispatch)
  c.model.moe.update(min_capacity=0, eval_capacity_factor=0.5, second_expert=second_expert)
  c.data.update(seq_len=SEQ_LEN)
  # random parameters drawn here (no init compile): norm scales near 1, the rest N(0, 0.3)
  graphdef, params, router = nnx.split(build.abstract_transformer(as_run(c).with_vocab(V).model), nnx.Param, RouterBias)
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    near = 1.0 if "scale" in jax.tree_util.keystr(path) else 0.0
    return jnp.asarray(near + rng.normal(0.0, 0.3, leaf.shape), leaf.dtype)

  params = jax.tree_util.tree_map_with_path(draw, params)
  router = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), router)
  model = nnx.merge(graphdef, params, router)
  n_moe = len(moe_layers(model.cfg))
  return model, scoring.Scorer(
    graphdef, params, router, n_moe_layers=n_moe, seq_len=SEQ_LEN, moe_cfg=model.cfg.moe,
    batch_size=4,
  )  # fmt: skip


_FORWARDS: dict = {}  # (model, k1) -> its jitted full forward


def _reference(model, ctx, cont, k1=None):
  """Σ log p of the continuation from one unpadded forward of the window (no bucket)."""
  full = (list(ctx) + list(cont))[-(SEQ_LEN + 1) :]
  graphdef, state = nnx.split(model)
  key = (id(model), k1)
  if key not in _FORWARDS:
    ov = Overrides(k=k1)
    _FORWARDS[key] = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, train=False, ov=ov)[0])
  logits = _FORWARDS[key](state, np.asarray([full[:-1]], np.int32))
  logp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64)[0], axis=-1))
  n = len(full) - 1
  pos = range(n - len(cont), n)
  total = sum(logp[j, full[j + 1]] for j in pos)
  greedy = all(int(np.argmax(logp[j])) == full[j + 1] for j in pos)
  return total, greedy


def _requests(seed=0):
  rng = np.random.default_rng(seed)
  ctx = list(rng.integers(0, 256, size=11))
  reqs = [(ctx, [int(t)]) for t in rng.integers(0, 256, size=4)]  # one context, 4 choices
  reqs += [(list(rng.integers(0, 256, size=n)), list(rng.integers(0, 256, size=m)))
           for n, m in [(3, 2), (20, 5), (7, 1), (40, 3)]]  # fmt: skip
  return reqs


@pytest.mark.parametrize(
  "dispatch,second",
  [
    pytest.param("dropless", "all", marks=FULL),
    pytest.param("capacity", "all", marks=FULL),
    pytest.param("dropless", "random", marks=FULL),
  ],
)
def test_alone_equals_batched(dispatch, second):
  model, sc = _model(dispatch, second)
  assert sc.rowwise == (dispatch == "capacity" or second == "random")
  reqs = _requests()
  batched = sc.loglikelihood(reqs)
  for req, got in zip(reqs, batched):
    alone = sc.loglikelihood([req])[0]
    assert alone.is_greedy == got.is_greedy
    np.testing.assert_allclose(alone.logprob, got.logprob, rtol=0, atol=1e-5)
  if not sc.rowwise:  # and padding: equal to the unpadded forward
    for req, got in zip(reqs, batched):
      ref, greedy = _reference(model, *req)
      np.testing.assert_allclose(got.logprob, ref, rtol=1e-5, atol=1e-4)
      assert got.is_greedy == greedy


def test_shared_context_takes_one_forward_and_truncates_left():
  model, sc = _model("dropless")
  ctx = list(range(1, 60))  # truncated from the left to the last 33 tokens (one bucket: 32)
  reqs = [(ctx, [t]) for t in (5, 6, 7, 8)]  # four one-token choices of one context
  got = sc.loglikelihood(reqs)
  assert sc.forwards == sc.batch_size  # one padded batch, one row used
  for (_, cont), score in zip(reqs, got):
    ref, greedy = _reference(model, ctx[-SEQ_LEN:], cont)
    np.testing.assert_allclose(score.logprob, ref, rtol=1e-5, atol=1e-4)
    assert score.is_greedy == greedy


@FULL
def test_cell_changes_the_score():
  model, sc = _model("dropless")
  reqs = _requests()
  native = sc.loglikelihood(reqs)
  sc.cell = scoring.Cell(k1=1)
  k1_one = sc.loglikelihood(reqs)
  assert max(abs(a.logprob - b.logprob) for a, b in zip(native, k1_one)) > 1e-3
  ref, _ = _reference(model, *reqs[5], k1=1)
  np.testing.assert_allclose(k1_one[5].logprob, ref, rtol=1e-5, atol=1e-4)


def test_bucket_and_window():
  assert [scoring.bucket(n, 32) for n in (1, 8, 9, 13, 17, 25, 32)] == [8, 8, 12, 16, 24, 32, 32]
  assert [scoring.bucket(n, 4096) for n in (49, 65, 97, 129, 3000)] == [64, 96, 128, 192, 3072]
  assert scoring.bucket(100, 48) == 48
  with pytest.raises(scoring.UserError, match="context encodes to no tokens"):
    scoring.window([], [1, 2], 32)  # its first token would have no position to be scored at
  assert [scoring.scored(n) for n in (1, 2, 3, 5, 17, 32, 33, 90)] == [1, 2, 4, 8, 32, 32, 64, 96]
  # longest first; `own`: a call never mixes buckets (8: 3, 5; 12: 9; 16: 13, 14)
  assert scoring.batches([3, 9, 14, 5, 13], 2, 32, own=False) == [[2, 4], [1, 3], [0]]
  assert scoring.batches([3, 9, 14, 5, 13], 2, 32, own=True) == [[2, 4], [1], [3, 0]]
  w = scoring.window([1, 2, 3], [4, 5], seq_len=3)
  assert (w.inputs, w.last, w.n_cont) == ((2, 3, 4), 5, 2)
