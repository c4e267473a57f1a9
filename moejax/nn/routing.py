"""Router merge rules (docs/design.md §2): scores, selection and the routed coefficients r_i.

Everything here is a pure, jit-able function of float32 router logits. Shapes and ranks
are static, so all validation runs in Python at trace time and raises `ValueError`
(`UserError`) naming the offending field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.errors import UserError
from moejax.schema import check_fields, coerce, key

SCORES = ("softmax", "sigmoid")
SHARED = ("none", "unit", "sigmoid", "kplus1")
GROUP_SCORES = ("max", "top2_sum")
KEY = "model.moe"  # error messages name the config key of each rule field


def _sum_denominator(s_TxK: jax.Array, mass: jax.Array, lp: float, keepdims: bool) -> jax.Array:
  """Σ_S s_j: `mass`, summed by the caller (a row sum, or the selection-order cumsum)."""
  del s_TxK, lp, keepdims
  return mass


def _lp_denominator(s_TxK: jax.Array, mass: jax.Array, lp: float, keepdims: bool) -> jax.Array:
  """‖s_S‖_p = (Σ_S s_j^p)^(1/p) (DBRX's `moe_normalize_expert_weights`)."""
  del mass
  return (s_TxK**lp).sum(-1, keepdims=keepdims) ** (1.0 / lp)


class Norm(NamedTuple):
  """A `norm` choice: p_i = s_i / denominator(s_TxK, mass, lp, keepdims) over the selected
  set S (None: p_i = s_i), and its worksheet line (moejax.describe; `{lp}` is the rule's p)."""

  denominator: Callable[[jax.Array, jax.Array, float, bool], jax.Array] | None
  worksheet: str


# The normalizations: adding one is one entry here; `route`, `elastic_weights` and the
# k-grid's masses (`moejax.kgrid.masses`) all divide by `denominator`.
NORMS: dict[str, Norm] = {
  "none": Norm(None, "r_i = a s_i (no renormalization)"),
  "sum": Norm(_sum_denominator, "r_i = a s_i / sum_S s (renormalized over the selected)"),
  "lp": Norm(_lp_denominator, "r_i = a s_i / ||s_S||_p (p = {lp})"),
}


@dataclasses.dataclass(frozen=True)
class MergeRule:
  """How router logits become routed coefficients r_i and a shared coefficient c(x)."""

  # As `model.moe.<field>` keys these are unset and replace the named rule's when set
  # (compose_rule); each is checked by its metadata, the one cross-field bound below.
  score: str = key("softmax", "router scores s from logits", SCORES)
  norm: str = key("sum", "renormalization of the selected scores", NORMS)
  lp: float = key(1.0, "norm=lp: the norm's p", gt=0)
  scale: float | str = key(
    1.0, "alpha of r_i = alpha p_i: a float, or 'k' (the trained K)", gt=0, also=("k",)
  )
  shared: str = key("none", "the shared expert's gate c(x)", SHARED)
  selection_bias: bool = key(False, "aux-loss-free selection bias (loss.bias_update_rate)")
  n_groups: int = key(
    1, "expert groups of group-limited routing (0 in the config: the rule's)", ge=1
  )
  topk_groups: int = key(1, "groups kept per token (0 in the config: the rule's)", ge=1)
  group_score: str = key("max", "n_groups > 1: how a group is scored", GROUP_SCORES)

  def __post_init__(self):
    check_fields(self, KEY)
    if self.topk_groups > self.n_groups:
      raise UserError(
        f"{KEY}.topk_groups={self.topk_groups} is not allowed; use 1 <= topk_groups <= "
        f"n_groups={self.n_groups}"
      )

  def alpha(self, train_k: int) -> float:
    """α of r_i = α·p_i, with the kplus1 factor K/(K+1): both use the trained K."""
    alpha = float(train_k) if self.scale == "k" else float(self.scale)
    return alpha * (train_k / (train_k + 1.0)) if self.shared == "kplus1" else alpha

  def kept_experts(self, n_experts: int) -> int:
    """Experts that survive group masking: topk_groups · E / n_groups (E without groups)."""
    return self.topk_groups * (n_experts // self.n_groups)


RULES: dict[str, MergeRule] = {
  "mixtral": MergeRule(),
  "qwen3_moe": MergeRule(),
  "olmoe": MergeRule(norm="none"),
  "qwen2_moe": MergeRule(norm="none", shared="sigmoid"),
  "qwen3_5_moe": MergeRule(shared="sigmoid"),
  "megatron": MergeRule(shared="unit"),
  "olmo": MergeRule(scale="k", shared="unit"),
  "deepseek_v3": MergeRule(
    score="sigmoid",
    scale=2.5,
    shared="unit",
    selection_bias=True,
    n_groups=8,
    topk_groups=4,
    group_score="top2_sum",
  ),
  "deepseek_v2_lite": MergeRule(norm="none", shared="unit"),
  "dbrx": MergeRule(norm="lp", lp=1.0),
  "megablocks": MergeRule(norm="none"),
  "megablocks_lp2": MergeRule(norm="lp", lp=2.0),
  "kplus1": MergeRule(norm="none", shared="kplus1"),
  "switch": MergeRule(norm="none"),
  "gshard": MergeRule(),
}


def get_rule(rule: MergeRule | str) -> MergeRule:
  """Resolves a rule name from `RULES`; a `MergeRule` passes through."""
  if isinstance(rule, MergeRule):
    return rule
  if rule not in RULES:
    raise UserError(f"{KEY}.rule={rule!r} is unknown; use one of {', '.join(sorted(RULES))}")
  return RULES[rule]


RULE_FIELDS = tuple(f.name for f in dataclasses.fields(MergeRule))
_FIELDS = {f.name: f for f in dataclasses.fields(MergeRule)}


def _no_effect(rule: MergeRule, field: str) -> str | None:
  """Why `field` cannot change what `rule` computes, or None when it can."""
  if field == "lp" and rule.norm != "lp":
    return f"{KEY}.norm={rule.norm!r} (lp is read only with norm='lp')"
  if field == "group_score" and rule.n_groups == 1:
    return f"{KEY}.n_groups=1 (groups are scored only when n_groups > 1)"
  return None


def compose_rule(rule: MergeRule | str, overrides: dict[str, object]) -> MergeRule:
  """The named rule with some fields replaced (config `model.moe.<field>`).

  Raises a `UserError` naming the key for a value of the wrong type or out of range, and
  for an override that differs from the named rule but cannot take effect (e.g. `lp`
  without `norm='lp'`), so an ablation never silently runs the unchanged rule.
  """
  base = get_rule(rule)
  unknown = sorted(set(overrides) - set(RULE_FIELDS))
  if unknown:
    raise UserError(f"{KEY}.{unknown[0]} is not a rule field; use {', '.join(RULE_FIELDS)}")
  fields = {f: coerce(v, _FIELDS[f]) for f, v in overrides.items()}
  composed = dataclasses.replace(base, **fields)
  for field, value in fields.items():
    reason = _no_effect(composed, field)
    if reason and value != getattr(base, field):
      raise UserError(f"{KEY}.{field}={value!r} has no effect with {reason}")
  return composed


def rule_dict(rule: MergeRule) -> dict[str, object]:
  """All fields of a rule, JSON-ready (config.json `resolved.rule`)."""
  return dataclasses.asdict(rule)


class Routing(NamedTuple):
  """Output of `route`: who is selected, with which coefficient, from which scores."""

  experts_TxK: jax.Array  # int32, best first
  weights_TxK: jax.Array  # float32 r_i (alpha and the kplus1 factor included)
  scores_TxE: jax.Array  # float32 s, unbiased


def validate(
  rule: MergeRule, n_experts: int, k: int, k2: int | None = None, train_k: int | None = None
) -> None:
  """Raises `UserError` naming the field when (rule, E, k, k2) cannot be routed."""
  E = n_experts
  if not 1 <= k <= E:
    raise UserError(f"k={k} is not allowed; use 1 <= k <= n_experts={E}")
  if train_k is not None and not 1 <= train_k <= E:
    raise UserError(f"train_k={train_k} is not allowed; use 1 <= train_k <= n_experts={E}")
  if k2 is not None and not isinstance(k2, jax.Array) and not k <= k2 <= E:  # traced: caller checks
    raise UserError(f"k2={k2} is not allowed; use k={k} <= k2 <= n_experts={E}")
  if E % rule.n_groups:
    raise UserError(f"{KEY}.n_groups={rule.n_groups} is not allowed; it must divide n_experts={E}")
  group_size = E // rule.n_groups
  if rule.n_groups > 1 and rule.group_score == "top2_sum" and group_size < 2:
    raise UserError(
      f"{KEY}.group_score='top2_sum' needs >= 2 experts per group; "
      f"n_experts={E} with n_groups={rule.n_groups} gives {group_size}"
    )
  kept = rule.kept_experts(E)
  if k > kept:
    raise UserError(
      f"k={k} is not allowed; the kept groups hold only topk_groups*E/n_groups={kept} experts"
    )


def scores(logits_TxE: jax.Array, rule: MergeRule) -> jax.Array:
  """s = φ(z) over all E logits, in float32."""
  z_TxE = logits_TxE.astype(jnp.float32)
  return jax.nn.softmax(z_TxE, axis=-1) if rule.score == "softmax" else jax.nn.sigmoid(z_TxE)


def selection_keys(
  scores_TxE: jax.Array, rule: MergeRule, bias_E: jax.Array | None = None
) -> jax.Array:
  """The keys top-k runs on: s + b, with experts outside the kept groups at −inf."""
  key_TxE = scores_TxE
  if rule.selection_bias and bias_E is not None:
    key_TxE = key_TxE + bias_E.astype(jnp.float32)
  if rule.n_groups == 1:
    return key_TxE
  T, E = key_TxE.shape
  key_TxGxS = key_TxE.reshape(T, rule.n_groups, E // rule.n_groups)
  if rule.group_score == "max":
    group_TxG = key_TxGxS.max(-1)
  else:
    group_TxG = jax.lax.top_k(key_TxGxS, 2)[0].sum(-1)
  _, kept_TxKg = jax.lax.top_k(group_TxG, rule.topk_groups)
  keep_TxG = jnp.zeros(group_TxG.shape, bool).at[jnp.arange(T)[:, None], kept_TxKg].set(True)
  masked_TxGxS = jnp.where(keep_TxG[..., None], key_TxGxS, -jnp.inf)
  return masked_TxGxS.reshape(T, E)


def selection_cumsum(s_TxE: jax.Array, key_TxE: jax.Array, rule: MergeRule) -> jax.Array:
  """cum_TxE[:, j] = Σ s over the first j+1 experts in selection order: kept experts by key,
  then (past the kept groups) the masked experts by score, so ties at −inf never decide."""
  E = s_TxE.shape[-1]
  n_kept = rule.kept_experts(E)
  _, top_TxN = jax.lax.top_k(key_TxE, n_kept)
  s_sorted_TxE = jnp.take_along_axis(s_TxE, top_TxN, axis=-1)
  if n_kept < E:
    masked_TxE = jnp.where(jnp.isneginf(key_TxE), s_TxE, -jnp.inf)
    extra_TxX, _ = jax.lax.top_k(masked_TxE, E - n_kept)
    s_sorted_TxE = jnp.concatenate([s_sorted_TxE, extra_TxX], axis=-1)
  return jnp.cumsum(s_sorted_TxE, axis=-1)


def norm_denominator(
  rule: MergeRule, s_TxK: jax.Array, mass: jax.Array, keepdims: bool = False
) -> jax.Array | None:
  """The denominator of the rule's normalization (`NORMS`) over the selected scores s_TxK
  (0 where a rank is unused), per token ([T], or [T, 1] with `keepdims`), whose sum the
  caller passes as `mass` in that shape; None for `norm=none`."""
  denominator = NORMS[rule.norm].denominator
  return None if denominator is None else denominator(s_TxK, mass, rule.lp, keepdims)


# A k2 array holding OWN_K2 (any value <= 0) selects the rule's own normalization, so one
# compiled grid forward serves the native cells and every integer k2 (moejax.kgrid.forward)
OWN_K2 = 0


def k2_denominator(cum_TxE: jax.Array, k2, own_T: jax.Array | None) -> jax.Array:
  """The denominator at `k2` (not None) per token: Σ s_j over the top-k2 experts in selection
  order (`cum_TxE`: `selection_cumsum`). `k2` may be a traced int scalar, so one compiled
  forward serves every k2; an array holding OWN_K2 selects `own_T` instead (the rule's own
  denominator; None, i.e. 1, for `norm=none`)."""
  if not isinstance(k2, jax.Array):
    return jnp.take(cum_TxE, k2 - 1, axis=-1)
  top_T = jnp.take(cum_TxE, jnp.maximum(k2, 1) - 1, axis=-1)  # OWN_K2 selects no column
  return jnp.where(k2 > OWN_K2, top_T, 1.0 if own_T is None else own_T)


def route(
  logits_TxE: jax.Array,
  rule: MergeRule | str,
  k: int,
  *,
  k2: int | None = None,
  bias_E: jax.Array | None = None,
  train_k: int | None = None,
) -> Routing:
  """Selects k experts per token and computes r_i = α·p_i (docs/design.md §2).

  `k2` replaces the rule's normalization by p_i = s_i / Σ_{top-k2} s_j, the top-k2 taken
  in selection order (so k2 = k is the rule's own renormalization and k2 = E divides by
  the full score mass); a k2 array holding OWN_K2 keeps the rule's own. K-dependent
  constants (`scale="k"`, `kplus1`) use `train_k`.
  """
  rule = get_rule(rule)
  E = logits_TxE.shape[-1]
  train_k = k if train_k is None else train_k
  validate(rule, E, k, k2, train_k)
  s_TxE = scores(logits_TxE, rule)
  key_TxE = selection_keys(s_TxE, rule, bias_E)
  _, experts_TxK = jax.lax.top_k(key_TxE, k)
  s_TxK = jnp.take_along_axis(s_TxE, experts_TxK, axis=-1)

  denom_Tx1 = norm_denominator(rule, s_TxK, s_TxK.sum(-1, keepdims=True), keepdims=True)
  if k2 is not None:  # (the rule's own, unused at an integer k2, is dropped by the trace)
    own_T = None if denom_Tx1 is None else denom_Tx1[:, 0]
    cum_TxE = selection_cumsum(s_TxE, key_TxE, rule)
    denom_Tx1 = k2_denominator(cum_TxE, k2, own_T)[:, None]
  p_TxK = s_TxK if denom_Tx1 is None else s_TxK / denom_Tx1

  weights_TxK = (rule.alpha(train_k) * p_TxK).astype(jnp.float32)
  return Routing(experts_TxK.astype(jnp.int32), weights_TxK, s_TxE)


def shared_coefficient(
  rule: MergeRule, train_k: int, gate_logit_T: jax.Array | None, n_tokens: int
) -> jax.Array:
  """c(x) per token: 0, 1, σ(x·w_g) or 1/(K+1) with K the trained top-k."""
  if rule.shared == "sigmoid":
    return jax.nn.sigmoid(gate_logit_T.astype(jnp.float32))
  value = {"none": 0.0, "unit": 1.0, "kplus1": 1.0 / (train_k + 1.0)}[rule.shared]
  return jnp.full((n_tokens,), value, jnp.float32)


def normalized_probs(scores_TxE: jax.Array) -> jax.Array:
  """Per-token probabilities for balance losses (sigmoid scores renormalized to sum 1)."""
  return scores_TxE / scores_TxE.sum(-1, keepdims=True)


def jitter(x: jax.Array, eps: float, rng: jax.Array) -> jax.Array:
  """Switch-style multiplicative router-input jitter: x · U(1 − eps, 1 + eps)."""
  noise = jax.random.uniform(rng, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
  return x * noise.astype(x.dtype)


def elastic_weights(ro: Routing, rule: MergeRule, k_T: jax.Array, train_k2: str) -> jax.Array:
  """r_i when token t uses only its first k_T[t] of the K selected experts (elastic-k
  training, `moejax.nn.elastic`); ranks >= k_T get 0.

  `train_k2="k"`: the rule's own normalization over the used experts (sum, lp, or none);
  `"K"`: p_i = s_i / Σ of s over the K selected experts, which is the top-K mass in
  selection order (for `norm=none` too). α and the kplus1 factor use the trained K."""
  K = ro.experts_TxK.shape[-1]
  s_TxK = jnp.take_along_axis(ro.scores_TxE, ro.experts_TxK, axis=-1)
  used_TxK = jnp.arange(K)[None, :] < k_T[:, None]
  s_used_TxK = jnp.where(used_TxK, s_TxK, 0.0)
  if train_k2 == "K":
    denom_T = s_TxK.sum(-1)
  else:
    denom_T = norm_denominator(rule, s_used_TxK, s_used_TxK.sum(-1))
  if denom_T is None:
    denom_T = jnp.ones(s_TxK.shape[:-1], jnp.float32)
  return (rule.alpha(K) * s_used_TxK / denom_T[:, None]).astype(jnp.float32)
