"""Data-parallel training on 8 (host) devices equals training on one (moejax.sharding).

Meshes (data × fsdp × expert) equivalence-tested here against one unsharded device, two
train steps each, parameters within 1e-5:
  8 × 1 × 1   pure data parallel, one sequence per device;
  4 × 2 × 1   data × fsdp, gradient accumulation 2, DeepSeek-V3 bias updates, shared expert;
  4 × 1 × 2   experts split over 2 devices.
A checkpoint saved on 2 × 4 × 1 restores, values unchanged, onto 4 × 1 × 2 and 8 × 1 × 1
with the new mesh's placements. Two processes (multi-host) are test_multihost.py's.

The main pytest process may have initialized JAX with one device already, so the check
runs as a script in a subprocess with `--xla_force_host_platform_device_count=8`.
"""

from __future__ import annotations

import textwrap

import jax
import pytest
from failure_helpers import results_on_host_devices, tiny
from jax.sharding import PartitionSpec as P
from tiers import FULL

from moejax import build, sharding
from moejax.backend import compat
from moejax.errors import UserError
from moejax.nn import stack
from moejax.nn.model import layer_segments
from moejax.training import trainer
from runconfig import as_run

SCRIPT = textwrap.dedent(r'''
  import json, sys
  import jax, jax.numpy as jnp, numpy as np
  from moejax import build, config as config_lib, sharding
  from moejax.training import optim, trainer, step as step_lib
  from moejax.errors import UserError
  from moejax.nn.losses import LossConfig
  sys.path.insert(0, "tests")  # the script runs with the repository as its cwd
  from failure_helpers import TINY_SHAPE, override

  assert jax.device_count() == 8, jax.devices()

  def config(**values):
    base = {**TINY_SHAPE, "data.batch_size": 8, "data.seq_len": 16,
            "optim.warmup_steps": 0, "train.steps": 10, "wandb.mode": "disabled",
            # Adam's g/(|g| + eps) turns rounding-level gradient differences of near-zero
            # gradients into O(lr) parameter differences; a large eps keeps the comparison
            # at the gradients' precision.
            "optim.eps": 1e-3}
    return config_lib.resolve(override(config_lib.base_config(), {**base, **values}))

  def two_steps(c):
    """2 steps on the mesh of c (as trainer.train jits them) and on one device, unsharded."""
    run = trainer.build(c, None)
    tx, schedule = optim.optimizer(c.optim, c.train.steps)
    tokens = np.asarray(next(run.data.train_iterator())["tokens"])
    host_state = jax.device_get(run.state)
    out = {"mesh": dict(run.mesh.shape)}

    # Sharded, exactly as trainer.train runs it.
    shardings = sharding.state_sharding(run.state, run.mesh)
    lc = c.with_shards(sharding.data_shards(run.mesh)).loss
    fn = jax.jit(step_lib.make_train_step(run.graphdef, tx, lc, schedule), donate_argnums=0,
                 out_shardings=(shardings, None))
    batch = jax.device_put(tokens, sharding.batch_sharding(run.mesh))
    out["batch_devices"] = len(batch.sharding.device_set)
    out["batch_shards"] = sorted({tuple(s.data.shape) for s in batch.addressable_shards})
    out["batch_n_shards"] = len(batch.addressable_shards)
    out["batch_replicated"] = batch.sharding.is_fully_replicated
    state = run.state
    for i in range(2):
      state, m = fn(state, batch, jax.random.key(i))
    sharded = jax.device_get(state)
    out["loss"] = [float(m["loss"])]
    expert_w = [x for path, x in jax.tree_util.tree_leaves_with_path(state["params"])
                if "experts" in jax.tree_util.keystr(path)][0]
    out["expert_w_spec"] = list(expert_w.sharding.spec)
    out["expert_w_shards"] = sorted({tuple(x.data.shape) for x in expert_w.addressable_shards})
    out["grad_norm"] = [float(m["grad_norm"])]

    # One device, no shardings.
    dev0 = jax.devices()[0]
    ref_fn = jax.jit(step_lib.make_train_step(run.graphdef, tx, c.loss,
                                            schedule))
    ref = jax.device_put(host_state, dev0)
    ref_batch = jax.device_put(tokens, dev0)
    for i in range(2):
      ref, m = ref_fn(ref, ref_batch, jax.random.key(i))
    out["ref_devices"] = len({d for x in jax.tree.leaves(ref) for d in x.sharding.device_set})
    ref = jax.device_get(ref)
    out["loss"].append(float(m["loss"]))
    out["grad_norm"].append(float(m["grad_norm"]))

    worst = 0.0  # max over params of |a - b| / (|b| + 0.01), elementwise
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sharded["params"]),
                            jax.tree.leaves(ref["params"])):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      err = float(np.max(np.abs(a - b) / (np.abs(b) + 0.01)))
      if err >= worst:
        worst, out["worst_leaf"] = err, jax.tree_util.keystr(path)
    out["max_rel_diff"] = worst
    out["router_equal"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                              zip(jax.tree.leaves(sharded["router"]), jax.tree.leaves(ref["router"])))
    out["params_moved"] = bool(any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(sharded["params"]), jax.tree.leaves(host_state["params"]))))
    biases = [np.asarray(x) for x in jax.tree.leaves(sharded["router"])]
    out["bias_moved"] = bool(any(np.abs(b).max() > 0 for b in biases))
    return out

  results = {
      # 8-way data parallel, batch 8: one sequence per device.
      "data8": two_steps(config(**{"mesh.data": 8})),
      # data x fsdp, gradient accumulation (two-pass global f), DeepSeek-V3 bias updates.
      "fsdp_accum_bias": two_steps(config(**{
          "mesh.data": 4, "mesh.fsdp": 2, "data.batch_size": 16, "train.grad_accum": 2,
          "model.moe.rule": "deepseek_v3", "model.moe.n_groups": 4,
          "model.moe.topk_groups": 2, "model.moe.d_shared": 32,
          "loss.bias_update_rate": 0.01})),
      # experts sharded over 2 devices.
      "expert2": two_steps(config(**{"mesh.data": 4, "mesh.expert": 2})),
  }
  def cross_mesh_restore(save_mesh, restore_mesh):
    """Save a perturbed state on one mesh, restore it onto another."""
    import tempfile
    from moejax.training import checkpoint
    a = trainer.build(config(**save_mesh), None)
    b = trainer.build(config(**restore_mesh), None)
    saved = jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x + 7,
                         a.state)
    d = tempfile.mkdtemp()
    mngr = checkpoint.manager(d)
    checkpoint.save(mngr, 7, saved, {"position": 3})
    mngr.close()
    mngr = checkpoint.manager(d)
    step, state, data = checkpoint.restore(mngr, b.state)
    mngr.close()
    pairs = list(zip(jax.tree.leaves(jax.device_get(saved)), jax.tree.leaves(jax.device_get(state))))
    before = jax.tree.leaves(jax.device_get(b.state))
    return {
        "step": step, "data": data, "saved_mesh": dict(a.mesh.shape),
        "mesh": sorted({tuple(x.sharding.mesh.shape.items()) for x in jax.tree.leaves(state)}),
        "n_leaves": len(pairs),
        "equal": all(np.array_equal(x, y) for x, y in pairs),
        "changed": all(not np.array_equal(y, z) for (_, y), z in zip(pairs, before)),
        "placed": all(x.sharding == y.sharding for x, y in
                      zip(jax.tree.leaves(state), jax.tree.leaves(b.state))),
        "fsdp_split_saved": any(x.addressable_shards[0].data.shape != x.shape
                                for x in jax.tree.leaves(saved) if x.ndim >= 2),
        "expert_shard": [list(x.addressable_shards[0].data.shape)
                         for p, x in jax.tree_util.tree_leaves_with_path(state["params"])
                         if "experts" in jax.tree_util.keystr(p)][0],
    }

  fsdp4 = {"mesh.data": 2, "mesh.fsdp": 4}
  results["restore_expert2"] = cross_mesh_restore(fsdp4, {"mesh.data": 4, "mesh.expert": 2})
  results["restore_data8"] = cross_mesh_restore(fsdp4, {"mesh.data": 8})
  try:
    trainer.build(config(**{"mesh.data": 3}), None)
    results["mesh3_error"] = None
  except UserError as e:
    results["mesh3_error"] = str(e)
  print("RESULTS " + json.dumps(results))
''')


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  path = tmp_path_factory.mktemp("sharding") / "sharded_vs_single.py"
  return results_on_host_devices(
    SCRIPT, path, 8, timeout=300, WANDB_MODE="disabled", JAX_DISABLE_MOST_OPTIMIZATIONS="1"
  )


@FULL
def test_batch_is_split_over_8_devices(results):
  r = results["data8"]
  assert r["mesh"] == {"data": 8, "fsdp": 1, "expert": 1}
  assert r["batch_devices"] == 8 and r["batch_n_shards"] == 8
  assert not r["batch_replicated"]
  assert r["batch_shards"] == [[1, 17]]  # one of the 8 sequences (16 + 1 tokens) each
  assert r["ref_devices"] == 1


@FULL
@pytest.mark.parametrize("name", ["data8", "fsdp_accum_bias", "expert2"])
def test_sharded_steps_match_one_device(results, name):
  r = results[name]
  assert r["params_moved"]
  assert r["max_rel_diff"] < 1e-5, (r["max_rel_diff"], r.get("worst_leaf"))
  assert r["router_equal"]  # bias updates from global-batch loads (integer counts)
  for key in ("loss", "grad_norm"):
    sharded, single = r[key]
    assert abs(sharded - single) <= 1e-5 * abs(single), (key, sharded, single)


@FULL
def test_fsdp_and_expert_meshes(results):
  r = results["fsdp_accum_bias"]
  assert r["mesh"] == {"data": 4, "fsdp": 2, "expert": 1}
  assert r["batch_shards"] == [[2, 17]]  # 16 sequences over data x fsdp = 8
  assert r["bias_moved"]
  e = results["expert2"]
  assert e["mesh"] == {"data": 4, "fsdp": 1, "expert": 2}
  assert e["expert_w_spec"][:2] == [None, "expert"]  # [layer, E, D, F]: the layer axis whole
  assert e["expert_w_shards"] == [[2, 4, 32, 32]]  # 8 experts over 2: 4 per device, 2 layers
  assert results["data8"]["expert_w_shards"] == [[2, 8, 32, 32]]
  assert e["batch_shards"] == [[2, 17]]  # replicated over `expert`, split over data


@FULL
def test_mesh_that_does_not_fit_the_devices_is_a_user_error(results):
  message = results["mesh3_error"]
  assert message is not None, "mesh.data=3 on 8 devices was accepted"
  assert "mesh.data" in message and "8" in message, message
  assert "\n" not in message


@FULL
@pytest.mark.parametrize(
  ("name", "mesh", "expert_shard"),
  [
    ("restore_expert2", [["data", 4], ["fsdp", 1], ["expert", 2]], [2, 4, 32, 32]),
    ("restore_data8", [["data", 8], ["fsdp", 1], ["expert", 1]], [2, 8, 32, 32]),
  ],
)
def test_checkpoint_restores_onto_another_mesh(results, name, mesh, expert_shard):
  r = results[name]
  assert r["saved_mesh"] == {"data": 2, "fsdp": 4, "expert": 1} and r["fsdp_split_saved"]
  assert r["mesh"] == [mesh]  # every restored leaf lives on the new mesh ...
  assert r["placed"]  # ... with the placement the new mesh gives it
  assert r["expert_shard"] == expert_shard  # 2 layers x 8 experts over `expert` (2 or 1)
  assert r["step"] == 7 and r["data"] == {"position": 3}
  assert r["n_leaves"] > 10 and r["equal"] and r["changed"]  # the saved values, not the init


def test_a_mesh_larger_than_this_host_is_refused_in_one_line():
  """The default tier's sharding check (the 8-device runs above are in the full tier): on
  this process's one CPU device, a 2-way data axis is refused naming mesh.data."""
  c = tiny()
  c.mesh.data = 2
  with pytest.raises(UserError) as e:
    trainer.check_config(as_run(c))
  assert "mesh.data" in str(e.value) and "\n" not in str(e.value)


def _param_specs(c) -> dict[tuple, P]:
  """Parameter path (names) -> its spec on a (data 1, fsdp 2, expert 2) abstract mesh."""
  mesh = compat.abstract_mesh((1, 2, 2), sharding.AXES)
  params = build.abstract_params(as_run(c).with_vocab(64).model)
  flat = jax.tree_util.tree_leaves_with_path(sharding.state_sharding(params, mesh))
  return {build.param_names(p): s.spec for p, s in flat}


def test_a_stacks_layer_axis_is_never_sharded():
  """Scanned stacks (`model.scan_layers`) shard as their layers do, behind a whole layer
  axis: a routed expert [R, E, D, F] is (None, expert, fsdp, None) even where R divides the
  fsdp axis, and every leaf is its unrolled layers' spec with None in front."""
  c = tiny()
  c.model.update(n_layers=5, first_dense=1, moe_every=2)  # a stack of R = 2 periods
  c.model.moe.n_experts = 4
  scanned = _param_specs(c)
  c.model.scan_layers = False
  unrolled = _param_specs(c)
  w_gate_up = ("stacks", "1", "blocks", "0", "mlp", "experts", "w_gate_up")
  assert tuple(scanned[w_gate_up]) == (None, "expert", "fsdp", None)
  assert tuple(scanned[("stacks", "1", "blocks", "0", "attn", "q_proj", "kernel")])[:2] == (
    None,
    "fsdp",
  )
  segs = layer_segments(as_run(c).with_vocab(64).model)
  seen = set()
  for path, spec in unrolled.items():
    new, row = stack.scanned_path(path, segs)
    assert tuple(scanned[new]) == (tuple(spec) if row is None else (None, *spec)), path
    seen.add(new)
  assert seen == set(scanned)  # every stacked leaf is some layers' leaf
  assert all(spec and spec[0] is None for p, spec in scanned.items() if p[0] == "stacks")
