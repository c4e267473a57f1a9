"""The MoE block (DESIGN.md §4): router, routed SwiGLU experts, optional shared expert.

A thin Flax NNX shell around the pure functions of `routing` and `dispatch`. The router
always runs in float32; experts run in the compute dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import dispatch as dsp
from moejax import routing
from moejax.errors import UserError
from moejax.layers import DTYPES, DenseFFN, init_normal


class RouterBias(nnx.Variable):
  """Selection bias b (aux-loss-free balancing): state, never a trainable parameter."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shapes, merge rule and dispatch of one MoE layer (field names are public API)."""

  d_model: int
  n_experts: int
  top_k: int
  d_expert: int
  d_shared: int = 0
  rule: routing.MergeRule | str = "mixtral"
  dispatch: str = "dropless"
  capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  min_capacity: int = 4
  drop_policy: str = "position"
  group_size: int | None = None
  second_expert: str = "all"
  impl: str = "auto"
  block_size: int = 32
  jitter_eps: float = 0.0
  dtype: str = "float32"
  init_std: float = 0.02

  def __post_init__(self):
    for name in ("d_model", "n_experts", "d_expert", "block_size"):
      if getattr(self, name) < 1:
        raise UserError(f"moe.{name}={getattr(self, name)} is not allowed; use an int >= 1")
    if self.d_shared < 0:
      raise UserError(f"moe.d_shared={self.d_shared} is not allowed; use an int >= 0")
    if not 0.0 <= self.jitter_eps < 1.0:
      raise UserError(f"moe.jitter_eps={self.jitter_eps} is not allowed; use 0 <= eps < 1")
    if self.dtype not in DTYPES:
      raise UserError(f"moe.dtype={self.dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    if not 1 <= self.top_k <= self.n_experts:
      raise UserError(
        f"moe.top_k={self.top_k} is not allowed; use 1 <= top_k <= n_experts={self.n_experts}"
      )
    routing.validate(self.merge_rule, self.n_experts, self.top_k)
    dsp.validate_dispatch(
      self.dispatch,
      self.drop_policy,
      self.second_expert,
      self.impl,
      self.capacity_factor,
      self.eval_capacity_factor,
      self.min_capacity,
      self.group_size,
    )
    if self.second_expert == "random" and self.top_k < 2:
      raise UserError("moe.second_expert='random' needs top_k >= 2")

  @property
  def merge_rule(self) -> routing.MergeRule:
    return routing.get_rule(self.rule)


class Router(nnx.Module):
  """Linear router `kernel [d_model, E]` (float32) plus the non-trainable selection bias."""

  def __init__(self, d_model: int, n_experts: int, *, init_std: float, rngs: nnx.Rngs):
    self.kernel = nnx.Param(init_normal(init_std)(rngs.params(), (d_model, n_experts)))
    self.bias = RouterBias(jnp.zeros((n_experts,), jnp.float32))


class Experts(nnx.Module):
  """E stacked SwiGLU experts: w_gate, w_up [E, d_model, d_expert]; w_down [E, d_expert, d_model]."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_expert
    init = init_normal(cfg.init_std)
    self.w_gate = nnx.Param(init(rngs.params(), (E, D, F), jnp.float32))
    self.w_up = nnx.Param(init(rngs.params(), (E, D, F), jnp.float32))
    self.w_down = nnx.Param(init(rngs.params(), (E, F, D), jnp.float32))

  def weights(self) -> dsp.ExpertWeights:
    return dsp.ExpertWeights(self.w_gate[...], self.w_up[...], self.w_down[...])


class SharedGate(nnx.Module):
  """c(x) = σ(x·w_g) for the `sigmoid` shared rule (Qwen2-MoE)."""

  def __init__(self, d_model: int, *, init_std: float, rngs: nnx.Rngs):
    self.kernel = nnx.Param(init_normal(init_std)(rngs.params(), (d_model, 1)))


class MoEBlock(nnx.Module):
  """y = Σ_{i∈S} r_i·Expert_i(x) + c(x)·Shared(x), with diagnostics in `aux`."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.router = Router(cfg.d_model, cfg.n_experts, init_std=cfg.init_std, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.d_shared > 0:
      self.shared = DenseFFN(
        cfg.d_model, cfg.d_shared, dtype=cfg.dtype, init_std=cfg.init_std, rngs=rngs
      )
      if cfg.merge_rule.shared == "sigmoid":
        self.shared_gate = SharedGate(cfg.d_model, init_std=cfg.init_std, rngs=rngs)

  def __call__(
    self,
    x: jax.Array,
    *,
    k: int | None = None,
    k2: int | None = None,
    train: bool = False,
    rng: jax.Array | None = None,
  ):
    """Returns (y, aux) with y shaped like x and aux a dict of float32 scalars."""
    y, aux, _ = self.forward(x, k=k, k2=k2, train=train, rng=rng)
    return y, aux

  def forward(
    self,
    x: jax.Array,
    *,
    k: int | None = None,
    k2: int | None = None,
    train: bool = False,
    rng: jax.Array | None = None,
    routed_scale: jax.Array | None = None,
  ):
    """Like `__call__`, plus per-token router statistics for the balance losses:
    `probs` (normalized full-router probabilities) and `assign` (0/1 per expert).

    `routed_scale` (eval, the k-grid's `sqrt`/`gain` cells): a scalar multiplying the routed
    output Σ r_i·Expert_i(x), not the shared expert. At eval `aux` also has the score masses
    `mass_k1`, `mass_K`, `mass_k2` (routing.score_masses) and `moe_out_rms` (routed + shared)."""
    cfg, rule = self.cfg, self.cfg.merge_rule
    lead, D = x.shape[:-1], x.shape[-1]
    x_TxD = x.reshape(-1, D)
    T, E, K = x_TxD.shape[0], cfg.n_experts, cfg.top_k
    k = K if k is None else k
    rng_jitter, rng_second = jax.random.split(rng) if rng is not None else (None, None)

    xr_TxD = x_TxD.astype(jnp.float32)
    if train and cfg.jitter_eps > 0 and rng_jitter is not None:
      xr_TxD = routing.jitter(xr_TxD, cfg.jitter_eps, rng_jitter)
    logits_TxE = xr_TxD @ self.router.kernel[...]
    ro = routing.route(logits_TxE, rule, k, k2=k2, bias_E=self.router.bias[...], train_k=K)

    keep_TxK = None
    if cfg.second_expert == "random" and train and rng_second is not None and k >= 2:
      keep_TxK = dsp.random_second_expert(ro.weights_TxK, rng_second)
    x_c = x_TxD.astype(jnp.dtype(cfg.dtype))
    routed_TxD, kept_TxK = self._routed(x_c, ro, k, train, keep_TxK)
    if routed_scale is not None:
      routed_TxD = routed_TxD * jnp.asarray(routed_scale, routed_TxD.dtype)
    y_TxD, coef_T = routed_TxD, jnp.zeros((T,), jnp.float32)
    if cfg.d_shared > 0 and rule.shared != "none":
      gate_T = None
      if rule.shared == "sigmoid":
        gate_T = (x_TxD.astype(jnp.float32) @ self.shared_gate.kernel[...])[:, 0]
      coef_T = routing.shared_coefficient(rule, K, gate_T, T)
      shared_TxD = self.shared(x_c).astype(jnp.float32)
      y_TxD = y_TxD + (coef_T[:, None] * shared_TxD).astype(y_TxD.dtype)

    probs_TxE = routing.normalized_probs(ro.scores_TxE)
    assign_TxE = jax.nn.one_hot(ro.experts_TxK, E, dtype=jnp.float32).sum(1)
    aux = diagnostics(
      logits_TxE, probs_TxE, assign_TxE, ro.weights_TxK, kept_TxK, routed_TxD, coef_T
    )
    if not train:
      masses = routing.score_masses(ro, rule, k, K, k2, self.router.bias[...])
      aux.update({n: m.mean() for n, m in zip(("mass_k1", "mass_K", "mass_k2"), masses)})
      aux["moe_out_rms"] = jnp.sqrt(jnp.mean(y_TxD.astype(jnp.float32) ** 2))
    stats = {"probs": probs_TxE.reshape(*lead, E), "assign": assign_TxE.reshape(*lead, E)}
    return y_TxD.reshape(*lead, D).astype(x.dtype), aux, stats

  def _routed(self, x_TxD, ro: routing.Routing, k: int, train: bool, keep_TxK):
    """Σ r_i·Expert_i(x) by the configured dispatch; returns (routed_TxD, kept_TxK)."""
    cfg, T, E = self.cfg, x_TxD.shape[0], self.cfg.n_experts
    ex = self.experts.weights()
    if cfg.dispatch == "dropless":
      w_TxK = ro.weights_TxK if keep_TxK is None else ro.weights_TxK * keep_TxK
      y_TxD = dsp.dropless(x_TxD, ro.experts_TxK, w_TxK, ex, impl=cfg.impl, block=cfg.block_size)
      kept_TxK = jnp.ones(ro.experts_TxK.shape, bool) if keep_TxK is None else keep_TxK
      return y_TxD, kept_TxK
    G = cfg.group_size or T
    factor = cfg.capacity_factor if train else cfg.eval_capacity_factor
    cap = dsp.capacity(factor, k, G, E, cfg.min_capacity)
    if cfg.drop_policy == "position":
      pri_TxK = dsp.position_priority(T, k, G)
    else:  # batch-prioritized: an assignment's own router score
      pri_TxK = jnp.take_along_axis(ro.scores_TxE, ro.experts_TxK, -1)
    return dsp.capacity_dispatch(
      x_TxD,
      ro.experts_TxK,
      ro.weights_TxK,
      ex,
      cap=cap,
      group_size=G,
      priority_TxK=pri_TxK,
      keep_TxK=keep_TxK,
    )


def diagnostics(
  logits_TxE, probs_TxE, assign_TxE, weights_TxK, kept_TxK, routed_TxD, coef_T
) -> dict[str, jax.Array]:
  """DESIGN.md §6 per-layer diagnostics, all float32 scalars over this call's tokens."""
  E = probs_TxE.shape[-1]
  f_E = assign_TxE.sum(0) / assign_TxE.sum()
  load_E = assign_TxE.sum(0)
  logz_T = jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)
  entropy_T = -(probs_TxE * jnp.log(jnp.clip(probs_TxE, 1e-30))).sum(-1)
  routed32 = routed_TxD.astype(jnp.float32)
  return {
    "aux_loss": E * jnp.sum(f_E * probs_TxE.mean(0)),
    "z_loss": jnp.mean(logz_T**2),
    "drop_fraction": 1.0 - kept_TxK.astype(jnp.float32).mean(),
    "load_max_over_mean": load_E.max() / load_E.mean(),
    "routed_mass": weights_TxK.sum(-1).mean(),
    "shared_coef": coef_T.mean(),
    "routed_out_rms": jnp.sqrt(jnp.mean(routed32**2)),
    "router_entropy": entropy_T.mean(),
  }
