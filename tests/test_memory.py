"""Memory that fits (issue 17, item 4a): block rematerialization and FSDP-sharded experts.

* `model.remat`: every policy gives the gradients of `none`, and `full` lowers the
  compiled temporaries of the train step's gradient where activations dominate.
* `sharding.state_sharding`: the per-device bytes of the whole train state (params, Adam
  moments, router biases, step counters) on abstract 16-device meshes, against a count
  by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiers import one_default

from moejax import sharding
from moejax.backend import compat
from moejax import config as config_lib
from moejax.errors import UserError
from moejax.nn.losses import LossConfig
from moejax.nn.model import ModelConfig, Transformer
from moejax.nn.moe import MoEConfig
from moejax.nn.remat import REMAT_POLICIES
from moejax.training import optim
from moejax.training import step as step_lib
from moejax.config.reader import resolve
from runconfig import as_run

# XLA:CPU's default scheduler orders for concurrency and runs a checkpointed block's
# recomputation as soon as its inputs exist, which hides what remat saves; the
# memory-optimized scheduler (what TPU and GPU schedulers aim at) shows it.
MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def tiny_model(remat: str) -> Transformer:
  """2 layers (dense then MoE), GQA with per-head QK-norm, E = 4, K = 2."""
  cfg = ModelConfig(
    vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, qk_norm=True,
    first_dense=1, remat=remat, moe=MoEConfig(d_model=16, n_experts=4, top_k=2, d_expert=8),
  )  # fmt: skip
  return Transformer(cfg, rngs=nnx.Rngs(0))


def loss_and_grads(remat: str):
  graphdef, params, router = step_lib.split_model(tiny_model(remat))
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 32)
  fn = jax.value_and_grad(step_lib.forward_loss, argnums=1, has_aux=True)
  (loss, (metrics, _)), grads = jax.jit(fn, static_argnums=(0, 5))(
    graphdef, params, router, tokens, jax.random.key(2), LossConfig()
  )
  return loss, metrics, grads


@pytest.fixture(scope="module")
def no_remat():
  return loss_and_grads("none")


@pytest.mark.parametrize(
  "remat", one_default([n for n in REMAT_POLICIES if n != "none"], "minimal")
)
def test_remat_gives_the_gradients_of_none(no_remat, remat):
  loss0, metrics0, grads0 = no_remat
  loss, metrics, grads = loss_and_grads(remat)
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  np.testing.assert_allclose(metrics["moe/aux_loss"], metrics0["moe/aux_loss"], rtol=1e-6)
  flat0 = jax.tree_util.tree_leaves_with_path(grads0)
  assert len(flat0) > 20
  for (path, g0), g in zip(flat0, jax.tree.leaves(grads)):
    assert float(jnp.abs(g0).max()) > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def grad_temp_bytes(remat: str, scan: bool = False) -> int:
  """Compiled temporaries of the train step's gradient (`value_and_grad(forward_loss)`,
  what `step.make_train_step` scans) for a dense 4-layer model with B·L = 8 × 128 tokens
  and d_model 64, where attention's [B, H, L, L] activations dominate."""
  c = config_lib.base_config()
  c.model.update(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, moe_every=0)
  c.model.update(remat=remat, scan_layers=scan, scan_unroll=1)  # scanned: the loop
  cfg = as_run(c).with_vocab(64).model
  graphdef, params, router = step_lib.split_model(
    nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  )
  fn = jax.value_and_grad(step_lib.forward_loss, argnums=1, has_aux=True)
  tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
  lowered = jax.jit(fn, static_argnums=(0, 5)).lower(
    graphdef, params, router, tokens, jax.random.key(0), LossConfig()
  )
  return lowered.compile(MEMORY_SCHEDULER).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_full_remat_lowers_compiled_temporaries(scan):
  """Measured (jax 0.10.2, CPU, memory-optimized scheduler, unrolled): none 30.8 MB, full
  13.4 MB; jax 0.11.2: unrolled 30.2 / 10.9 MB, scanned 28.8 / 10.5 MB. Per layer, `none`
  keeps the f32 scores and probabilities [8, 4, 128, 128] (2 MiB each) and more (scanned,
  `remat.save_expensive` keeps the scores and recomputes the probabilities); `full` keeps
  the block input [8, 128, 64] (256 KiB)."""
  none, full = grad_temp_bytes("none", scan), grad_temp_bytes("full", scan)
  assert full < 0.5 * none, (none, full)
  assert none - full > 4 * 2 * 2**21  # at least scores + probabilities of 4 layers


# --------------------------------------------------------------------- sharding

# Hand count for the model below: d_model 64, 2 MoE layers, 4 heads of 16 (2 kv heads),
# E = 16 experts of width 32, byte vocabulary 256, tied embeddings.
EMBED = 256 * 64  # [V, D], axis 0 over fsdp
ATTN = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v, o kernels [D, ·] / [H·K, D]
ROUTER = 64 * 16  # [D, E]
EXPERTS = 3 * 16 * 64 * 32  # w_gate_up [E, D, 2F]; w_down [E, F, D]
VECTORS = 2 * 2 * 64 + 64  # attn_norm, mlp_norm per layer; final_norm (replicated)
BIASES = 2 * 16  # router selection bias per layer (router state, replicated)
SCALARS = 3  # int32 step, Adam count, schedule count


def hand_bytes(fsdp: int, expert: int) -> int:
  """Per-device bytes: params + Adam mu + nu (3 × f32), biases, int32 scalars. Matrices
  split their fsdp axis; experts split E over `expert` and D over `fsdp`."""
  per_param = (EMBED + 2 * (ATTN + ROUTER)) / fsdp + 2 * EXPERTS / (fsdp * expert) + VECTORS
  return int(3 * 4 * per_param + 4 * BIASES + 4 * SCALARS)


def abstract_state(scan: bool = True):
  c = config_lib.base_config()
  c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, scan_layers=scan)
  c.model.moe.update(n_experts=16, top_k=2, d_expert=32)
  cfg = as_run(c).with_vocab(256).model
  _, params, router = step_lib.split_model(
    nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  )
  tx, _ = optim.optimizer(as_run(c).optim, as_run(c).train.steps)
  return {
    "step": jax.ShapeDtypeStruct((), jnp.int32),
    "params": params,
    "router": router,
    "opt_state": jax.eval_shape(tx.init, params),
  }


def device_bytes(state, mesh) -> int:
  shardings = jax.tree.leaves(sharding.state_sharding(state, mesh))
  leaves = jax.tree.leaves(state)
  assert len(shardings) == len(leaves)
  return sum(
    int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for s, x in zip(shardings, leaves)
  )


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize(
  ("data", "fsdp", "expert", "expected"),
  [
    (1, 16, 1, 183_692),  # experts split 16 ways over fsdp (were replicated: 2,395,532)
    (1, 8, 2, 215_948),  # experts E/2 × D/8
    (16, 1, 1, 2_879_372),  # pure data parallel: everything replicated
  ],
)
def test_state_bytes_per_device(data, fsdp, expert, expected, scan):
  """The same bytes in both layouts: a stack's layer axis is never split."""
  assert hand_bytes(fsdp, expert) == expected  # the count by hand, written out above
  mesh = compat.abstract_mesh((data, fsdp, expert), sharding.AXES)
  assert device_bytes(abstract_state(scan), mesh) == expected


# Where layer 0's routed experts live: ("stacks", segment, "blocks", position) holds every
# layer of the 2-layer MoE stack on a leading axis; ("layers", 0) is layer 0 alone.
EXPERTS_AT = {
  True: "['stacks'][0]['blocks'][0]['mlp']['experts']",
  False: "['layers'][0]['mlp']['experts']",
}


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_expert_specs(scan):
  state = abstract_state(scan)
  mesh = compat.abstract_mesh((1, 8, 2), sharding.AXES)
  specs = {
    jax.tree_util.keystr(p): s.spec
    for p, s in jax.tree_util.tree_leaves_with_path(sharding.state_sharding(state, mesh))
  }
  layer = (None,) if scan else ()  # a stack's layer axis: never sharded
  experts = f"['params']{EXPERTS_AT[scan]}"
  assert tuple(specs[f"{experts}['w_gate_up'].value"]) == (*layer, "expert", "fsdp", None)
  assert tuple(specs[f"{experts}['w_down'].value"]) == (*layer, "expert", None, "fsdp")
  mu = f"['opt_state'][1][0].mu{EXPERTS_AT[scan]}"
  assert tuple(specs[f"{mu}['w_gate_up'].value"]) == (*layer, "expert", "fsdp", None)


# --------------------------------------------------------------------- config keys


@pytest.mark.parametrize(
  ("key", "allowed"),
  [
    ("remat", "none, full, minimal, dots_saveable"),
    ("attention", "xla, dot_product, splash, tokamax"),
  ],
)
def test_bad_choice_is_a_one_line_user_error(key, allowed):
  c = config_lib.base_config()
  assert c.model[key] == {"remat": "none", "attention": "xla"}[key]
  c.model[key] = "bogus"
  with pytest.raises(UserError) as e:
    resolve(c)
  assert str(e.value) == f"model.{key}='bogus' is not allowed; use one of {allowed}"
