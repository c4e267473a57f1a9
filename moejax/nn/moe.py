"""The MoE block (docs/design.md §4): router, routed SwiGLU experts, optional shared expert.

A thin Flax NNX shell around the pure functions of `routing` and `dispatch`. The router
always runs in float32; experts run in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.backend import platforms
from moejax.errors import UserError, check_choice
from moejax.kernels import dispatch as dsp
from moejax.kernels import plans
from moejax.nn import balance, elastic, losses, routing
from moejax.nn.layers import DTYPES, DenseFFN, gate_up_init, init_normal
from moejax.nn.overrides import NONE as NO_OVERRIDES
from moejax.nn.overrides import Overrides
from moejax.schema import check_fields, key


class RouterBias(nnx.Variable):
  """Selection bias b (aux-loss-free balancing): state, never a trainable parameter."""


# Fixed seed of the GShard random second expert at eval (`eval_second_expert="same"`), so
# an evaluation routes the way training did, and the same way every time.
EVAL_SECOND_EXPERT_SEED = 0


class Diagnostics(NamedTuple):
  """Per-layer float32 scalars over one call's tokens (docs/design.md §6 metric names)."""

  drop_fraction: jax.Array
  load_max_over_mean: jax.Array
  routed_mass: jax.Array  # mean Σ r_i
  shared_coef: jax.Array  # mean c(x)
  routed_out_rms: jax.Array  # rms of Σ r_i Expert_i(x)
  router_entropy: jax.Array
  mean_k: jax.Array  # experts used per token (K, the eval k, or elastic training's mean)


class RouterOut(NamedTuple):
  """What the losses, the logs and the k-grid need from one MoE layer. The losses' inputs
  are reduced here, where the router's outputs are (once in a scanned stack's body), so a
  train step stacks and differentiates small arrays, not per-token ones."""

  logits: jax.Array  # [..., E] float32 router logits z (the grid's masses)
  probs: jax.Array  # [..., E] full-router probabilities, per token summing to 1
  experts: jax.Array  # [..., k] int32 selected experts, best first (E: an unused rank)
  diag: Diagnostics
  balance: balance.BalanceSums  # per sequence (x's leading shape less its last axis)
  z_loss: jax.Array  # float32 scalar, the router z-loss over this call's tokens
  moe_out_rms: jax.Array | None = None  # rms of routed + shared output (Overrides.grid_stats)


class Elastic(NamedTuple):
  """Elastic-k in one training forward: the ranks each token uses, and its k."""

  used_TxK: jax.Array  # bool
  k_T: jax.Array  # int32


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shapes, merge rule and dispatch of one MoE layer (field names are public API). The
  defaults are those of `model.moe` in `config.base_config()`, which is written from them."""

  d_model: int  # model.d_model
  n_experts: int = key(8, "routed experts E", ge=1)
  top_k: int = key(2, "experts per token K (1 <= K <= E)", ge=1)
  d_expert: int = key(128, "hidden width of a routed expert's SwiGLU", ge=1)
  d_shared: int = key(0, "hidden width of the shared expert (0: none)", ge=0)
  rule: routing.MergeRule | str = key(
    "mixtral",
    "merge rule by name (moejax.nn.routing.RULES; docs/merge-rules.md)",
    tuple(routing.RULES),
    checked=False,
  )
  dispatch: str = key(
    "dropless", "dropless, or capacity (fixed per-expert slots, overflow dropped)", dsp.MODES
  )
  capacity_factor: float = key(
    1.25, "dispatch=capacity: slots per expert, as a multiple of the mean load", gt=0
  )
  eval_capacity_factor: float = key(2.0, "the same at evaluation", gt=0)
  min_capacity: int = key(4, "dispatch=capacity: at least this many slots per expert", ge=0)
  drop_policy: str = key(
    "position", "dispatch=capacity: which assignments keep a slot", plans.DROP_POLICIES
  )
  group_size: int | None = key(
    None, "dispatch=capacity: tokens per routing group (0: all of a call's)", ge=1
  )
  second_expert: str = key(
    "all", "training: all of the top-k, or GShard's random second expert", dsp.SECOND_EXPERT
  )
  eval_second_expert: str = key(
    "same", "evaluation: same (random, fixed seed) or all", dsp.EVAL_SECOND_EXPERT
  )
  impl: str = key(
    "auto", "the expert kernel (docs/dispatch.md; auto: by backend and shape)", dsp.IMPLS
  )
  block_size: int = key(
    32,
    "dropless, impl=fused (or auto where it runs fused) or blocked: rows of the block loop's "
    "smallest block",
    ge=1,
  )
  jitter_eps: float = key(
    0.0, "multiplicative router-input jitter in training (Switch)", ge=0, lt=1
  )
  dtype: str = "float32"  # model.dtype
  init_std: float = 0.02  # model.init_std
  expert_init_std: float = key(0.0, "routed experts' init std (0: model.init_std)", ge=0)
  train_k: str = key(
    "fixed", "elastic-k: the k a token uses in training (docs/elastic-k.md)", elastic.TRAIN_K
  )
  train_k_min: int = key(1, "train_k=uniform: the smallest k drawn", ge=1)
  train_k_scope: str = key(
    "layer", "train_k=uniform: one draw per step, layer or token", elastic.SCOPES
  )
  train_k2: str = key(
    "k", "elastic-k's normalization: over the k used, or over K", elastic.TRAIN_K2
  )
  train_k_schedule: str = key("", "train_k=schedule: 'step:k,step:k'")

  def __post_init__(self):
    if self.d_model < 1:
      raise UserError(f"model.d_model={self.d_model} is not allowed; use an int >= 1")
    check_choice("model.dtype", self.dtype, DTYPES)  # the fields copied from `model.*`
    if not self.init_std > 0:
      raise UserError(f"model.init_std={self.init_std} is not allowed; use a value > 0")
    check_fields(self, "model.moe")
    dsp.check_mode(self.impl, self.dispatch)
    if self.top_k > self.n_experts:
      raise UserError(
        f"model.moe.top_k={self.top_k} is not allowed; use 1 <= top_k <= n_experts={self.n_experts}"
      )
    routing.validate(self.merge_rule, self.n_experts, self.top_k)
    if self.second_expert == "random" and self.top_k < 2:
      raise UserError("model.moe.second_expert='random' needs top_k >= 2")
    elastic.validate(self.elastic, self.top_k)

  @property
  def merge_rule(self) -> routing.MergeRule:
    return routing.get_rule(self.rule)

  @property
  def elastic(self) -> elastic.ElasticK:
    schedule = elastic.parse_schedule(self.train_k_schedule) if self.train_k_schedule else ()
    return elastic.ElasticK(
      self.train_k, self.train_k_min, self.train_k_scope, self.train_k2, schedule
    )


class Router(nnx.Module):
  """Linear router `kernel [d_model, E]` (float32) plus the non-trainable selection bias."""

  def __init__(self, d_model: int, n_experts: int, *, init_std: float, rngs: nnx.Rngs):
    self.kernel = nnx.Param(init_normal(init_std)(rngs.params(), (d_model, n_experts)))
    self.bias = RouterBias(jnp.zeros((n_experts,), jnp.float32))


class Experts(nnx.Module):
  """E stacked SwiGLU experts: w_gate_up [E, d_model, 2·d_expert] (gate then up);
  w_down [E, d_expert, d_model]."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_expert
    std = cfg.expert_init_std or cfg.init_std
    self.w_gate_up = nnx.Param(gate_up_init(std, rngs, (E, D, F)))
    self.w_down = nnx.Param(init_normal(std)(rngs.params(), (E, F, D), jnp.float32))

  def weights(self) -> dsp.ExpertWeights:
    return dsp.ExpertWeights(self.w_gate_up[...], self.w_down[...])


class SharedGate(nnx.Module):
  """c(x) = σ(x·w_g) for the `sigmoid` shared rule (Qwen2-MoE)."""

  def __init__(self, d_model: int, *, init_std: float, rngs: nnx.Rngs):
    self.kernel = nnx.Param(init_normal(init_std)(rngs.params(), (d_model, 1)))


class MoEBlock(nnx.Module):
  """y = Σ_{i∈S} r_i·Expert_i(x) + c(x)·Shared(x); also returns a `RouterOut`."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # kernel libraries imported before any trace, those of the context mesh's platform only
    dsp.preload(cfg.impl, cfg.dispatch, platforms.context_platforms())
    self.router = Router(cfg.d_model, cfg.n_experts, init_std=cfg.init_std, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.d_shared > 0:
      self.shared = DenseFFN(
        cfg.d_model, cfg.d_shared, dtype=cfg.dtype, init_std=cfg.init_std, rngs=rngs
      )
      if cfg.merge_rule.shared == "sigmoid":
        self.shared_gate = SharedGate(cfg.d_model, init_std=cfg.init_std, rngs=rngs)

  def __call__(
    self, x: jax.Array, *, train: bool = False, rng=None, ov: Overrides = NO_OVERRIDES
  ) -> tuple[jax.Array, RouterOut]:
    """Returns (y, RouterOut) with y shaped like x. `rng` drives the router jitter and the
    random second expert in training; at eval the latter uses a fixed seed when rng is None.

    `ov` (`moejax.nn.overrides`, this layer's row): the grid's k, k2 and routed scale at
    eval; elastic-k's `train_k` in training, broadcastable to x's leading shape (ranks >= k
    get weight 0, leave the dispatch plan and are not counted by the balance loss or the
    loads: `RouterOut.experts` holds E for them)."""
    cfg, lead, D = self.cfg, x.shape[:-1], x.shape[-1]
    x_TxD = x.reshape(-1, D)
    k = cfg.top_k if ov.k is None else ov.k
    if rng is None and not train:
      rng = jax.random.key(EVAL_SECOND_EXPERT_SEED)
    rng_jitter, rng_second = jax.random.split(rng) if rng is not None else (None, None)
    logits_TxE, ro = self._route(x_TxD, k, train, rng_jitter, ov.k2)
    el = self._elastic(ov.train_k, lead) if train else None
    if el is not None:
      ro = ro._replace(
        weights_TxK=routing.elastic_weights(ro, cfg.merge_rule, el.k_T, cfg.train_k2)
      )
    keep_TxK = None
    if self._random_second(train) and rng_second is not None and k >= 2:
      keep_TxK = plans.random_second_expert(ro.weights_TxK, rng_second)
    x_c = x_TxD.astype(jnp.dtype(cfg.dtype))
    routed_TxD, kept_TxK = self._routed(x_c, ro, k, train, keep_TxK, el)
    if ov.routed_scale is not None:
      routed_TxD = routed_TxD * jnp.asarray(ov.routed_scale, routed_TxD.dtype)
    y_TxD, coef_T = self._shared(x_TxD, x_c, routed_TxD)
    experts_TxK = (
      ro.experts_TxK if el is None else jnp.where(el.used_TxK, ro.experts_TxK, cfg.n_experts)
    )
    probs_TxE = routing.normalized_probs(ro.scores_TxE)
    diag = diagnostics(probs_TxE, experts_TxK, ro.weights_TxK, kept_TxK, routed_TxD, coef_T, el)
    rms = jnp.sqrt(jnp.mean(y_TxD.astype(jnp.float32) ** 2)) if ov.grid_stats else None
    out = router_out(lead, logits_TxE, probs_TxE, experts_TxK, diag, rms)
    return y_TxD.reshape(*lead, D).astype(x.dtype), out

  def _route(self, x_TxD, k: int, train: bool, rng_jitter, k2) -> tuple[jax.Array, routing.Routing]:
    """Float32 router logits (jittered in training) and the rule's routing at k (and k2)."""
    cfg = self.cfg
    xr_TxD = x_TxD.astype(jnp.float32)
    if train and cfg.jitter_eps > 0 and rng_jitter is not None:
      xr_TxD = routing.jitter(xr_TxD, cfg.jitter_eps, rng_jitter)
    logits_TxE = xr_TxD @ self.router.kernel[...]
    k2 = native_k2(cfg, k2, train)
    bias_E = self.router.bias[...]
    return logits_TxE, routing.route(
      logits_TxE, cfg.merge_rule, k, k2=k2, bias_E=bias_E, train_k=cfg.top_k
    )

  def _elastic(self, train_k, lead) -> Elastic | None:
    """Elastic-k's ranks in use, from the per-token k of this training forward."""
    if train_k is None:
      return None
    T = math.prod(lead)
    k_T = jnp.broadcast_to(train_k, lead).reshape(T).astype(jnp.int32)
    return Elastic(jnp.arange(self.cfg.top_k)[None, :] < k_T[:, None], k_T)

  def _shared(self, x_TxD, x_c, routed_TxD) -> tuple[jax.Array, jax.Array]:
    """y = routed + c(x)·Shared(x), and c(x) per token (zeros without a shared expert)."""
    cfg, rule, T = self.cfg, self.cfg.merge_rule, x_TxD.shape[0]
    if not (cfg.d_shared > 0 and rule.shared != "none"):
      return routed_TxD, jnp.zeros((T,), jnp.float32)
    gate_T = None
    if rule.shared == "sigmoid":
      gate_T = (x_TxD.astype(jnp.float32) @ self.shared_gate.kernel[...])[:, 0]
    coef_T = routing.shared_coefficient(rule, cfg.top_k, gate_T, T)
    shared_TxD = self.shared(x_c).astype(jnp.float32)
    return routed_TxD + (coef_T[:, None] * shared_TxD).astype(routed_TxD.dtype), coef_T

  def _random_second(self, train: bool) -> bool:
    """GShard's random second expert applies in training and, unless
    `eval_second_expert="all"`, at eval too (it is part of the trained routing)."""
    cfg = self.cfg
    return cfg.second_expert == "random" and (train or cfg.eval_second_expert == "same")

  def _routed(self, x_TxD, ro: routing.Routing, k: int, train: bool, keep_TxK, el=None):
    """Σ r_i·Expert_i(x) by the configured dispatch; returns (routed_TxD, kept_TxK).
    Assignments outside elastic-k's used ranks are left out of the plan."""
    cfg, T, E = self.cfg, x_TxD.shape[0], self.cfg.n_experts
    used_TxK = None if el is None else el.used_TxK
    ex = self.experts.weights()
    if cfg.dispatch == "dropless":
      w_TxK = ro.weights_TxK if keep_TxK is None else ro.weights_TxK * keep_TxK
      y_TxD = dsp.dropless(
        x_TxD, ro.experts_TxK, w_TxK, ex, impl=cfg.impl, block=cfg.block_size, used_TxK=used_TxK
      )
      kept_TxK = jnp.ones(ro.experts_TxK.shape, bool) if keep_TxK is None else keep_TxK
      return y_TxD, kept_TxK
    if used_TxK is not None:
      keep_TxK = used_TxK if keep_TxK is None else keep_TxK & used_TxK
    G = cfg.group_size or T
    factor = cfg.capacity_factor if train else cfg.eval_capacity_factor
    cap = plans.capacity(factor, k, G, E, cfg.min_capacity)
    order = plans.drop_order(cfg.drop_policy, ro.experts_TxK, ro.weights_TxK, ro.scores_TxE, G)
    return dsp.capacity_dispatch(
      x_TxD,
      ro.experts_TxK,
      ro.weights_TxK,
      ex,
      cap=cap,
      group_size=G,
      order=order,
      keep_TxK=keep_TxK,
      impl=cfg.impl,
    )


def router_out(lead, logits_TxE, probs_TxE, experts_TxK, diag, moe_out_rms) -> RouterOut:
  """The `RouterOut` of one call over tokens of leading shape `lead`."""
  (E, k), shape = (probs_TxE.shape[-1], experts_TxK.shape[-1]), tuple(lead)
  probs = probs_TxE.reshape(*shape, E)
  experts = experts_TxK.reshape(*shape, k)
  sums = balance.balance_sums(probs, experts, E)
  z_loss = losses.router_z_loss(logits_TxE)
  return RouterOut(logits_TxE.reshape(*shape, E), probs, experts, diag, sums, z_loss, moe_out_rms)


def native_k2(cfg: MoEConfig, k2, train: bool):
  """The k2 a forward normalizes by: `k2`, or at eval of a run trained with elastic-k's
  `train_k2="K"`, K (native is what it trained with: the top-K mass at every k1) where `k2`
  asks for the rule's own (None, or an array holding `routing.OWN_K2`)."""
  if train or cfg.train_k2 != "K":
    return k2
  if k2 is None:
    return cfg.top_k
  if isinstance(k2, jax.Array):
    return jnp.where(k2 > routing.OWN_K2, k2, cfg.top_k)
  return k2


def diagnostics(
  probs_TxE, experts_TxK, weights_TxK, kept_TxK, routed_TxD, coef_T, el: Elastic | None = None
) -> Diagnostics:
  """docs/design.md §6 per-layer diagnostics, all float32 scalars over this call's tokens. With
  elastic-k, drops count among the assignments used, and mean_k is the mean k drawn (else
  the k of `experts_TxK`)."""
  load_E = jax.nn.one_hot(experts_TxK, probs_TxE.shape[-1], dtype=jnp.float32).sum((0, 1))
  entropy_T = -(probs_TxE * jnp.log(jnp.clip(probs_TxE, 1e-30))).sum(-1)
  routed32 = routed_TxD.astype(jnp.float32)
  if el is None:
    drops = 1.0 - kept_TxK.astype(jnp.float32).mean()
    mean_k = jnp.asarray(experts_TxK.shape[-1], jnp.float32)
  else:
    drops = ((el.used_TxK & ~kept_TxK).sum() / el.used_TxK.sum()).astype(jnp.float32)
    mean_k = el.k_T.mean(dtype=jnp.float32)
  return Diagnostics(
    drop_fraction=drops,
    load_max_over_mean=load_E.max() / load_E.mean(),
    routed_mass=weights_TxK.sum(-1).mean(),
    shared_coef=coef_T.mean(),
    routed_out_rms=jnp.sqrt(jnp.mean(routed32**2)),
    router_entropy=entropy_T.mean(),
    mean_k=mean_k,
  )
