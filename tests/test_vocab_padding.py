"""The model's vocab padded to a multiple of 128 (issue 51): the padded ids score as if absent
(NumPy log-softmax over the real ids of an unpadded model with the same rows), are never an
argmax, get no gradient and stay zero through training; a run saved before the padding
resumes, bitwise, in its unpadded layout. The HF round trip of an unaligned vocab: test_hf."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failure_helpers import (  # fast_compiles: autouse for this module
  TINY_RUN,
  assert_trees_equal,
  fast_compiles,  # noqa: F401
  metric_rows,
  override,
  tiny,
)
from flax import nnx

from moejax.downstream.scoring import Scorer
from moejax.kgrid import loading
from moejax.nn import losses
from moejax.nn.model import ModelConfig, Transformer
from moejax.training import checkpoint, trainer
from moejax.training import step as step_lib
from runconfig import as_run

V, ROWS = 100, 128  # real ids, and the embedding rows they are padded to
QUIET = {"log": lambda *a: None}


def model_pair(tie: bool):
  """(padded model, unpadded model with the same real rows): the padded rows and columns of
  the first are set to large values, so a score that read them would differ."""
  mc = ModelConfig(
    vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, moe_every=0,
    tie_embeddings=tie, vocab_multiple=128,
  )  # fmt: skip
  padded = Transformer(mc, rngs=nnx.Rngs(0))
  assert padded.embed.embedding.shape == (ROWS, 32)
  rng = np.random.default_rng(0)
  emb = np.asarray(padded.embed.embedding[...]).copy()
  emb[V:] = 5.0 + rng.standard_normal((ROWS - V, 32))
  padded.embed.embedding[...] = jnp.asarray(emb)
  if not tie:
    k = np.asarray(padded.lm_head.kernel[...]).copy()
    k[:, V:] = 5.0 + rng.standard_normal((32, ROWS - V))
    padded.lm_head.kernel[...] = jnp.asarray(k)
  plain = Transformer(dataclasses.replace(mc, vocab_multiple=1), rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(plain)
  real = jax.tree.map(lambda a, b: a[tuple(slice(0, n) for n in b.shape)], nnx.state(padded), state)
  return padded, nnx.merge(graphdef, real)


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(2).integers(0, V, size=(3, 17)).astype(np.int32)


@pytest.mark.parametrize(
  "tie", [pytest.param(True, id="tied", marks=pytest.mark.full), pytest.param(False, id="untied")]
)
def test_padded_model_scores_as_the_unpadded_one(tie, tokens):
  """Loss, accuracy and the training loss's gradient of the padded model: those of NumPy's
  log-softmax over the unpadded model's logits; the padded rows get no gradient."""
  padded, plain = model_pair(tie)
  ref_logits = np.asarray(plain(tokens[:, :-1])[0])
  assert ref_logits.shape[-1] == V
  logp = np_log_softmax(ref_logits)
  tgt = tokens[:, 1:]
  ref_nll = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
  ref_acc = (ref_logits.argmax(-1) == tgt).astype(np.float32)
  graphdef, params, router = step_lib.split_model(padded)
  out = step_lib.eval_forward(graphdef, params, router, jnp.asarray(tokens))
  np.testing.assert_allclose(out.loss_B, ref_nll.mean(-1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out.accuracy_B, ref_acc.mean(-1))
  logits = np.asarray(padded(tokens[:, :-1])[0])
  assert logits.shape[-1] == ROWS and (logits.argmax(-1) < V).all()
  # unmasked, the large padded rows would win the argmax: the mask is what keeps them out
  h_unmasked = logits[..., V:].max()
  assert h_unmasked < -1e30

  def loss(p):
    logits_BxLxV = nnx.merge(graphdef, p, router)(jnp.asarray(tokens[:, :-1]))[0]
    return losses.cross_entropy(logits_BxLxV, jnp.asarray(tgt))[0]

  np.testing.assert_allclose(loss(params), ref_nll.mean(), rtol=1e-5)
  grads = jax.grad(loss)(params)
  assert not np.asarray(grads["embed"]["embedding"][...])[V:].any()
  if not tie:
    assert not np.asarray(grads["lm_head"]["kernel"][...])[:, V:].any()
    assert np.asarray(grads["lm_head"]["kernel"][...])[:, :V].any()


def test_downstream_scores_are_over_the_real_ids(tokens):
  """The task scorer's log-likelihood and greedy flag: NumPy's over the unpadded logits."""
  padded, plain = model_pair(tie=True)
  graphdef, params, router = step_lib.split_model(padded)
  scorer = Scorer(graphdef, params, router, n_moe_layers=0, seq_len=32, moe_cfg=None)
  ctx, cont = tokens[0, :10].tolist(), tokens[0, 10:14].tolist()
  (got,) = scorer.loglikelihood([(ctx, cont)])
  row = np.asarray(ctx + cont, np.int32)
  ref_logits = np.asarray(plain(row[None, :-1])[0])[0]
  logp = np_log_softmax(ref_logits)
  n = len(ctx)
  want = sum(logp[n - 1 + j, cont[j]] for j in range(len(cont)))
  assert got.logprob == pytest.approx(want, rel=1e-5)
  assert got.is_greedy == bool(np.all(ref_logits[n - 1 :].argmax(-1) == np.asarray(cont)))


# ---------------------------------------------------------------- runs: new, and saved unpadded

N = 3
RUN = {**TINY_RUN, "data.seq_len": 16, "train.progress": False, "model.moe.n_experts": 4,
       "model.moe.top_k": 2}  # fmt: skip


def config(**values):
  return tiny(RUN, **values)


def train_unpadded(c, workdir: str, stop_at: int | None = None) -> None:
  """Trains as moejax did before the padding: config.json without `resolved.vocab_multiple`
  (what the trainer reads on resume) and an embedding of the tokenizer's 257 rows."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):  # the old code's config.json: no vocab_multiple
    with open(path, "w") as f:
      json.dump({**c.to_dict(), "resolved": {}}, f)
  run_c = override(c, {"train.stop_at": stop_at}) if stop_at else c
  trainer.train(as_run(run_c), workdir, **QUIET)
  saved = json.loads(Path(path).read_text())
  assert saved["resolved"]["vocab_multiple"] == 1
  for key in ("vocab_multiple", "padded_vocab_size"):
    saved["resolved"].pop(key)
  with open(path, "w") as f:
    json.dump(saved, f)


def restore(workdir: str):
  rc = loading.load_config(workdir)
  run = trainer.build(rc, None)
  return checkpoint.restore(checkpoint.manager(workdir), run.state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A new (padded) run, and an old-layout run stopped at N, resumed, and uninterrupted."""
  c = config()
  new, split, whole = (str(tmp_path_factory.mktemp(n)) for n in ("new", "split", "whole"))
  trainer.train(as_run(c), new, **QUIET)
  train_unpadded(c, split, stop_at=N)
  train_unpadded(c, split)  # rerunning the same command resumes
  train_unpadded(c, whole)
  return {"new": new, "split": split, "whole": whole}


def test_a_new_run_pads_and_keeps_the_padding_zero(runs):
  """Byte tokenizer (257 ids): 384 rows; after training, the padded rows and their AdamW
  moments are exactly 0 (never an input, masked logits: no gradient)."""
  saved = json.loads(Path(runs["new"], "config.json").read_text())
  assert saved["resolved"]["vocab_size"] == 257
  assert saved["resolved"]["vocab_multiple"] == 128
  assert saved["resolved"]["padded_vocab_size"] == 384
  step, state, _ = restore(runs["new"])
  assert step == 6
  emb = np.asarray(state["params"]["embed"]["embedding"][...])
  assert emb.shape == (384, 32) and emb[:257].any() and not emb[257:].any()
  for moments in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu")):
    if hasattr(moments, "mu"):
      for m in (moments.mu, moments.nu):
        assert not np.asarray(m["embed"]["embedding"][...])[257:].any()


def test_a_new_run_trains_as_the_unpadded_one(runs):
  """Same seed, same data: the padded run's real rows start as the unpadded run's, and its
  losses follow the unpadded run's to float32 rounding (the head's matmul and the softmax's
  sums have other shapes, so not bitwise)."""
  new, old = metric_rows(runs["new"]), metric_rows(runs["whole"])
  assert [r["step"] for r in new] == [r["step"] for r in old]
  np.testing.assert_allclose([r["loss"] for r in new], [r["loss"] for r in old], rtol=2e-5)


def test_a_run_saved_unpadded_resumes_bitwise_in_its_layout(runs):
  """The old layout (257 rows) resumes as itself: the split run ends on the uninterrupted
  run's state, bitwise, and evaluation restores it."""
  step_a, state_a, data_a = restore(runs["split"])
  step_b, state_b, data_b = restore(runs["whole"])
  assert step_a == step_b == 6
  assert state_a["params"]["embed"]["embedding"][...].shape == (257, 32)
  for name in ("params", "opt_state", "router"):
    assert_trees_equal(state_a[name], state_b[name], name)
  assert data_a == data_b
  rc = loading.load_config(runs["split"])
  ev = loading.load_run(runs["split"], rc, None)
  assert ev.params["embed"]["embedding"][...].shape == (257, 32)
