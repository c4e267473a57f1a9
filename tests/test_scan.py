"""`model.scan_layers`: the scanned layer stack against the unrolled one.

The layout (which layer is which stack row) is written out by hand for each case here, not
read from `moejax.nn.stack`; forwards, router outputs, gradients and train steps are then
compared bitwise (XLA:CPU gives bitwise equality with a remat policy, where both layouts run the same
`jax.checkpoint`; without one, gradients agree to float32 rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failure_helpers import tiny
from flax import nnx

from moejax import build
from moejax.errors import UserError
from moejax.nn import stack
from moejax.nn.model import ModelConfig, Transformer, moe_biases
from moejax.nn.moe import MoEConfig
from moejax.nn.overrides import Overrides
from moejax.training import step as step_lib
from moejax.training import optim, trainer
from moejax.training import workdir as workdir_lib
from runconfig import as_run

# (n_layers, first_dense, moe_every) -> layer i at (segment, row, position), by hand.
LAYOUTS = {
  (3, 0, 1): [(0, 0, 0), (0, 1, 0), (0, 2, 0)],
  # dense prefix [0]; period (MoE, dense) x 2: layers 1-4; the remainder (MoE): layer 5
  (6, 1, 2): [(0, 0, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (2, 0, 0)],
  # period (MoE, dense, dense) x 1: layers 0-2; remainder (MoE, dense): layers 3-4
  (5, 0, 3): [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0), (1, 0, 1)],
  (2, 2, 1): [(0, 0, 0), (0, 1, 0)],  # all dense: one prefix stack
}


@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_segments_place_every_layer_as_written_out(shape):
  n, first_dense, moe_every = shape
  is_moe = tuple(i >= first_dense and (i - first_dense) % moe_every == 0 for i in range(n))
  segs = stack.segments(n, is_moe, first_dense, moe_every)
  assert [tuple(p) for p in stack.places(segs)] == LAYOUTS[shape]
  for i, (s, r, j) in enumerate(LAYOUTS[shape]):
    assert segs[s].layer(r, j) == i and segs[s].moe[j] == is_moe[i]


def config(shape, scan: bool, **kw) -> ModelConfig:
  n, first_dense, moe_every = shape
  moe = MoEConfig(d_model=32, n_experts=4, top_k=2, d_expert=16, **kw.pop("moe", {}))
  return ModelConfig(
    vocab_size=40,
    d_model=32,
    n_layers=n,
    n_heads=2,
    n_kv_heads=1,
    d_ff=48,
    moe=moe,
    moe_every=moe_every,
    first_dense=first_dense,
    scan_layers=scan,
    **kw,
  )


def by_layer(params, shape) -> dict[str, np.ndarray]:
  """{"layer/rest" | "name/...": array} from either layout, by the hand-written LAYOUTS."""
  out = {}
  for keypath, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = build.param_names(keypath)
    a = np.asarray(leaf)
    if names[0] == "layers":
      out["/".join(names)] = a
    elif names[0] == "stacks":
      s, j = int(names[1]), int(names[3])
      for i, (s_i, r_i, j_i) in enumerate(LAYOUTS[shape]):
        if (s_i, j_i) == (s, j):
          out["/".join(("layers", str(i), *names[4:]))] = a[r_i]
    else:
      out["/".join(names)] = a
  return out


def forward(cfg: ModelConfig, tokens, train: bool, ov: Overrides):
  """(params, f): the model's parameters and f(params) -> (logits, routers)."""
  graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def f(params):
    model = nnx.merge(graphdef, params, rest)
    return model(tokens, train=train, rng=jax.random.key(5), ov=ov, step=jnp.int32(3))

  return params, f


def forward_and_grads(cfg: ModelConfig, tokens, train: bool, ov: Overrides):
  params, f = forward(cfg, tokens, train, ov)

  def loss(params):
    logits, routers = f(params)
    aux = sum(r.logits.sum() * 1e-3 + r.diag.routed_out_rms for r in routers.values())
    return logits.sum() * 1e-2 + aux, (logits, routers)

  (_, (logits, routers)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return params, logits, routers, grads


CASES = {
  "dropless": {},
  "remat_full": {"remat": "full"},
  "remat_minimal": {"remat": "minimal"},
  "capacity": {"moe": {"dispatch": "capacity", "capacity_factor": 1.0}},
  "elastic": {"moe": {"train_k": "uniform", "train_k_scope": "token"}},
  "random_second": {"moe": {"second_expert": "random", "jitter_eps": 0.1}},
}


# The same jax.checkpoint in both layouts: bitwise on jax 0.11 (XLA:CPU schedules the two
# backward programs alike); on jax 0.10.2 one layer's router kernel and norm scale differ by
# 3.5e-8 and 1.2e-8 relative (measured), float32 rounding, held by the rtol below.
BITWISE_GRADS = ("remat_full", "remat_minimal") if jax.__version_info__ >= (0, 11) else ()


# The default tier keeps one unrolled-vs-scanned case per kind of assertion (a 6-layer stack
# with a dense prefix and MoE period 2; a remat policy, asserted bitwise); the full tier runs
# every case at both shapes (each case compiles four programs: 10-25 s here).
SHAPES = ((3, 0, 1), (6, 1, 2))
# (the 6x1x2 shape stays in the default tier through test_scan_unroll_gives_the_unrolled_stacks_numbers)
DEFAULT_CASES = {("remat_full", (3, 0, 1))}


def tiered(pairs, default) -> list:
  """(case, shape) params, named `case-LxDxM`, all but `default` marked full."""
  return [
    pytest.param(
      c, s, id=f"{c}-{'x'.join(map(str, s))}", marks=() if (c, s) in default else pytest.mark.full
    )
    for c, s in pairs
  ]


def unrolled_against_scanned(shape, case: str, unroll: int = 1) -> dict:
  """Trains one forward and gradient of CASES[case] unrolled and scanned (`model.scan_unroll`
  `unroll`); asserts init, logits and router outputs bitwise equal and returns the gradients'
  relative differences (`assert_same`, each within float32 rounding, 1e-5)."""
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 40)
  kw = {k: dict(v) if isinstance(v, dict) else v for k, v in CASES[case].items()}
  (p0, l0, r0, g0), (p1, l1, r1, g1) = (
    forward_and_grads(config(shape, scan, **kw, **layout), tokens, True, Overrides())
    for scan, layout in ((False, {}), (True, {"scan_unroll": unroll}))
  )
  assert "stacks" in nnx.to_pure_dict(p1) and "layers" not in nnx.to_pure_dict(p1)
  assert_same(by_layer(p0, shape), by_layer(p1, shape), "init")
  np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))
  assert list(r0) == list(r1) and list(r0)  # the MoE layers, in order
  for i in r0:
    assert_same(r0[i]._asdict(), r1[i]._asdict(), f"router out of layer {i}")
  return assert_same(by_layer(g0, shape), by_layer(g1, shape), "grads", rtol=1e-5)


@pytest.mark.parametrize(
  "case,shape", tiered([(c, s) for s in SHAPES for c in CASES], DEFAULT_CASES)
)
def test_scanned_train_forward_and_gradients_equal_unrolled_bitwise(shape, case):
  # float32 rounding where the layouts' backward programs differ (remat "none": the scanned
  # body recomputes elementwise ops, casts and layout, `remat.save_expensive`); bitwise with remat
  bad = unrolled_against_scanned(shape, case)
  print(case, shape, "bitwise" if not bad else max(bad.values()))
  if case in BITWISE_GRADS:
    assert not bad, bad


# `model.scan_unroll`, the same stacked layout as other programs: 0 unrolls each scan whole
# (no loop; a block with remat "none" is not checkpointed, as unrolled); 2 at (3, 0, 1)'s 3
# repeats runs a trip of 2 periods and a remainder of 1, with the scanned body's checkpoint.
# Forward and router outputs are the unrolled stack's bitwise; gradients are bitwise with a
# remat policy (BITWISE_GRADS) and within float32 rounding without one: XLA:CPU emits the
# stacked program's kernels by ISA (bitwise on an AVX-512 host; 6.7e-8 relative on CI's host
# for elastic, and for dropless under --xla_cpu_max_isa=AVX2). Which blocks are
# checkpointed is asserted on the jaxpr below, whatever the host.
UNROLLS = [
  pytest.param(0, "remat_full", (6, 1, 2), id="0-remat_full-6x1x2"),
  pytest.param(0, "dropless", (6, 1, 2), id="0-dropless-6x1x2", marks=pytest.mark.full),
  pytest.param(2, "remat_full", (3, 0, 1), id="2-remat_full-3x0x1", marks=pytest.mark.full),
  pytest.param(0, "elastic", (3, 0, 1), id="0-elastic-3x0x1", marks=pytest.mark.full),
]


@pytest.mark.parametrize("unroll,case,shape", UNROLLS)
def test_scan_unroll_gives_the_unrolled_stacks_numbers(unroll, case, shape):
  bad = unrolled_against_scanned(shape, case, unroll)
  if case in BITWISE_GRADS:
    assert not bad, bad


# (6, 1, 2)'s segments: the dense prefix x 1, (MoE, dense) x 2, (MoE) x 1. jax writes a scan
# body into the jaxpr once, however it unrolls, so a checkpointed body counts its blocks once.
CHECKPOINTED = [
  pytest.param(False, 1, "none", 0, id="unrolled"),
  pytest.param(True, 1, "none", 2, id="looped"),  # only (MoE, dense) x 2 loops
  pytest.param(True, 2, "none", 0, id="unroll2"),  # 2 reaches every segment's repeats
  pytest.param(True, 0, "none", 0, id="unroll0"),
  pytest.param(True, 0, "full", 4, id="unroll0_full"),  # a policy wraps every block
]


@pytest.mark.parametrize("scan,unroll,remat,blocks", CHECKPOINTED)
def test_a_remat_none_block_is_checkpointed_only_in_a_looping_scan(scan, unroll, remat, blocks):
  remat_p = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive.name
  cfg = config((6, 1, 2), scan, remat=remat, scan_unroll=unroll)
  params, f = forward(cfg, jnp.zeros((2, 8), jnp.int32), True, Overrides())
  assert str(jax.make_jaxpr(lambda p: f(p)[0])(params)).count(f"{remat_p}[") == blocks


@pytest.mark.parametrize(
  "ov",
  [
    pytest.param(Overrides(k=1), marks=pytest.mark.full),
    Overrides(k=1, k2=jnp.int32(3), grid_stats=True),
    pytest.param(
      Overrides(k=2, routed_scale=jnp.asarray([0.5, 2.0, 1.5]), grid_stats=True),
      marks=pytest.mark.full,
    ),
  ],
  ids=["k1", "k1_k2", "routed_scale"],
)
def test_scanned_grid_cells_equal_unrolled_bitwise(ov):
  """The grid's cells at eval: k1, a traced k2, and a per-MoE-layer routed scale (rows in
  layer order: layers 1, 3, 5 of (6, 1, 2))."""
  shape = (6, 1, 2)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 40)
  out = [forward_and_grads(config(shape, scan), tokens, False, ov)[1:3] for scan in (False, True)]
  np.testing.assert_array_equal(np.asarray(out[0][0]), np.asarray(out[1][0]))
  assert list(out[0][1]) == [1, 3, 5]
  for i in out[0][1]:
    assert_same(out[0][1][i]._asdict(), out[1][1][i]._asdict(), f"layer {i}")
  if ov.grid_stats:
    assert all(r.moe_out_rms is not None for r in out[1][1].values())


def assert_same(a: dict, b: dict, what: str, rtol: float = 0.0) -> None:
  """Leaf by leaf bitwise equal, or with `rtol` within rtol of the leaf's largest entry."""
  a = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(a)}
  b = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(b)}
  assert a.keys() == b.keys(), what
  bad = {
    jax.tree_util.keystr(k): float(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() or 1.0))
    for k in a
    if not np.array_equal(a[k], b[k])
  }
  assert all(d <= rtol for d in bad.values()), f"{what}: differ at {bad}"
  return bad


def test_train_steps_with_bias_updates_equal_unrolled():
  """Three train steps of the trainer's own step (AdamW, losses, the aux-loss-free bias
  update on stacked router biases) from one config in both layouts: the first step agrees
  to float32 rounding (remat "none": the scanned body's policy, `remat.save_expensive`,
  recomputes what the unrolled program saves) and moves the biases alike; later steps agree
  to float32 rounding as amplified by
  AdamW (its update m/√v divides near-zero gradients: 2e-5 relative in grad_norm at step 3
  of this config, measured)."""
  metrics, biases = {}, {}
  for scan in (False, True):
    c = tiny(
      model__scan_layers=scan,
      model__n_layers=3,
      model__moe__rule="deepseek_v3",
      model__moe__n_experts=8,
      model__moe__n_groups=4,
      model__moe__topk_groups=2,
      loss__bias_update_rate=0.01,
    )
    run = trainer.build(as_run(c), None)
    step = jax.jit(step_lib.make_train_step(run.graphdef, run.tx, loss_of(c), run.schedule))
    state, batches, rows = run.state, run.data.train_iterator(), []
    for i in range(3):
      state, m = step(state, jnp.asarray(next(batches)["tokens"]), jax.random.key(i))
      rows.append({k: float(v) for k, v in m.items()})
      if i == 0:
        model = nnx.merge(run.graphdef, state["params"], state["router"])
        biases[scan] = np.asarray(moe_biases(model))
    metrics[scan] = rows
  assert metrics[False][0] == pytest.approx(metrics[True][0], rel=1e-6, abs=1e-9)
  np.testing.assert_array_equal(biases[False], biases[True])
  assert np.abs(biases[True]).max() > 0  # the update ran
  for a, b in zip(metrics[False][1:], metrics[True][1:]):
    assert a == pytest.approx(b, rel=1e-3, abs=1e-7)


def loss_of(c):
  return as_run(c).with_shards(1).loss


def test_resume_in_the_other_layout_is_refused_naming_the_key(tmp_path):
  """config.json's layout and the checkpoints' must agree; a run saved before the key
  existed holds the unrolled layout."""
  saved = {"model": {"scan_layers": False}}
  c = tiny(model__scan_layers=True)
  with pytest.raises(UserError, match=r"model\.scan_layers=True differs .*unrolled"):
    workdir_lib.check_layout(saved, as_run(c), "DIR/config.json")
  workdir_lib.check_layout(saved, as_run(tiny(model__scan_layers=False)), "DIR/config.json")
  assert workdir_lib.from_saved({"model": {"n_layers": 2}}).model.scan_layers is False
  assert workdir_lib.from_saved({"model": {"scan_layers": True}}).model.scan_layers is True


def test_both_layouts_count_the_same_parameters():
  for shape in LAYOUTS:
    counts = [
      build.count_params(build.abstract_params(config(shape, s)), None) for s in (False, True)
    ]
    assert counts[0] == counts[1], shape


def test_weight_decay_masks_the_same_parameters_in_both_layouts():
  """AdamW decays matrices only: a scanned [L, D] norm scale is a vector per layer, as unrolled
  (the reference: each unrolled leaf's own rank, one layer's parameters)."""
  shape = (6, 1, 2)
  masks = {}
  for scan in (False, True):
    model = Transformer(config(shape, scan, qk_norm=True, qkv_bias=True), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = optim.decay_mask(params)
    masks[scan] = by_layer(jax.tree.map(lambda p, m: np.full(p.shape, m), params, mask), shape)
  unrolled = by_layer(
    nnx.state(
      Transformer(config(shape, False, qk_norm=True, qkv_bias=True), rngs=nnx.Rngs(0)), nnx.Param
    ),
    shape,
  )
  want = {name: np.full(a.shape, a.ndim >= 2) for name, a in unrolled.items()}
  assert any(not m.any() for m in want.values()) and any(m.all() for m in want.values())
  for scan in (False, True):
    assert masks[scan].keys() == want.keys()
    for name in want:
      np.testing.assert_array_equal(masks[scan][name], want[name], err_msg=f"{scan} {name}")
