"""The grid's score masses per MoE layer, from the router logits the forward returns.

Computed here, not in the MoE block, so only the grid pays for them: the top-k1 and top-K
(trained) masses in selection order, and the denominator p_i = s_i / denom the cell used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.nn import routing
from moejax.nn.moe import MoEConfig, RouterOut, native_k2


def score_masses(
  logits_TxE, experts_TxK, bias_E, rule: routing.MergeRule, k: int, train_k: int, k2=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(mass_k1_T, mass_K_T, denom_T): the top-k and top-K score masses in selection order,
  and the denominator actually used (`k2`'s top-k2 mass, the rule's norm over the selected,
  or 1 for `norm=none`; a k2 array holding `routing.OWN_K2` is the rule's)."""
  s_TxE = routing.scores(logits_TxE, rule)
  key_TxE = routing.selection_keys(s_TxE, rule, bias_E)
  cum_TxE = routing.selection_cumsum(s_TxE, key_TxE, rule)
  mass_k1_T, mass_K_T = cum_TxE[:, k - 1], cum_TxE[:, train_k - 1]
  s_TxK = jnp.take_along_axis(s_TxE, experts_TxK, axis=-1)
  denom_T = routing.norm_denominator(rule, s_TxK, mass_k1_T)
  if k2 is not None:
    denom_T = routing.k2_denominator(cum_TxE, k2, denom_T)
  return mass_k1_T, mass_K_T, jnp.ones_like(mass_k1_T) if denom_T is None else denom_T


def layer_masses(
  routers: dict[int, RouterOut], bias_ME: jax.Array, cfg: MoEConfig, k1: int, k2=None
) -> dict[str, jax.Array]:
  """`mass_k1`, `mass_K`, `mass_k2`: [M] token means per MoE layer, in layer order."""
  k2 = native_k2(cfg, k2, train=False)
  rows = []
  for m, ro in enumerate(routers.values()):
    E = ro.logits.shape[-1]
    logits_TxE, experts_TxK = ro.logits.reshape(-1, E), ro.experts.reshape(-1, k1)
    masses = score_masses(logits_TxE, experts_TxK, bias_ME[m], cfg.merge_rule, k1, cfg.top_k, k2)
    rows.append([v.mean() for v in masses])
  return {name: jnp.stack([r[i] for r in rows]) for i, name in enumerate(MASSES)}


MASSES = ("mass_k1", "mass_K", "mass_k2")
