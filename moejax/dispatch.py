"""Token dispatch to experts (DESIGN.md §3): dropless and capacity modes.

Both modes build a *plan*: an integer map from each (token, slot) assignment to a row of
an expert-sorted buffer, and back. Rows are moved with `permute.take_rows` (gather in
both directions), experts run as one grouped SwiGLU, and outputs are combined with r_i.
Dropped assignments map to a sentinel row and contribute zero.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.errors import UserError, check_choice
from moejax.fused import gather_swiglu_combine
from moejax.grouped import Blocks, grouped_swiglu
from moejax.permute import take_rows

MODES = ("dropless", "capacity")
IMPLS = ("auto", "fused", "blocked", "ragged")
DROP_POLICIES = ("position", "batch_priority", "weight")
# Old names that are refused with a hint rather than silently reinterpreted.
RENAMED_DROP_POLICIES = {
  "score": "drop_policy='score' was renamed 'weight' (each assignment ranked by its own "
  "weight r_i, Megatron's 'probs'); V-MoE's batch-prioritized routing is 'batch_priority'",
}
SECOND_EXPERT = ("all", "random")
EVAL_SECOND_EXPERT = ("same", "all")


class ExpertWeights(NamedTuple):
  """Stacked SwiGLU expert weights."""

  w_gate_ExDxF: jax.Array
  w_up_ExDxF: jax.Array
  w_down_ExFxD: jax.Array


class Plan(NamedTuple):
  """Where each assignment goes. R rows in the buffer; A = T·K assignments."""

  row_of_A: jax.Array  # int32 [A], R for a dropped assignment
  token_of_R: jax.Array  # int32 [R], T for an empty (padding) row
  assign_of_R: jax.Array  # int32 [R], A for an empty row
  kept_A: jax.Array  # bool [A]


def resolve_impl(impl: str) -> str:
  """`auto`: ragged_dot on TPU/GPU, the fused block loop on CPU (ragged_dot densifies
  there). `blocked` is the unfused block loop: gather, grouped SwiGLU, combine."""
  check_choice("impl", impl, IMPLS)
  if impl != "auto":
    return impl
  return "fused" if jax.default_backend() == "cpu" else "ragged"


def _finish_plan(row_of_A: jax.Array, kept_A: jax.Array, n_rows: int, K: int) -> Plan:
  """Inverts row_of_A (an injective map on kept assignments) into per-row sources."""
  A = row_of_A.shape[0]
  row_of_A = jnp.where(kept_A, row_of_A, n_rows).astype(jnp.int32)
  assign_of_R = (
    jnp.full((n_rows + 1,), A, jnp.int32).at[row_of_A].set(jnp.arange(A, dtype=jnp.int32))[:n_rows]
  )
  token_of_R = jnp.where(assign_of_R < A, assign_of_R // K, A // K).astype(jnp.int32)
  return Plan(row_of_A, token_of_R, assign_of_R, kept_A)


def block_sizes(block: int, n_assignments: int, n_experts: int = 1) -> tuple[int, ...]:
  """Static block sizes for the CPU grouped loop, largest first: `block` (the padding
  granularity) times powers of 4, up to the expected rows per expert T·K/E, so a typical
  expert's run is a few large matmuls plus a short tail."""
  mean, sizes = n_assignments // n_experts, [block]
  while sizes[-1] * 4 <= mean:
    sizes.append(sizes[-1] * 4)
  return tuple(reversed(sizes))


def sort_by_expert(e_A: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
  """(order_A, e_sorted_A): a stable sort of assignments by expert. One single-operand
  sort of the unique keys e·A + a (several times faster on CPU than a stable argsort)."""
  A = e_A.shape[0]
  if n_experts * A >= 2**31:  # keys would overflow int32
    order_A = jnp.argsort(e_A, stable=True)
    return order_A, e_A[order_A]
  key_A = jax.lax.sort(e_A.astype(jnp.int32) * A + jnp.arange(A, dtype=jnp.int32))
  return key_A % A, key_A // A


def dropless_plan(
  experts_TxK: jax.Array, n_experts: int, sizes: tuple[int, ...]
) -> tuple[Plan, list[Blocks], jax.Array]:
  """Sorts assignments by expert, pads each expert's run to a multiple of `sizes[-1]` and
  covers it greedily with blocks of the given sizes (each a multiple of the next).

  Returns the plan, one `Blocks` per size and the per-expert counts. The buffer has a
  static R = roundup(A + E·(small−1), small) rows, the worst case over all routings.
  """
  T, K = experts_TxK.shape
  A, E, small = T * K, n_experts, sizes[-1]
  e_A = jnp.asarray(experts_TxK).reshape(A)
  order_A, e_sorted_A = sort_by_expert(e_A, E)
  counts_E = jnp.bincount(e_A, length=E)
  padded_E = (counts_E + small - 1) // small * small
  start_E = jnp.cumsum(padded_E) - padded_E
  rank_A = jnp.arange(A) - (jnp.cumsum(counts_E) - counts_E)[e_sorted_A]
  row_sorted_A = (start_E[e_sorted_A] + rank_A).astype(jnp.int32)
  row_of_A = jnp.zeros((A,), jnp.int32).at[order_A].set(row_sorted_A)
  n_rows = -(-(A + E * (small - 1)) // small) * small
  plan = _finish_plan(row_of_A, jnp.ones((A,), bool), n_rows, K)

  blocks, offset_E, prev = [], jnp.zeros_like(counts_E), None
  for size in sizes:
    rem_E = counts_E - offset_E
    n_E = (rem_E + size - 1) // size if size == small else rem_E // size
    bound = A // size if prev is None else min(-(-A // size) + E, E * (prev // size))
    if size == small and prev is None:
      bound = -(-A // size) + E
    cum_E = jnp.cumsum(n_E)
    b_N = jnp.arange(max(bound, 1))
    e_N = jnp.minimum(jnp.searchsorted(cum_E, b_N, side="right"), E - 1)
    j_N = b_N - (cum_E - n_E)[e_N]
    start_N = start_E[e_N] + offset_E[e_N] + j_N * size
    blocks.append(Blocks(start_N.astype(jnp.int32), e_N.astype(jnp.int32), cum_E[-1]))
    offset_E, prev = offset_E + n_E * size, size
  return plan, blocks, counts_E


def capacity(
  capacity_factor: float, k: int, group_tokens: int, n_experts: int, min_capacity: int
) -> int:
  """C = max(min_capacity, ceil(capacity_factor · K · G / E)), capped at G."""
  c = max(min_capacity, math.ceil(capacity_factor * k * group_tokens / n_experts))
  return min(c, group_tokens)


class DropOrder(NamedTuple):
  """Who gets an expert's capacity slots first, per routing group: assignments sorted by
  `choice` ascending when `choice_major` (every first choice before any second choice),
  then by `priority_TxK` descending; ties keep token order."""

  priority_TxK: jax.Array
  choice_major: bool


def drop_order(
  policy: str,
  experts_TxK: jax.Array,
  weights_TxK: jax.Array,
  scores_TxE: jax.Array,
  group_size: int,
) -> DropOrder:
  """The capacity priority of a `drop_policy` (DESIGN.md §3):

  * `position` (Switch, GShard): first choices before second choices, earlier tokens first.
  * `batch_priority` (V-MoE / flaxformer batch-prioritized routing): first choices before
    second choices; within each, tokens by their top-1 router probability, highest first.
  * `weight` (Megatron-Core `moe_token_drop_policy="probs"`): each assignment ranked by
    its own routed weight r_i, whatever its choice rank.
  """
  T, K = experts_TxK.shape
  if policy == "position":
    t_TxK = jnp.broadcast_to((jnp.arange(T) % group_size)[:, None], (T, K))
    return DropOrder(-t_TxK.astype(jnp.float32), True)
  if policy == "batch_priority":
    top1_T = jnp.take_along_axis(scores_TxE, experts_TxK[:, :1], -1)[:, 0]
    return DropOrder(jnp.broadcast_to(top1_T[:, None], (T, K)).astype(jnp.float32), True)
  if policy == "weight":
    return DropOrder(weights_TxK.astype(jnp.float32), False)
  raise UserError(RENAMED_DROP_POLICIES.get(policy, f"drop_policy={policy!r} is unknown"))


def capacity_plan(
  experts_TxK: jax.Array,
  order: DropOrder,
  n_experts: int,
  cap: int,
  group_size: int,
  keep_TxK: jax.Array | None = None,
) -> Plan:
  """Keeps, per routing group and expert, the first `cap` assignments in `order`.

  Buffer rows are laid out [group, expert, slot]. An assignment with `keep_TxK` False (a
  GShard second choice that was not sampled) takes no slot: it is ranked after every kept
  one, as lingvo clears it before the position cumsum.
  """
  T, K = experts_TxK.shape
  n_groups, G = T // group_size, group_size
  keep_TxK = jnp.ones((T, K), bool) if keep_TxK is None else keep_TxK
  e_NxA = jnp.asarray(experts_TxK).reshape(n_groups, G * K)
  pri_NxA = jnp.asarray(order.priority_TxK).reshape(n_groups, G * K)
  keep_NxA = keep_TxK.reshape(n_groups, G * K)
  choice_NxA = jnp.tile(jnp.arange(K), (n_groups, G)) * int(order.choice_major)
  unkept_NxA = (~keep_NxA).astype(jnp.int32)
  # Sort by (expert, unkept last, choice, priority descending); ties keep assignment order.
  order_NxA = jnp.lexsort((-pri_NxA, choice_NxA, unkept_NxA, e_NxA), axis=-1)
  e_sorted_NxA = jnp.take_along_axis(e_NxA, order_NxA, -1)
  counts_NxE = jax.vmap(lambda e: jnp.bincount(e, length=n_experts))(e_NxA)
  start_NxE = jnp.cumsum(counts_NxE, -1) - counts_NxE
  rank_sorted_NxA = jnp.arange(G * K) - jnp.take_along_axis(start_NxE, e_sorted_NxA, -1)
  rank_NxA = (
    jnp.zeros_like(rank_sorted_NxA)
    .at[jnp.arange(n_groups)[:, None], order_NxA]
    .set(rank_sorted_NxA)
  )
  kept_NxA = (rank_NxA < cap) & keep_NxA
  row_NxA = (jnp.arange(n_groups)[:, None] * n_experts + e_NxA) * cap + rank_NxA
  return _finish_plan(row_NxA.reshape(-1), kept_NxA.reshape(-1), n_groups * n_experts * cap, K)


def random_second_expert(
  weights_TxK: jax.Array, rng: jax.Array, threshold: float = 0.5
) -> jax.Array:
  """GShard: keep the 2nd choice with probability min(1, g2/threshold), g2 renormalized."""
  T, K = weights_TxK.shape
  g2_T = weights_TxK[:, 1] / weights_TxK[:, :2].sum(-1)
  keep2_T = jax.random.uniform(rng, (T,)) < jnp.minimum(1.0, g2_T / threshold)
  return jnp.ones((T, K), bool).at[:, 1].set(keep2_T)


def _cast(experts: ExpertWeights, dtype) -> ExpertWeights:
  return ExpertWeights(*(jnp.asarray(w, dtype) for w in experts))


def _combine(y_RxD, plan: Plan, weights_TxK: jax.Array) -> jax.Array:
  """y[t] = Σ_k r_tk · y_R[row(t, k)], with dropped rows contributing zero."""
  T, K = weights_TxK.shape
  y_AxD = take_rows(y_RxD, plan.row_of_A, plan.assign_of_R[:, None])
  y_TxKxD = y_AxD.reshape(T, K, -1)
  return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK.astype(y_TxKxD.dtype))


def _expand(x_TxD: jax.Array, plan: Plan, K: int) -> jax.Array:
  T = x_TxD.shape[0]
  return take_rows(x_TxD, plan.token_of_R, plan.row_of_A.reshape(T, K))


def _grouped(x_TxD, plan: Plan, weights_TxK, ex: ExpertWeights, blocks, sizes, fused: bool):
  """Runs the experts over the plan's row blocks and combines: one fused loop, or gather
  into an expert-sorted buffer, grouped SwiGLU, then gather back."""
  T, K = weights_TxK.shape
  if not fused:
    y_RxD = grouped_swiglu(_expand(x_TxD, plan, K), *ex, blocks, sizes)
    return _combine(y_RxD, plan, weights_TxK)
  w_Ax1 = weights_TxK.reshape(T * K, 1).astype(x_TxD.dtype)
  w_R = take_rows(w_Ax1, plan.assign_of_R, plan.row_of_A[:, None])[:, 0]
  row_TxK = plan.row_of_A.reshape(T, K)
  return gather_swiglu_combine(x_TxD, w_R, plan.token_of_R, row_TxK, *ex, blocks, sizes)


def dropless(
  x_TxD: jax.Array,
  experts_TxK: jax.Array,
  weights_TxK: jax.Array,
  ex: ExpertWeights,
  *,
  impl: str = "auto",
  block: int = 32,
) -> jax.Array:
  """Computes every assignment: sort by expert, one grouped SwiGLU, unsort and combine."""
  T, K = experts_TxK.shape
  E = ex.w_gate_ExDxF.shape[0]
  impl = resolve_impl(impl)
  ex = _cast(ex, x_TxD.dtype)
  if impl == "ragged":
    plan, _, counts_E = dropless_plan(experts_TxK, E, (1,))
    x_AxD = _expand(x_TxD, plan, K)
    dot = lambda a, w: jax.lax.ragged_dot(a, w, counts_E.astype(jnp.int32))
    h_AxF = jax.nn.silu(dot(x_AxD, ex.w_gate_ExDxF)) * dot(x_AxD, ex.w_up_ExDxF)
    return _combine(dot(h_AxF, ex.w_down_ExFxD), plan, weights_TxK)
  sizes = block_sizes(block, T * K, E)
  plan, blocks, _ = dropless_plan(experts_TxK, E, sizes)
  return _grouped(x_TxD, plan, weights_TxK, ex, blocks, sizes, impl == "fused")


def capacity_dispatch(
  x_TxD: jax.Array,
  experts_TxK: jax.Array,
  weights_TxK: jax.Array,
  ex: ExpertWeights,
  *,
  cap: int,
  group_size: int,
  order: DropOrder,
  keep_TxK: jax.Array | None = None,
  impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
  """Capacity-limited dispatch; returns (y_TxD, kept_TxK). Every impl but `fused` runs
  the unfused block loop (capacity buffers are small and fixed)."""
  T, K = experts_TxK.shape
  check_group_size(group_size, T)
  E = ex.w_gate_ExDxF.shape[0]
  plan = capacity_plan(experts_TxK, order, E, cap, group_size, keep_TxK)
  ex = _cast(ex, x_TxD.dtype)
  expert_N = jnp.tile(jnp.arange(E, dtype=jnp.int32), T // group_size)
  N = expert_N.shape[0]
  blocks = Blocks(jnp.arange(N, dtype=jnp.int32) * cap, expert_N, jnp.asarray(N, jnp.int32))
  fused = resolve_impl(impl) == "fused"
  y_TxD = _grouped(x_TxD, plan, weights_TxK, ex, [blocks], (cap,), fused)
  return y_TxD, plan.kept_A.reshape(T, K)


def validate_dispatch(
  mode: str,
  drop_policy: str,
  second_expert: str,
  impl: str,
  capacity_factor: float,
  eval_capacity_factor: float,
  min_capacity: int,
  group_size: int | None,
  n_tokens: int | None = None,
  *,
  eval_second_expert: str = "same",
) -> None:
  """Raises `UserError` naming the dispatch field that is out of range."""
  if drop_policy in RENAMED_DROP_POLICIES:
    raise UserError(RENAMED_DROP_POLICIES[drop_policy])
  for field, value, allowed in (
    ("dispatch", mode, MODES),
    ("drop_policy", drop_policy, DROP_POLICIES),
    ("second_expert", second_expert, SECOND_EXPERT),
    ("eval_second_expert", eval_second_expert, EVAL_SECOND_EXPERT),
    ("impl", impl, IMPLS),
  ):
    check_choice(field, value, allowed)
  for field, value in (
    ("capacity_factor", capacity_factor),
    ("eval_capacity_factor", eval_capacity_factor),
  ):
    if not value > 0:
      raise UserError(f"{field}={value} is not allowed; use a float > 0")
  if min_capacity < 0:
    raise UserError(f"min_capacity={min_capacity} is not allowed; use an int >= 0")
  if group_size is not None and group_size < 1:
    raise UserError(f"group_size={group_size} is not allowed; use an int >= 1 or None")
  if group_size is not None and n_tokens is not None:
    check_group_size(group_size, n_tokens)


def check_group_size(group_size: int, n_tokens: int) -> None:
  """Capacity routing groups must tile the tokens of one call exactly."""
  if n_tokens % group_size:
    raise UserError(
      f"group_size={group_size} is not allowed; it must divide the "
      f"{n_tokens} tokens of the local batch"
    )
