"""The Switch-style load-balance loss E · Σ_i f_i P_i: which choices count in f, in which
convention, over which groups of tokens, from the per-sequence sums a MoE layer reduces where
its router runs (`BalanceSums`: the loss then needs no [B, L, E] array outside the layer).

All functions are pure and jit-able; string/int arguments (`granularity`, `choices`,
`convention`, `n_shards`) are static. The loss is returned unweighted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.errors import UserError, check_choice

GRANULARITIES = ("micro_batch", "sequence", "global_batch")
# f_i = assignments to i over all counted assignments (Σf = 1: Megatron, MegaBlocks,
# OLMo-core, DeepSeek) or over tokens (Σf = choices per token: HF, MaxText, flaxformer).
BALANCE_CONVENTIONS = ("fraction", "count")
# Which choices count in f: every one of the top-k, or the top-1 only (GShard/lingvo).
BALANCE_CHOICES = ("all", "top1")


def balance_assignments(experts_BxLxK: jax.Array, n_experts: int, choices: str) -> jax.Array:
  """0/1 per token and expert of the choices the balance loss counts (`loss.balance_choices`):
  all K selected experts, or only the top-1 (GShard's lingvo `top2_gating` density_1)."""
  check_choice("loss.balance_choices", choices, BALANCE_CHOICES)
  e_BxLxK = experts_BxLxK[..., :1] if choices == "top1" else experts_BxLxK
  return jax.nn.one_hot(e_BxLxK, n_experts, dtype=jnp.float32).sum(-2)


def balance_fractions(counts_E: jax.Array, n_tokens: int | jax.Array, convention: str) -> jax.Array:
  """f_i from assignment counts (last axis E): over all counted assignments (`fraction`,
  Σf = 1) or over the `n_tokens` tokens they come from (`count`, Σf = choices per token)."""
  check_choice("loss.balance_convention", convention, BALANCE_CONVENTIONS)
  counts_E = jax.lax.stop_gradient(counts_E).astype(jnp.float32)
  denom = counts_E.sum(-1, keepdims=True) if convention == "fraction" else n_tokens
  return counts_E / jnp.maximum(denom, 1.0)


class BalanceSums(NamedTuple):
  """Per-sequence sums one MoE layer's balance loss is computed from, over its tokens' leading
  shape less the last axis (a model's [B]; [] for a flat [T] call): `balance_sums`."""

  probs_SxE: jax.Array  # Σ_t p_te, float32 (the loss's gradient flows through it)
  all_SxE: jax.Array  # assignments to each expert, all selected experts (constant)
  top1_SxE: jax.Array  # the same counting each token's top-1 only (constant)
  tokens_S: jax.Array  # tokens summed over, float32


def balance_sums(probs_SxLxE: jax.Array, experts_SxLxK: jax.Array, n_experts: int) -> BalanceSums:
  """`BalanceSums` of one layer's router output: probabilities [..., L, E] and selected
  experts [..., L, K] (an expert id of E, an unused rank, counts nowhere)."""

  def counts_SxE(choices: str) -> jax.Array:
    return balance_assignments(experts_SxLxK, n_experts, choices).sum(-2)

  L = probs_SxLxE.shape[-2]
  return BalanceSums(
    probs_SxLxE.astype(jnp.float32).sum(-2),
    counts_SxE("all"),
    counts_SxE("top1"),
    jnp.full(probs_SxLxE.shape[:-2], L, jnp.float32),
  )


def _groups(a_SxX: jax.Array, granularity: str, n_shards: int) -> jax.Array:
  """Sums over the balance groups: [G, ...] from per-sequence [S, ...] (S = B)."""
  if granularity == "sequence":
    return a_SxX
  if granularity == "micro_batch":
    return a_SxX.reshape(n_shards, -1, *a_SxX.shape[1:]).sum(1)
  return a_SxX.sum(0, keepdims=True)


def balance_from_sums(
  sums: BalanceSums,
  *,
  granularity: str,
  choices: str = "all",
  n_shards: int = 1,
  f_E: jax.Array | None = None,
  convention: str = "fraction",
) -> jax.Array:
  """Switch-style balance loss E · Σ_i f_i P_i (unweighted), averaged over groups, from one
  layer's per-sequence `BalanceSums` [B, ...]: groups as `load_balance_loss`; f counts
  `choices` (`loss.balance_choices`) in `convention`, or is `f_E` (global_batch only)."""
  check_choice("loss.balance_choices", choices, BALANCE_CHOICES)
  counts_SxE = sums.top1_SxE if choices == "top1" else sums.all_SxE
  B, E = sums.probs_SxE.shape
  if granularity == "micro_batch" and B % n_shards:
    raise UserError(f"n_shards: {n_shards} must divide the batch size {B}")
  tokens_Gx1 = _groups(sums.tokens_S, granularity, n_shards)[:, None]
  p_GxE = _groups(sums.probs_SxE, granularity, n_shards) / tokens_Gx1
  if f_E is None:
    f_GxE = balance_fractions(_groups(counts_SxE, granularity, n_shards), tokens_Gx1, convention)
  else:
    f_GxE = jax.lax.stop_gradient(f_E).astype(jnp.float32)[None]
  return E * (f_GxE * p_GxE).sum(-1).mean()


def load_balance_loss(
  probs_BxLxE: jax.Array,
  assign_BxLxE: jax.Array,
  *,
  granularity: str,
  n_shards: int = 1,
  f_E: jax.Array | None = None,
  convention: str = "fraction",
) -> jax.Array:
  """Switch-style balance loss E · Σ_i f_i P_i (unweighted), averaged over groups.

  Groups: one per sequence (`sequence`), one per contiguous batch shard of `n_shards`
  (`micro_batch`, as each data-parallel device would compute it), or all tokens
  (`global_batch`). f is a constant (stop_gradient) in the given `convention`
  (`balance_fractions`); `f_E` overrides it for global_batch (already in the convention).
  The math is `balance_from_sums`'s, over the sequences' sums of `probs` and `assign`.
  """
  if granularity not in GRANULARITIES:
    raise UserError(f"granularity: got {granularity!r}, allowed {', '.join(GRANULARITIES)}")
  check_choice("loss.balance_convention", convention, BALANCE_CONVENTIONS)
  if probs_BxLxE.ndim != 3 or probs_BxLxE.shape != assign_BxLxE.shape:
    raise UserError(
      f"assign_BxLxE: shape {assign_BxLxE.shape} must equal probs_BxLxE "
      f"shape {probs_BxLxE.shape} (3-D [batch, length, experts])"
    )
  if f_E is not None and granularity != "global_batch":
    raise UserError(f"f_E: only allowed with granularity='global_batch', got {granularity!r}")
  if not isinstance(n_shards, (int, np.integer)) or n_shards < 1:
    raise UserError(f"n_shards: got {n_shards!r}, allowed a positive int")
  B, L, E = probs_BxLxE.shape
  if f_E is not None and f_E.shape != (E,):
    raise UserError(f"f_E: shape {f_E.shape} must be ({E},)")
  assign_BxE = jax.lax.stop_gradient(assign_BxLxE).astype(jnp.float32).sum(1)
  tokens_B = jnp.full((B,), L, jnp.float32)
  sums = BalanceSums(probs_BxLxE.astype(jnp.float32).sum(1), assign_BxE, assign_BxE, tokens_B)
  return balance_from_sums(
    sums, granularity=granularity, n_shards=n_shards, f_E=f_E, convention=convention
  )
