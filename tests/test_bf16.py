"""bf16 compute (`model.dtype=bfloat16`) trains like float32 (docs/design.md §5; issue 17 item 4).

The quickstart model (Mixtral rule, E = 8, K = 2, dropless, stdlib bytes), shrunk to 2
layers of d_model 64 and 8 × 64 tokens per step, trains 60 steps from the same seed in
float32 and in bfloat16. Parameters, Adam moments, router and losses are float32 in both;
only attention, FFNs, experts and the residual stream compute in bfloat16.

Tolerances, from the measured run (jax 0.10.2, CPU): the first 10 steps differ by at most
0.0018 (allowed 0.01: one forward pass of nearly the same parameters, so this catches a
wrong cast); over 60 steps the per-step gap peaks at 0.086 (allowed 0.25) as the two
trajectories drift apart; the mean loss of the last 10 steps is 2.924 (f32) and 2.950
(bf16), a gap of 0.025 (allowed 0.1, below the loss's own step-to-step spread, σ = 0.13).
Both fall from 5.40 by more than 2.4 nats (required: 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failure_helpers import override
from flax import nnx
from tiers import FULL

from moejax import cli
from moejax.nn.model import ModelConfig, Transformer
from moejax.nn.moe import MoEConfig
from moejax.training import step as step_lib
from moejax.training import trainer
from runconfig import as_run

STEPS = 60
SHAPE = {
  "model.n_layers": 2,
  "model.d_model": 64,
  "model.d_ff": 128,
  "model.moe.d_expert": 64,
  "data.batch_size": 8,
  "data.seq_len": 64,
  "train.steps": STEPS,
  "optim.warmup_steps": 6,
  "wandb.mode": "disabled",
}


def train_losses(dtype: str) -> tuple[np.ndarray, dict]:
  """Per-step training loss of the quickstart shrunk to SHAPE, in `dtype`; and the dtypes
  of the state and of the step's float outputs."""
  c = override(cli.load_file("configs/quickstart.py"), {**SHAPE, "model.dtype": dtype})
  run = trainer.build(as_run(c), None)
  lc = as_run(c).with_shards(1).loss
  step = jax.jit(step_lib.make_train_step(run.graphdef, run.tx, lc, run.schedule))
  it = run.data.train_iterator()
  state, losses = run.state, []
  for i in range(STEPS):
    state, metrics = step(state, jnp.asarray(next(it)["tokens"]), jax.random.key(i))
    losses.append(float(metrics["loss"]))
  dtypes = {
    "state": {
      str(x.dtype) for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
    },
    "metrics": {str(v.dtype) for v in jax.tree.leaves(metrics)},
  }
  return np.asarray(losses), dtypes


@pytest.fixture(scope="module")
def runs():
  return {d: train_losses(d) for d in ("float32", "bfloat16")}


@FULL
def test_state_and_metrics_stay_float32(runs):
  for dtype in ("float32", "bfloat16"):
    assert runs[dtype][1] == {"state": {"float32"}, "metrics": {"float32"}}, dtype


@FULL
def test_both_learn(runs):
  for dtype in ("float32", "bfloat16"):
    losses = runs[dtype][0]
    assert losses[-10:].mean() < losses[0] - 2.0, (dtype, losses[0], losses[-10:].mean())


@FULL
def test_bf16_losses_agree_with_float32(runs):
  f32, bf16 = runs["float32"][0], runs["bfloat16"][0]
  gap = np.abs(bf16 - f32)
  assert gap[:10].max() <= 0.01, gap[:10]
  assert gap.max() <= 0.25, (int(gap.argmax()), gap.max())
  assert abs(bf16[-10:].mean() - f32[-10:].mean()) <= 0.1, (bf16[-10:].mean(), f32[-10:].mean())
  assert not np.array_equal(f32, bf16)  # bf16 did compute in bf16


def dot_dtypes(jaxpr) -> list[tuple[str, str, tuple[int, ...]]]:
  """(lhs dtype, output dtype, output shape) of every dot_general in a jaxpr, nested
  jaxprs (loops, custom VJPs, pjit) included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      aval = eqn.outvars[0].aval
      out.append((str(eqn.invars[0].aval.dtype), str(aval.dtype), tuple(aval.shape)))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out.extend(dot_dtypes(inner))
  return out


def test_bf16_forward_matmuls():
  """Every matmul of the bf16 forward takes bf16 operands, except the router's (f32, one
  per MoE layer, [T, E] out); the LM head returns f32 logits."""
  E, V = 4, 32
  cfg = ModelConfig(
    vocab_size=V, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
    first_dense=1, dtype="bfloat16", moe=MoEConfig(d_model=16, n_experts=E, top_k=2, d_expert=8),
  )  # fmt: skip
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 8), jnp.int32)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(
    lambda s: nnx.merge(graphdef, s)(tokens, train=True, rng=jax.random.key(0))
  )
  dots = dot_dtypes(jaxpr(state).jaxpr)
  f32_in = [d for d in dots if d[0] == "float32"]
  assert f32_in == [("float32", "float32", (16, E))], f32_in  # the one MoE layer's router
  assert len(dots) > 10 and all(d[0] == "bfloat16" for d in dots if d not in f32_in)
  assert ("bfloat16", "float32", (2, 8, V)) in dots  # the tied LM head: f32 logits
