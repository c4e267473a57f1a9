"""Training losses: next-token cross-entropy, load-balance loss, router z-loss, bias update.

All functions are pure and jit-able; string/int arguments (`granularity`, `n_shards`) are
static. Losses are returned unweighted: the caller multiplies by its coefficient.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.errors import UserError, check_choice
from moejax.schema import check_fields, key

GRANULARITIES = ("micro_batch", "sequence", "global_batch")
# f_i = assignments to i over all counted assignments (Σf = 1: Megatron, MegaBlocks,
# OLMo-core, DeepSeek) or over tokens (Σf = choices per token: HF, MaxText, flaxformer).
BALANCE_CONVENTIONS = ("fraction", "count")
# Which choices count in f: every one of the top-k, or the top-1 only (GShard/lingvo).
BALANCE_CHOICES = ("all", "top1")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Weights and granularity of the auxiliary losses (config `loss.*`)."""

  balance_weight: float = key(0.01, "weight of the load-balance loss", ge=0)
  balance_granularity: str = key(
    "global_batch", "over which tokens the balance loss counts loads", GRANULARITIES
  )
  z_loss_weight: float = key(0.001, "weight of the router z-loss", ge=0)
  bias_update_rate: float = key(
    0.0,
    "aux-loss-free balancing: the selection bias's update rate (rules with selection_bias)",
    ge=0,
  )
  balance_convention: str = key(
    "fraction",
    "f_i over all assignments (fraction, Σf = 1) or over tokens (count)",
    BALANCE_CONVENTIONS,
  )
  balance_choices: str = key("all", "which choices count in f: all top-k, or top1", BALANCE_CHOICES)
  n_shards: int = 1  # data-parallel shards, for `micro_batch` granularity (from the mesh)
  grad_accum: int = 1  # train.grad_accum

  def __post_init__(self):
    check_fields(self, "loss")


@jax.custom_vjp
def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  """−log softmax(logits)[target] per row of float32 logits, with its gradient (softmax − onehot)
  computed in the same pass as the loss (`_token_nll_fwd`)."""
  return _token_nll_fwd(logits_NxV, targets_N)[0]


def _token_nll_fwd(logits_NxV, targets_N):
  """The loss and its logits gradient, tied by an optimization barrier: the backward needs
  the gradient first, so the loss cannot be scheduled after the backward layer loop, which
  would keep the [tokens, vocab] logits alive through it (XLA:TPU did so with scanned
  layers: 1.07 GiB more per v5e chip for the TPU preset, docs/design.md §5)."""
  x_NxV = logits_NxV
  lse_N = jax.nn.logsumexp(x_NxV, axis=-1)
  nll_N = lse_N - jnp.take_along_axis(x_NxV, targets_N[:, None], axis=-1)[:, 0]
  onehot_NxV = jax.nn.one_hot(targets_N, x_NxV.shape[-1], dtype=jnp.float32)
  dnll_NxV = jnp.exp(x_NxV - lse_N[:, None]) - onehot_NxV
  nll_N, dnll_NxV = jax.lax.optimization_barrier((nll_N, dnll_NxV))
  return nll_N, dnll_NxV


def _token_nll_bwd(dnll_NxV, g_N):
  return (dnll_NxV * g_N[:, None], None)


token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


def cross_entropy(
  logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Next-token CE in float32: `targets_BxL[b, t]` is the token predicted at position t.

  Returns (mean over unmasked tokens, per-token loss_BxL with masked positions set to 0).
  """
  if logits_BxLxV.shape[:-1] != targets_BxL.shape:
    raise UserError(
      f"targets_BxL: shape {targets_BxL.shape} must equal logits_BxLxV.shape[:-1] "
      f"{logits_BxLxV.shape[:-1]}"
    )
  V = logits_BxLxV.shape[-1]
  tgt_N = targets_BxL.reshape(-1).astype(jnp.int32)
  logits_NxV = logits_BxLxV.reshape(-1, V).astype(jnp.float32)  # its cotangent: the input's dtype
  loss_BxL = token_nll(logits_NxV, tgt_N).reshape(targets_BxL.shape)
  if mask_BxL is None:
    return loss_BxL.mean(), loss_BxL
  if mask_BxL.shape != targets_BxL.shape:
    raise UserError(
      f"mask_BxL: shape {mask_BxL.shape} must equal targets_BxL.shape {targets_BxL.shape}"
    )
  m_BxL = mask_BxL.astype(jnp.float32)
  loss_BxL = loss_BxL * m_BxL
  return loss_BxL.sum() / jnp.maximum(m_BxL.sum(), 1.0), loss_BxL


def accuracy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Per-token next-token accuracy (float32 0/1): argmax of logits equals the target."""
  return (jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32)


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


def assignment_fractions(assign_BxLxE: jax.Array) -> jax.Array:
  """Global fraction f_E of assignments per expert (sums to 1), for accumulation by the trainer."""
  counts_E = assign_BxLxE.reshape(-1, assign_BxLxE.shape[-1]).sum(0)
  return balance_fractions(counts_E, 0, "fraction")


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


def router_z_loss(logits_TxE: jax.Array) -> jax.Array:
  """ST-MoE router z-loss mean(logsumexp(z)²) in float32 (unweighted); any leading shape."""
  return jnp.square(jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)).mean()


def bias_update(bias_E: jax.Array, load_E: jax.Array, gamma: float | jax.Array) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek-V3): b_i += γ · sign(mean(load) − load_i).

  `load_E` are global-batch assignment counts; the result keeps `bias_E`'s dtype.
  """
  if bias_E.shape != load_E.shape or bias_E.ndim != 1:
    raise UserError(f"load_E: shape {load_E.shape} must equal bias_E shape {bias_E.shape} (1-D)")
  load_E = jax.lax.stop_gradient(load_E).astype(jnp.float32)
  step_E = gamma * jnp.sign(load_E.mean() - load_E)
  return (bias_E.astype(jnp.float32) + step_E).astype(bias_E.dtype)
