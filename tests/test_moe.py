"""moejax.nn.moe.MoEBlock against an independent NumPy forward pass (docs/design.md §2, §4, §6).

The reference reads the block's own parameters and recomputes router scores, top-k, the
rule's normalization, the SwiGLU experts, the shared expert and the diagnostics in float64,
with the per-rule conventions written here from docs/design.md's table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn import balance, losses
from moejax.nn.layers import init_normal
from moejax.nn.moe import Diagnostics, MoEBlock, MoEConfig, RouterBias, RouterOut
from moejax.nn.overrides import Overrides

D, F, E, K, T, FS = 16, 8, 8, 2, 12, 8  # d_model, d_expert, experts, top_k, tokens, d_shared

# docs/design.md §2 rows for the rules tested here: (score, norm, alpha(K), shared).
CONVENTIONS = {
  "mixtral": ("softmax", "sum", lambda K: 1.0, "none"),
  "olmoe": ("softmax", "none", lambda K: 1.0, "none"),
  "qwen2_moe": ("softmax", "none", lambda K: 1.0, "sigmoid"),
  "olmo": ("softmax", "sum", lambda K: float(K), "unit"),
  "kplus1": ("softmax", "none", lambda K: K / (K + 1.0), "kplus1"),
  "megatron": ("softmax", "sum", lambda K: 1.0, "unit"),
}

AUX_KEYS = {
  "aux_loss",
  "z_loss",
  "drop_fraction",
  "load_max_over_mean",
  "routed_mass",
  "shared_coef",
  "routed_out_rms",
  "router_entropy",
  "mean_k",
}


def aux_of(ro: RouterOut) -> dict:
  """The docs/design.md §6 per-layer values from a RouterOut: its diagnostics plus the two
  losses, computed as the trainer does (losses.py) on the whole call."""
  E_ = ro.probs.shape[-1]
  probs = ro.probs.reshape(1, -1, E_)
  assign = balance.balance_assignments(ro.experts, E_, "all").reshape(1, -1, E_)
  return {
    **ro.diag._asdict(),
    "aux_loss": balance.load_balance_loss(probs, assign, granularity="global_batch"),
    "z_loss": losses.router_z_loss(ro.logits),
  }


def _np(v) -> np.ndarray:
  return np.asarray(v[...], np.float64)


def make_block(rule: str, d_shared: int = FS, seed: int = 0, **kw) -> MoEBlock:
  """A block whose parameters are reset to O(1) values so that outputs are not ~0."""
  cfg = MoEConfig(d_model=D, n_experts=E, top_k=K, d_expert=F, d_shared=d_shared, rule=rule, **kw)
  block = MoEBlock(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 1)

  def reset(var, std):
    var[...] = jnp.asarray(rng.normal(scale=std, size=var[...].shape).astype(np.float32))

  reset(block.router.kernel, 0.5)
  for name in ("w_gate_up", "w_down"):
    reset(getattr(block.experts, name), 0.4)
    if d_shared > 0:
      reset(getattr(block.shared, name), 0.4)
  if hasattr(block, "shared_gate"):
    reset(block.shared_gate.kernel, 0.5)
  return block


def _x(seed: int = 0, shape=(3, 4, D)) -> np.ndarray:
  return np.random.default_rng(100 + seed).normal(size=shape).astype(np.float32)


def _swiglu(x, wg, wu, wd):
  h = x @ wg
  return ((h / (1.0 + np.exp(-h))) * (x @ wu)) @ wd


def ref_block(
  block: MoEBlock, rule: str, x: np.ndarray, *, k: int | None = None, k2: int | None = None
):
  """y, per-token r (dict expert -> r_i), c and diagnostics, in float64, token by token."""
  score, norm, alpha_fn, shared = CONVENTIONS[rule]
  Kt = K  # trained top-k
  k = Kt if k is None else k
  x2 = np.asarray(x, np.float64).reshape(-1, D)
  Wr = _np(block.router.kernel)
  wgu, wd = _np(block.experts.w_gate_up), _np(block.experts.w_down)
  wg, wu = wgu[..., :F], wgu[..., F:]  # gate in columns [0, F), up in [F, 2F)
  has_shared = block.cfg.d_shared > 0
  y = np.zeros_like(x2)
  routed = np.zeros_like(x2)
  mass, coefs, zsq, ent, loads, probs = [], [], [], [], np.zeros(E), np.zeros(E)
  for t in range(x2.shape[0]):
    z = x2[t] @ Wr
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    zsq.append(lse**2)
    s = np.exp(z - lse) if score == "softmax" else 1.0 / (1.0 + np.exp(-z))
    order = np.argsort(-s, kind="stable")
    sel = order[:k]
    if k2 is not None:
      p = s[sel] / s[order[:k2]].sum()
    elif norm == "sum":
      p = s[sel] / s[sel].sum()
    else:
      p = s[sel]
    r = alpha_fn(Kt) * p
    mass.append(r.sum())
    for i, ri in zip(sel, r):
      routed[t] += ri * _swiglu(x2[t], wg[i], wu[i], wd[i])
      loads[i] += 1
    pn = s / s.sum()
    probs += pn
    ent.append(-(pn * np.log(pn)).sum())
    c = 0.0
    if has_shared:
      c = {"none": 0.0, "unit": 1.0, "kplus1": 1.0 / (Kt + 1.0)}.get(shared)
      if shared == "sigmoid":
        c = 1.0 / (1.0 + np.exp(-(x2[t] @ _np(block.shared_gate.kernel))[0]))
    coefs.append(c)
    y[t] = routed[t]
    if has_shared and c != 0.0:
      sgu, fs = _np(block.shared.w_gate_up), block.cfg.d_shared
      y[t] += c * _swiglu(x2[t], sgu[:, :fs], sgu[:, fs:], _np(block.shared.w_down))
  n = x2.shape[0]
  f = loads / loads.sum()
  aux = {
    "aux_loss": E * np.sum(f * probs / n),
    "z_loss": np.mean(zsq),
    "drop_fraction": 0.0,
    "load_max_over_mean": loads.max() / loads.mean(),
    "routed_mass": np.mean(mass),
    "shared_coef": np.mean(coefs),
    "routed_out_rms": np.sqrt(np.mean(routed**2)),
    "router_entropy": np.mean(ent),
  }
  return y.reshape(x.shape), aux


# --------------------------------------------------------------------------- parameter tree


def _flat(state) -> dict[str, object]:
  return {".".join(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize(
  "rule,d_shared",
  [
    ("qwen2_moe", FS),
    ("qwen2_moe", 0),
    ("megatron", FS),
    ("kplus1", FS),
    ("olmo", FS),
    ("mixtral", 0),
  ],
)
def test_param_tree_names_and_shapes(rule, d_shared):
  cfg = MoEConfig(d_model=D, n_experts=E, top_k=K, d_expert=F, d_shared=d_shared, rule=rule)
  block = MoEBlock(cfg, rngs=nnx.Rngs(0))
  want = {
    "router.kernel": (D, E),
    "router.bias": (E,),
    "experts.w_gate_up": (E, D, 2 * F),
    "experts.w_down": (E, F, D),
  }
  if d_shared > 0:
    want.update({"shared.w_gate_up": (D, 2 * d_shared), "shared.w_down": (d_shared, D)})
    if rule == "qwen2_moe":  # the only rule here whose shared is "sigmoid"
      want["shared_gate.kernel"] = (D, 1)
  flat = _flat(nnx.state(block))
  assert {p: tuple(v[...].shape) for p, v in flat.items()} == want
  assert flat["router.kernel"][...].dtype == jnp.float32
  bias = flat["router.bias"]
  assert isinstance(bias, RouterBias) and not isinstance(bias, nnx.Param)
  assert bias[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(bias[...]), np.zeros(E))
  params = _flat(nnx.state(block, nnx.Param))
  assert "router.bias" not in params
  assert set(params) == set(want) - {"router.bias"}
  for p in ("experts.w_gate_up", "experts.w_down"):
    assert flat[p][...].dtype == jnp.float32


# --------------------------------------------------------------------------- forward vs NumPy


@pytest.mark.parametrize("rule", ["mixtral", "olmoe", "qwen2_moe", "olmo", "kplus1", "megatron"])
def test_block_matches_numpy(rule):
  block = make_block(rule, d_shared=0 if rule == "mixtral" else FS, seed=1)
  x = _x(1)
  y, ro = block(jnp.asarray(x))
  aux = aux_of(ro)
  y_ref, aux_ref = ref_block(block, rule, x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert np.abs(y_ref).mean() > 0.1  # the parameters are large enough to test anything
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
  for key, val in aux_ref.items():
    np.testing.assert_allclose(float(aux[key]), val, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("rule", ["mixtral", "olmoe", "qwen2_moe", "olmo", "kplus1"])
def test_block_k_and_k2_overrides(rule):
  block = make_block(rule, seed=2)
  x = _x(2)
  for kw in (dict(k=1), dict(k=2, k2=8), dict(k=1, k2=4)):
    y, ro = block(jnp.asarray(x), ov=Overrides(**kw))
    aux = aux_of(ro)
    y_ref, aux_ref = ref_block(block, rule, x, **kw)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5, err_msg=str(kw))
    np.testing.assert_allclose(
      float(aux["routed_mass"]), aux_ref["routed_mass"], rtol=1e-5, err_msg=str(kw)
    )
    np.testing.assert_allclose(
      float(aux["shared_coef"]), aux_ref["shared_coef"], rtol=1e-5, atol=1e-7, err_msg=str(kw)
    )
  # Spot values independent of the parameters: trained K = 2 drives the constants.
  aux = aux_of(block(jnp.asarray(x), ov=Overrides(k=1))[1])
  want_mass_k1 = {"mixtral": 1.0, "olmo": 2.0}
  if rule in want_mass_k1:
    np.testing.assert_allclose(float(aux["routed_mass"]), want_mass_k1[rule], rtol=1e-6)
  aux = aux_of(block(jnp.asarray(x), ov=Overrides(k=2, k2=8))[1])
  if rule == "olmo":  # 2 · Σ_{top-2} s / Σ_all s < 2
    assert float(aux["routed_mass"]) < 2.0 - 1e-3
  if rule == "kplus1":
    np.testing.assert_allclose(float(aux["shared_coef"]), 1.0 / 3.0, rtol=1e-6)


def test_block_k_override_out_of_range_raises():
  block = make_block("mixtral", d_shared=0)
  with pytest.raises(ValueError):
    block(jnp.asarray(_x()), ov=Overrides(k=E + 1))
  with pytest.raises(ValueError):
    block(jnp.asarray(_x()), ov=Overrides(k=2, k2=1))


# --------------------------------------------------------------------------- aux


def test_aux_keys_dtypes_and_z_loss():
  block = make_block("megatron", seed=3)
  x = _x(3)
  _, ro = block(jnp.asarray(x))
  assert isinstance(ro, RouterOut) and isinstance(ro.diag, Diagnostics)
  assert ro.logits.shape == ro.probs.shape == x.shape[:-1] + (E,)
  assert ro.experts.shape == x.shape[:-1] + (K,) and ro.experts.dtype == jnp.int32
  aux = aux_of(ro)
  assert AUX_KEYS == set(aux)
  for key, val in aux.items():
    assert jnp.asarray(val).dtype == jnp.float32 and jnp.shape(val) == (), key
  logits = x.reshape(-1, D).astype(np.float64) @ _np(block.router.kernel)
  m = logits.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
  np.testing.assert_allclose(float(aux["z_loss"]), np.mean(lse**2), rtol=1e-5)
  assert float(aux["drop_fraction"]) == 0.0
  # The block under jit (nnx.split / merge) gives the same aux.
  graphdef, state = nnx.split(block)

  @jax.jit
  def f(state, x):
    return nnx.merge(graphdef, state)(x)

  y_j, ro_j = f(state, jnp.asarray(x))
  y_e, ro_e = block(jnp.asarray(x))
  aux_j, aux_e = aux_of(ro_j), aux_of(ro_e)
  np.testing.assert_allclose(np.asarray(y_j), np.asarray(y_e), rtol=1e-5, atol=1e-6)
  for key in AUX_KEYS:
    np.testing.assert_allclose(
      float(aux_j[key]), float(aux_e[key]), rtol=1e-5, atol=1e-7, err_msg=key
    )


def test_router_runs_in_float32_with_bfloat16_compute():
  block = make_block("olmoe", d_shared=0, seed=4, dtype="bfloat16")
  x = _x(4)
  for xin in (jnp.asarray(x), jnp.asarray(x, jnp.bfloat16)):
    y, ro = block(xin)
    aux = aux_of(ro)
    assert y.dtype == xin.dtype
    for key in AUX_KEYS:
      assert aux[key].dtype == jnp.float32, key
    xr = np.asarray(xin.astype(jnp.float32), np.float64).reshape(-1, D)
    logits = xr @ _np(block.router.kernel)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    s = np.exp(logits - lse[:, None])
    # bfloat16 router logits (8 mantissa bits) would miss these by ~1e-2 relative.
    np.testing.assert_allclose(float(aux["z_loss"]), np.mean(lse**2), rtol=2e-6)
    np.testing.assert_allclose(
      float(aux["routed_mass"]), np.sort(s, -1)[:, -K:].sum(-1).mean(), rtol=2e-6
    )
    np.testing.assert_allclose(
      float(aux["router_entropy"]), -(s * np.log(s)).sum(-1).mean(), rtol=2e-6
    )


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
  "kw,field",
  [
    (dict(rule="no_such_rule"), r"\brule\b"),
    (dict(dispatch="foo"), r"\bdispatch\b"),
    (dict(capacity_factor=0.0), r"\bcapacity_factor\b"),
    (dict(eval_capacity_factor=-1.0), r"\beval_capacity_factor\b"),
    (dict(top_k=E + 1), r"\btop_k\b"),
    (dict(top_k=1, second_expert="random"), r"\bsecond_expert\b"),
    (dict(second_expert="sometimes"), r"\bsecond_expert\b"),
    (dict(drop_policy="random"), r"\bdrop_policy\b"),
    (dict(impl="cuda"), r"\bimpl\b"),
  ],
)
def test_bad_config_raises_naming_field(kw, field):
  base = dict(d_model=D, n_experts=E, top_k=K, d_expert=F)
  with pytest.raises(ValueError, match=field):
    MoEConfig(**{**base, **kw})


def test_good_configs_construct():
  MoEConfig(d_model=D, n_experts=E, top_k=E, d_expert=F)
  MoEConfig(d_model=D, n_experts=E, top_k=2, d_expert=F, second_expert="random")
  MoEConfig(d_model=D, n_experts=E, top_k=1, d_expert=F, rule="switch", dispatch="capacity")


# --------------------------------------------------------------------------- GShard random 2nd


def test_random_second_expert_applies_at_eval_with_a_fixed_seed():
  kw = dict(dispatch="dropless", second_expert="random")
  same = make_block("mixtral", d_shared=0, seed=5, **kw)
  every = make_block("mixtral", d_shared=0, seed=5, eval_second_expert="all", **kw)
  x = jnp.asarray(_x(5))
  y1, ro1 = same(x)
  y2, _ = same(x)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))  # fixed eval seed
  # Some second choices are not dispatched at eval: the trained routing, not all K.
  assert 0.0 < float(ro1.diag.drop_fraction) < 0.5
  y_all, ro_all = every(x)
  assert float(ro_all.diag.drop_fraction) == 0.0
  y_ref, _ = ref_block(every, "mixtral", np.asarray(x))
  np.testing.assert_allclose(np.asarray(y_all), y_ref, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(y1) - y_ref).max() > 1e-3


def test_expert_init_std():
  cfg = MoEConfig(d_model=64, n_experts=4, top_k=2, d_expert=64, init_std=0.02, expert_init_std=0.5)
  block = MoEBlock(cfg, rngs=nnx.Rngs(0))
  # layers.init_normal is a normal truncated at ±2σ: its std is σ·sqrt(1 − 4φ(2)/(2Φ(2) − 1)).
  phi2 = np.exp(-2.0) / np.sqrt(2 * np.pi)
  shrink = np.sqrt(1 - 4 * phi2 / 0.9544997361)
  wgu = _np(block.experts.w_gate_up)
  halves = {"gate": wgu[..., :64], "up": wgu[..., 64:], "down": _np(block.experts.w_down)}
  for name, w in halves.items():
    assert abs(w.std() / (0.5 * shrink) - 1) < 0.03, name
  assert abs(_np(block.router.kernel).std() / (0.02 * shrink) - 1) < 0.15
  default = MoEBlock(dataclasses.replace(cfg, expert_init_std=0.0), rngs=nnx.Rngs(0))
  assert abs(_np(default.experts.w_gate_up)[..., 64:].std() / (0.02 * shrink) - 1) < 0.03


def test_gate_up_init_draws_gate_then_up_as_two_parameters():
  """A seed gives the numbers of the two-parameter layout: router, then gate, up and down
  each drawn from the next `params` key (the draws written out here, one per array)."""
  cfg = MoEConfig(d_model=D, n_experts=E, top_k=K, d_expert=F, d_shared=FS, rule="qwen2_moe")
  block = MoEBlock(cfg, rngs=nnx.Rngs(3))
  rngs, std = nnx.Rngs(3), cfg.init_std
  draws = [
    init_normal(std)(rngs.params(), shape, jnp.float32)
    for shape in [(D, E), (E, D, F), (E, D, F), (E, F, D), (D, FS), (D, FS), (FS, D)]
  ]
  router, gate, up, down, s_gate, s_up, s_down = (np.asarray(d) for d in draws)
  np.testing.assert_array_equal(np.asarray(block.router.kernel[...]), router)
  np.testing.assert_array_equal(np.asarray(block.experts.w_gate_up[...])[..., :F], gate)
  np.testing.assert_array_equal(np.asarray(block.experts.w_gate_up[...])[..., F:], up)
  np.testing.assert_array_equal(np.asarray(block.experts.w_down[...]), down)
  np.testing.assert_array_equal(np.asarray(block.shared.w_gate_up[...]), np.hstack([s_gate, s_up]))
  np.testing.assert_array_equal(np.asarray(block.shared.w_down[...]), s_down)
