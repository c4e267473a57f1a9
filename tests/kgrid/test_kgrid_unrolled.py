"""moejax.kgrid.unrolled: a scanned run in the unrolled layout (what evaluation and decode
run) holds each layer's rows of the stacked arrays and gives the scanned model's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from runconfig import as_run

from moejax import build
from moejax import config as config_lib
from moejax.kgrid.loading import EvalRun
from moejax.kgrid.unrolled import unrolled
from moejax.nn.moe import RouterBias


def test_unrolled_run_holds_each_layers_rows_and_the_same_logits():
  c = config_lib.base_config()
  c.model.update(n_layers=3, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1, first_dense=1)
  c.model.moe.update(rule="qwen3_moe", n_experts=8, top_k=2, d_expert=16)
  mc = as_run(c).with_vocab(97).model
  assert mc.scan_layers
  graphdef, params, router = nnx.split(build.abstract_transformer(mc), nnx.Param, RouterBias)
  rng = np.random.default_rng(0)
  draw = lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype)
  params, router = jax.tree.map(draw, params), jax.tree.map(draw, router)
  run = EvalRun(1, graphdef, params, router, np.zeros((0, 9), np.int32), 2)
  out = unrolled(run)
  flat = dict(nnx.to_flat_state(out.params))
  assert not any(p[0] == "stacks" for p in flat) and {p[1] for p in flat if p[0] == "layers"} == {0, 1, 2}
  stacked = dict(nnx.to_flat_state(params))
  # layer 1 is the MoE segment's first repeat, layer 2 its second (first_dense=1)
  (w,) = [p for p in stacked if p[0] == "stacks" and p[1] == 1 and p[-1] == "w_down"]
  np.testing.assert_array_equal(flat[("layers", 2, *w[4:])][...], stacked[w][...][1])
  tokens = np.asarray(rng.integers(0, 97, (2, 7)), np.int32)
  want = nnx.merge(graphdef, params, router)(tokens)[0]
  got = nnx.merge(out.graphdef, out.params, out.router)(tokens)[0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert unrolled(out) is out
