"""The training loop and the train step (docs/design.md §5): resume, accumulation, bias update.

In-process, on tiny configs. The trainer jits fresh closures in every `trainer.train`
call, so this module turns on JAX's persistent compilation cache (runs and steps with the
same program compile once) and XLA's cheap compiles (`jax_disable_most_optimizations`);
both are restored when the module is done. test_cli.py runs the default compiler.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_collections
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
from tiers import FULL, one_default

from moejax import sharding
from moejax.nn.losses import LossConfig
from moejax.nn.model import moe_biases
from moejax.training import checkpoint, optim, trainer
from moejax.training import step as step_lib
from runconfig import as_run

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
QUIET = {"log": lambda *a: None}

# Tiny shapes for every test here: 2 layers, d_model 32, batch 4 x 32 tokens.
TINY = {**TINY_RUN, "data.seq_len": 32, "train.progress": False}


def tiny_config(**values) -> ml_collections.ConfigDict:
  """base_config() shrunk by this module's TINY, then `values` (keys spelled with `__`)."""
  return tiny(TINY, **values)


def loss_config(c: ml_collections.ConfigDict, **changes) -> LossConfig:
  """The LossConfig trainer.train builds from `c` (one device: n_shards 1)."""
  return dataclasses.replace(as_run(c).with_shards(1).loss, **changes)


def first_batch(run: trainer.Run) -> jax.Array:
  return jnp.asarray(next(run.data.train_iterator())["tokens"])


def restore(workdir: str, abstract_state, step: int | None = None):
  """(step, state, data_state) of a run's checkpoint, via moejax.training.checkpoint."""
  return checkpoint.restore(checkpoint.manager(workdir), abstract_state, step)


def router_biases(graphdef, params, router) -> list[np.ndarray]:
  """The selection bias of every MoE layer, in layer order."""
  return list(np.asarray(moe_biases(nnx.merge(graphdef, params, router))))


def all_finite(tree) -> bool:
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


# The shared config: DeepSeek-V3 routing (sigmoid, 4 groups keep 2, top-2 of 8 experts,
# selection bias with aux-loss-free updates) and global-batch balance loss.
BIAS_RATE = 0.01
N = 3  # resume: stop at N of 2N steps
BASE = {
  "model__moe__rule": "deepseek_v3",
  "model__moe__n_experts": 8,
  "model__moe__top_k": 2,
  "model__moe__n_groups": 4,
  "model__moe__topk_groups": 2,
  "model__moe__d_shared": 32,
  "loss__bias_update_rate": BIAS_RATE,
  "loss__balance_granularity": "global_batch",
  "train__steps": 2 * N,
  "train__ckpt_every": N,
  "train__log_every": 1,
}


def trainer_jit(run: trainer.Run, lc: LossConfig | None = None):
  """The train step jitted exactly as trainer.train does (same executable, cache hit)."""
  c = run.config
  tx, schedule = optim.optimizer(as_run(c).optim, as_run(c).train.steps)
  lc = lc or loss_config(c)
  shardings = sharding.state_sharding(run.state, run.mesh)
  return jax.jit(
    step_lib.make_train_step(run.graphdef, tx, lc, schedule),
    donate_argnums=0,
    out_shardings=(shardings, None),
  )


def fresh(state):
  """A copy to donate to a trainer_jit step (the run's own state stays usable)."""
  return jax.tree.map(jnp.copy, state)


@pytest.fixture(scope="module")
def base():
  """trainer.build of BASE, its first training batch and its trainer-jitted step."""
  run = trainer.build(as_run(tiny_config(**BASE)), None)
  return run, first_batch(run), trainer_jit(run)


@pytest.fixture(scope="module")
def forward(base):
  """jit(forward_loss) of the base model with a given LossConfig (eval mode, no rng)."""
  run = base[0]

  def fn(lc, params, router, tokens):
    return jax.jit(
      lambda p, r, t: step_lib.forward_loss(run.graphdef, p, r, t, None, lc, train=False)
    )(params, router, tokens)

  return fn


# ---------------------------------------------------------------- resume exactness


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
  """A 2N-step run stopped at N and resumed, and the same run uninterrupted."""
  split = str(tmp_path_factory.mktemp("split"))
  whole = str(tmp_path_factory.mktemp("whole"))
  at_n = str(tmp_path_factory.mktemp("at_n"))
  c = tiny_config(**BASE)
  trainer.train(as_run(override(c, {"train.stop_at": N})), split, **QUIET)
  shutil.copytree(split, at_n, dirs_exist_ok=True)  # the workdir as the first leg left it
  # As if killed after logging a step it did not checkpoint: the resumed run drops the row.
  with open(os.path.join(split, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": N + 1, "loss": 123.0}) + "\n")
  trainer.train(as_run(c), split, **QUIET)  # rerunning the same command resumes
  trainer.train(as_run(c), whole, **QUIET)
  return {"config": c, "split": split, "whole": whole, "at_n": at_n}


def test_stop_at_stops_and_checkpoints(resume_runs):
  rows = metric_rows(resume_runs["at_n"])
  assert [r["step"] for r in rows] == list(range(1, N + 1))
  assert "eval_loss" in rows[-1]  # the last step of a leg evaluates
  assert list(checkpoint.manager(resume_runs["at_n"]).all_steps()) == [N]


def test_resumed_loss_sequence_is_bitwise_identical(resume_runs):
  split, whole = metric_rows(resume_runs["split"]), metric_rows(resume_runs["whole"])
  assert [r["step"] for r in split] == list(range(1, 2 * N + 1))  # no row twice
  assert [r["step"] for r in whole] == list(range(1, 2 * N + 1))
  for key in ("loss", "lm_loss", "grad_norm", "lr", "moe/aux_loss", "moe/layer1/aux_loss"):
    assert [r[key] for r in split] == [r[key] for r in whole], key
  assert split[-1]["eval_loss"] == whole[-1]["eval_loss"]


def test_resumed_final_state_is_bitwise_identical(resume_runs, base):
  run = base[0]
  step_a, state_a, data_a = restore(resume_runs["split"], run.state)
  step_b, state_b, data_b = restore(resume_runs["whole"], run.state)
  assert step_a == step_b == 2 * N
  assert int(state_a["step"]) == 2 * N
  assert_trees_equal(state_a["params"], state_b["params"], "params")
  assert_trees_equal(state_a["opt_state"], state_b["opt_state"], "opt_state")
  assert_trees_equal(state_a["router"], state_b["router"], "router")
  assert data_a == data_b
  moved = jax.tree.map(
    lambda x, y: not np.array_equal(np.asarray(x), np.asarray(y)),
    state_a["params"],
    run.state["params"],
  )
  assert any(jax.tree.leaves(moved))  # training moved the params: the check is not vacuous


def test_trainer_loop_equals_the_step_function_run_by_hand(resume_runs, base):
  """trainer.train = its jitted step over data.train_iterator() with fold_in(seed, step)."""
  run, _, step_fn = base
  c = run.config
  state, it = fresh(run.state), run.data.train_iterator()
  rng = jax.random.key(c.train.seed)
  batch_sharding = sharding.batch_sharding(run.mesh)
  for i in range(c.train.steps):
    tokens = jax.device_put(next(it)["tokens"], batch_sharding)
    state, _ = step_fn(state, tokens, jax.random.fold_in(rng, i))
  _, restored, data_state = restore(resume_runs["whole"], run.state)
  assert_trees_equal(restored, state, "trained state")
  assert data_state == it.get_state()


# ---------------------------------------------------------------- gradient accumulation


def test_grad_accum_matches_one_big_batch(base):
  """grad_accum=2 on batch 4 = grad_accum=1 for global_batch (f from the two-pass pass)."""
  run, tokens, step1 = base
  c = run.config
  assert tokens.shape[0] == 4 and c.loss.balance_granularity == "global_batch"
  step2 = trainer_jit(run, loss_config(c, grad_accum=2))
  # From step 3, where the warmup learning rate is not 0 (Adam's count stays 0).
  start = {**run.state, "step": jnp.asarray(N, jnp.int32)}
  s1, m1 = step1(fresh(start), tokens, jax.random.key(7))
  s2, m2 = step2(fresh(start), tokens, jax.random.key(7))
  m1, m2 = jax.device_get(m1), jax.device_get(m2)
  assert m1["lr"] > 0
  for key in ("loss", "lm_loss", "moe/aux_loss", "moe/z_loss", "grad_norm"):
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, err_msg=key)
  # Adam's first moment after one step from 0 is (1 - b1)·grad: compare the gradients.
  mu1, mu2 = s1["opt_state"][1][0].mu, s2["opt_state"][1][0].mu
  scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(mu1))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mu1), jax.tree.leaves(mu2)):
    np.testing.assert_allclose(
      np.asarray(b),
      np.asarray(a),
      rtol=1e-5,
      atol=1e-7 * scale,
      err_msg="grad " + jax.tree_util.keystr(path),
    )
  router_mu = [
    np.asarray(g)
    for p, g in jax.tree_util.tree_leaves_with_path(mu1)
    if "router" in jax.tree_util.keystr(p)
  ]
  assert router_mu and all(np.abs(g).max() > 0 for g in router_mu)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(s1["params"]), jax.tree.leaves(s2["params"])
  ):
    np.testing.assert_allclose(
      np.asarray(b),
      np.asarray(a),
      rtol=1e-5,
      atol=1e-6,
      err_msg="param " + jax.tree_util.keystr(path),
    )
  # Loads summed over the micro-batches: the same bias update as the whole batch.
  assert_trees_equal(s1["router"], s2["router"], "router bias after one step")


def test_micro_batch_granularity_differs_from_global_batch(base, forward):
  """micro_batch over 2 shards = the mean of each half's own E·Σ f·P, not the global one."""
  run, tokens, _ = base
  c = run.config
  # Skew the routing: a large router kernel makes the halves' loads differ a lot.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x * 50.0 if "router" in jax.tree_util.keystr(p) else x, run.state["params"]
  )
  router = run.state["router"]
  glob_lc = loss_config(c, balance_granularity="global_batch")
  micro_lc = loss_config(c, balance_granularity="micro_batch", n_shards=2)

  def balance(lc, toks):
    _, (metrics, _) = forward(lc, params, router, toks)
    return float(metrics["moe/aux_loss"]), float(metrics["lm_loss"]), float(metrics["loss"])

  glob_b, glob_lm, glob_loss = balance(glob_lc, tokens)
  micro_b, micro_lm, micro_loss = balance(micro_lc, tokens)
  halves = [balance(glob_lc, tokens[i : i + 2])[0] for i in (0, 2)]
  np.testing.assert_allclose(micro_b, np.mean(halves), rtol=1e-5)
  assert abs(micro_b - glob_b) > 1e-3 * abs(glob_b), (micro_b, glob_b)
  assert micro_lm == pytest.approx(glob_lm, rel=1e-6)
  assert micro_loss != glob_loss


# ---------------------------------------------------------------- aux-loss-free bias update


def test_bias_update_direction(base, forward):
  """b_i moves by γ·sign(mean load − load_i), with loads from a forward pass before the step."""
  run, tokens, step_fn = base
  c = run.config
  params, router = run.state["params"], run.state["router"]
  before = router_biases(run.graphdef, params, router)
  assert len(before) == 2 and all(not b.any() for b in before)
  _, (_, loads) = forward(loss_config(c), params, router, tokens)
  loads_LxE = np.asarray(loads.all_LxE)  # every selected expert drives the bias update
  assert loads_LxE.shape == (2, 8)
  assert (loads_LxE.sum(-1) == tokens[:, :-1].size * 2).all()  # top-2 of every token
  new_state, _ = step_fn(fresh(run.state), tokens, jax.random.key(3))
  after = router_biases(run.graphdef, new_state["params"], new_state["router"])
  for layer, (b0, b1, load) in enumerate(zip(before, after, loads_LxE)):
    expected = BIAS_RATE * np.sign(load.mean() - load)
    np.testing.assert_allclose(b1 - b0, expected, atol=1e-7, err_msg=f"MoE layer {layer}")
    assert np.abs(b1).max() > 0, f"MoE layer {layer}: the bias did not move"
    # overloaded experts lose bias, underloaded ones gain
    assert (b1[load > load.mean()] < 0).all() and (b1[load < load.mean()] > 0).all()


def test_bias_is_checkpointed_and_restored(resume_runs, base):
  run = base[0]
  for workdir, step in ((resume_runs["at_n"], N), (resume_runs["whole"], 2 * N)):
    got, state, _ = restore(workdir, run.state, step)
    assert got == step
    biases = router_biases(run.graphdef, state["params"], state["router"])
    for b in biases:
      assert np.abs(b).max() > 0
      np.testing.assert_allclose(b / BIAS_RATE, np.round(b / BIAS_RATE), atol=1e-4)
      assert np.abs(b).max() <= step * BIAS_RATE + 1e-6
  # The resumed leg started from the biases saved at N (else it could not equal `whole`,
  # test_resumed_final_state_is_bitwise_identical); and they are not the ones at 2N.
  _, at_n, _ = restore(resume_runs["at_n"], run.state)
  _, at_2n, _ = restore(resume_runs["split"], run.state)
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(
      router_biases(run.graphdef, at_n["params"], at_n["router"]),
      router_biases(run.graphdef, at_2n["params"], at_2n["router"]),
    )
  )


def _split_gate_up(tree):
  """The split layout of a saved tree (dicts and lists, as orbax restores it without a
  target): each `w_gate_up [..., 2F]` written as `w_gate` [..., :F] and `w_up` [..., F:],
  as the code before the joined parameter saved params and AdamW moments."""
  if isinstance(tree, list):
    return [_split_gate_up(v) for v in tree]
  if not isinstance(tree, dict):
    return tree
  out = {k: _split_gate_up(v) for k, v in tree.items() if k != "w_gate_up"}
  if "w_gate_up" in tree:
    half = lambda a, i: np.split(np.asarray(a), 2, axis=-1)[i]  # noqa: E731
    out["w_gate"] = jax.tree.map(lambda a: half(a, 0), tree["w_gate_up"])
    out["w_up"] = jax.tree.map(lambda a: half(a, 1), tree["w_gate_up"])
  return out


def test_a_split_gate_up_checkpoint_is_converted_and_resumes_bitwise(resume_runs, base, tmp_path):
  """A checkpoint of the old layout (w_gate, w_up, and their moments) is converted on
  restore: the params read by evaluation/export equal the joined checkpoint's, and the run
  resumed from it ends on the uninterrupted run's state, bitwise."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  from moejax.hf import runstate  # pylint: disable=import-outside-toplevel
  from moejax.training import split_layout  # pylint: disable=import-outside-toplevel

  old = str(tmp_path / "old")
  shutil.copytree(resume_runs["at_n"], old)
  mngr = checkpoint.manager(old)
  args = ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore())
  raw = mngr.restore(N, args=args)
  mngr.close()
  shutil.rmtree(os.path.join(old, "checkpoints", str(N)))
  mngr = checkpoint.manager(old)
  checkpoint.save(mngr, N, _split_gate_up(raw.state), raw.data)
  mngr.close()
  saved = split_layout.saved_tree(checkpoint.manager(old), N)
  experts = saved["params"]["stacks"]["0"]["blocks"]["0"]["mlp"]["experts"]
  assert "w_gate_up" not in experts and experts["w_up"]["value"].shape[-1] == 32  # d_expert
  assert "w_up" in saved["opt_state"][1][0]["mu"]["stacks"]["0"]["blocks"]["0"]["mlp"]["shared"]
  run = base[0]
  mc = run.config.model
  params = runstate.abstract(mc)[1]
  at_n = runstate.restore_params(resume_runs["at_n"], params)
  assert runstate.restore_params(old, params).keys() == at_n.keys()
  for path, a in runstate.restore_params(old, params).items():
    np.testing.assert_array_equal(a, at_n[path], err_msg=str(path))
  trainer.train(as_run(resume_runs["config"]), old, **QUIET)
  _, state_a, data_a = restore(old, run.state)
  _, state_b, data_b = restore(resume_runs["whole"], run.state)
  for name in ("params", "opt_state", "router"):
    assert_trees_equal(state_a[name], state_b[name], name)
  assert data_a == data_b


# ---------------------------------------------------------------- divergence

STEP_IN_MESSAGE = re.compile(r"at step (\d+)")
CKPT_IN_MESSAGE = re.compile(r"checkpoints/(\d+)")


def test_nan_raises_diverged_and_keeps_the_last_checkpoint(
  resume_runs, base, tmp_path, monkeypatch
):
  """Params that turn NaN after the checkpoint at N: Diverged at N+1, checkpoint N kept."""
  run = base[0]
  workdir = str(tmp_path / "nan")
  shutil.copytree(resume_runs["at_n"], workdir)
  real_restore = checkpoint.restore

  def poisoned_restore(*args, **kwargs):
    step, state, data_state = real_restore(*args, **kwargs)
    params = jax.tree.map(lambda x: x * jnp.nan, state["params"])
    return step, {**state, "params": params}, data_state

  monkeypatch.setattr(checkpoint, "restore", poisoned_restore)
  with pytest.raises(trainer.Diverged) as info:
    trainer.train(as_run(resume_runs["config"]), workdir, **QUIET)
  monkeypatch.undo()
  message = str(info.value)
  assert STEP_IN_MESSAGE.search(message).group(1) == str(N + 1), message
  assert f"{workdir}/checkpoints/{N}" in message, message
  assert list(checkpoint.manager(workdir).all_steps()) == [N]
  assert [r["step"] for r in metric_rows(workdir)] == list(range(1, N + 1))
  step, state, _ = restore(workdir, run.state)
  assert step == N and all_finite(state)


@FULL
def test_huge_lr_diverges_and_the_named_checkpoint_is_good(tmp_path):
  """A real divergence: the checkpoint the message calls good restores with finite values.

  A step's logged loss is the loss *before* its update, so the update of the step whose
  gradient overflows must not be checkpointed as good.
  """
  c = tiny_config(
    optim__lr=1e6,
    optim__clip_norm=0.0,
    optim__warmup_steps=0,
    train__steps=12,
    train__ckpt_every=1,
    train__log_every=1,
  )
  workdir = str(tmp_path / "huge_lr")
  with pytest.raises(trainer.Diverged) as info:
    trainer.train(as_run(c), workdir, **QUIET)
  message = str(info.value)
  bad_step = int(STEP_IN_MESSAGE.search(message).group(1))
  good_step = int(CKPT_IN_MESSAGE.search(message).group(1))
  assert good_step < bad_step, message
  steps = checkpoint.manager(workdir).all_steps()
  assert good_step in steps and max(steps) == good_step, (message, steps)
  step, state, _ = restore(workdir, trainer.build(as_run(c), None).state, good_step)
  assert step == good_step
  bad = [
    jax.tree_util.keystr(p)
    for p, x in jax.tree_util.tree_leaves_with_path(state)
    if not np.isfinite(np.asarray(x)).all()
  ]
  assert not bad, (
    f"the 'last good checkpoint' {workdir}/checkpoints/{good_step} holds "
    f"non-finite values in {len(bad)} leaves, e.g. {bad[:3]}; "
    f"message: {message}"
  )
  rows = metric_rows(workdir)
  assert all(
    r["grad_norm"] is not None and math.isfinite(r["grad_norm"])
    for r in rows
    if r["step"] <= good_step
  ), rows


# ---------------------------------------------------------------- every preset trains

PRESET_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))


def load_preset(path: str) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location(
    "moejax_test_preset_" + os.path.basename(path)[:-3], path
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def shrink_preset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Tiny shapes; the rule, dispatch, E, top-k, groups and MoE placement stay the preset's."""
  m = c.model
  B, L = 2, 16
  values = {
    "model.n_layers": m.first_dense + 1,  # the first layer that is MoE is the last
    "model.d_model": 32,
    "model.n_heads": 2,
    "model.n_kv_heads": 1,
    "model.head_dim": 0,
    "model.d_ff": 32,
    "model.moe.d_expert": 16,
    "model.moe.d_shared": 16 if m.moe.d_shared else 0,
    "data.corpus": "synthetic",
    "data.synthetic_docs": 40,
    "data.tokenizer": "byte",
    "data.batch_size": B,
    "data.seq_len": L,
    "train.grad_accum": 1,
    "mesh.data": -1,
    "mesh.fsdp": 1,
    "mesh.expert": 1,
    "wandb.mode": "disabled",
  }
  if m.moe.group_size:
    values["model.moe.group_size"] = math.gcd(m.moe.group_size, B * L)
  return override(c, values)


def test_presets_are_found():
  names = {os.path.basename(p)[:-3] for p in PRESET_FILES}
  assert len(names) >= 12 and {"quickstart", "deepseek_v3", "switch", "gshard"} <= names


@pytest.mark.parametrize(
  "path",
  one_default(
    PRESET_FILES, os.path.join(CONFIG_DIR, "quickstart.py"), ids=lambda p: os.path.basename(p)[:-3]
  ),
)
def test_every_preset_builds_and_takes_a_train_step(path):
  preset = load_preset(path)
  c = shrink_preset(preset)
  for key in (
    "rule",
    "dispatch",
    "n_experts",
    "top_k",
    "n_groups",
    "topk_groups",
    "second_expert",
    "drop_policy",
  ):
    assert c.model.moe[key] == preset.model.moe[key], key
  run = trainer.build(as_run(c), None)
  model = nnx.merge(run.graphdef, run.state["params"], run.state["router"])
  assert moe_biases(model).shape[0] == 1
  assert model.cfg.moe.n_experts == preset.model.moe.n_experts
  assert model.cfg.moe.top_k == preset.model.moe.top_k
  tx, schedule = optim.optimizer(as_run(c).optim, as_run(c).train.steps)
  lc = loss_config(c, n_shards=sharding.data_shards(run.mesh))
  train_step = jax.jit(step_lib.make_train_step(run.graphdef, tx, lc, schedule))
  state, metrics = train_step(run.state, first_batch(run), jax.random.key(0))
  metrics = jax.device_get(metrics)
  assert int(state["step"]) == 1
  for key in ("loss", "lm_loss", "grad_norm", "moe/aux_loss", "moe/drop_fraction"):
    assert np.isfinite(metrics[key]), (key, metrics[key])
  assert abs(float(metrics["lm_loss"]) - math.log(run.data.tokenizer.vocab_size)) < 1.0
  assert all_finite(state)
  if c.loss.bias_update_rate > 0:
    bias = router_biases(run.graphdef, state["params"], state["router"])[0]
    assert np.abs(bias).max() > 0
