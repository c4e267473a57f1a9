"""Dispatch plans (docs/design.md §3): where each (token, slot) assignment goes, and back.

A plan is an integer map from each assignment to a row of an expert-sorted buffer and its
inverse. Dropless plans pad each expert's run to the kernel's block granularity; capacity
plans keep the first C assignments per routing group and expert in a drop order. Dropped
assignments map to a sentinel row and contribute zero. `expand` and `combine` move rows
by a plan (gathers in both directions, `permute.take_rows`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.errors import UserError
from moejax.kernels.grouped import Blocks
from moejax.kernels.permute import take_rows

DROP_POLICIES = ("position", "batch_priority", "weight")


class ExpertWeights(NamedTuple):
  """Stacked SwiGLU expert weights: gate and up as one array, gate in columns [0, F) and up
  in [F, 2F), so the gate/up projection is one matmul and no kernel joins or splits them."""

  w_gate_up_ExDx2F: jax.Array
  w_down_ExFxD: jax.Array


class Plan(NamedTuple):
  """Where each assignment goes. R rows in the buffer; A = T·K assignments."""

  row_of_A: jax.Array  # int32 [A], R for a dropped assignment
  token_of_R: jax.Array  # int32 [R], T for an empty (padding) row
  assign_of_R: jax.Array  # int32 [R], A for an empty row
  kept_A: jax.Array  # bool [A]


class KernelArgs(NamedTuple):
  """What every expert kernel (`registry.KERNELS`) is given; it returns y_TxD. A kernel that
  plans dropless dispatch itself (`Kernel.plan == "routing"`) gets no plan (None, [], (),
  None) but the routing: `experts_TxK` and `used_TxK`."""

  x_TxD: jax.Array  # tokens, in the compute dtype
  plan: Plan | None
  blocks: list[Blocks]  # the buffer's block cover, one Blocks per size (block-loop kernels)
  sizes: tuple[int, ...]  # static block sizes, largest first
  counts_E: jax.Array | None  # rows per expert, contiguous from row 0 (grouped matmuls)
  weights_TxK: jax.Array  # combine weights r_i (0 for an unused assignment)
  ex: ExpertWeights
  experts_TxK: jax.Array | None = None  # int32 selected experts (routing-planned kernels)
  used_TxK: jax.Array | None = None  # bool: elastic-k's used ranks (None: all)


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
  experts_TxK: jax.Array,
  n_experts: int,
  sizes: tuple[int, ...],
  used_TxK: jax.Array | None = None,
) -> tuple[Plan, list[Blocks], jax.Array]:
  """Sorts assignments by expert, pads each expert's run to a multiple of `sizes[-1]` and
  covers it greedily with blocks of the given sizes (each a multiple of the next).

  Returns the plan, one `Blocks` per size and the per-expert counts. The buffer has a
  static R = roundup(A + E·(small−1), small) rows, the worst case over all routings.
  Assignments outside `used_TxK` sort after every expert (as expert E), are not counted
  and map to the dropped sentinel row.
  """
  T, K = experts_TxK.shape
  A, E, small = T * K, n_experts, sizes[-1]
  e_A = jnp.asarray(experts_TxK).reshape(A)
  used_A = None if used_TxK is None else used_TxK.reshape(A)
  if used_A is not None:
    e_A = jnp.where(used_A, e_A, E)
  order_A, e_sorted_A = sort_by_expert(e_A, E + (used_A is not None))
  counts_E = jnp.bincount(e_A, length=E)  # the unused (E) fall outside and are not counted
  padded_E = (counts_E + small - 1) // small * small
  start_E = jnp.cumsum(padded_E) - padded_E
  rank_A = jnp.arange(A) - (jnp.cumsum(counts_E) - counts_E)[e_sorted_A]
  row_sorted_A = (start_E[e_sorted_A] + rank_A).astype(jnp.int32)
  row_of_A = jnp.zeros((A,), jnp.int32).at[order_A].set(row_sorted_A)
  n_rows = -(-(A + E * (small - 1)) // small) * small
  kept_A = jnp.ones((A,), bool) if used_A is None else used_A
  plan = _finish_plan(row_of_A, kept_A, n_rows, K)

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
  """The capacity priority of a `drop_policy` (docs/design.md §3):

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
  raise UserError(f"model.moe.drop_policy={policy!r} is not allowed; use one of {DROP_POLICIES}")


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


def expand(x_TxD: jax.Array, plan: Plan, K: int) -> jax.Array:
  """The buffer's rows: x_R[r] = x[token(r)], zero for padding and dropped rows."""
  T = x_TxD.shape[0]
  return take_rows(x_TxD, plan.token_of_R, plan.row_of_A.reshape(T, K))


def combine(y_RxD: jax.Array, plan: Plan, weights_TxK: jax.Array) -> jax.Array:
  """y[t] = Σ_k r_tk · y_R[row(t, k)], with dropped rows contributing zero."""
  T, K = weights_TxK.shape
  y_AxD = take_rows(y_RxD, plan.row_of_A, plan.assign_of_R[:, None])
  y_TxKxD = y_AxD.reshape(T, K, -1)
  return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK.astype(y_TxKxD.dtype))
