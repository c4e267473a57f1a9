"""Elastic-k training (`model.moe.train_k*`): how many of the top-K experts a token uses in
a training step, and what its routed weights are divided by.

The top-K is computed once per layer; a token drawn k ≤ K keeps its first k experts in
selection order (best first) and its ranks ≥ k get weight 0 and leave the dispatch plan,
so a step at small k runs fewer expert rows, with no recompilation per k.

* `train_k`: `fixed` (every token uses K: today's step, bitwise), `uniform` (k drawn from
  {train_k_min, ..., K}: Matryoshka MoE, arXiv 2509.26520), `schedule` (k from
  `train_k_schedule`, a list of `step:k` pairs, the k of the last pair whose step has been
  reached: SMoE-Dropout's growing k, arXiv 2303.01610; the scope is then the whole step).
* `train_k_scope`: `step` (one k per training step, every layer and token; per micro-batch
  with gradient accumulation), `layer` (an independent draw per MoE layer per step), or
  `token` (a draw per token per layer).
* `train_k2`: `k` (the rule's own normalization over the experts actually used) or `K` (the
  top-K score mass in selection order: the k1:k2 trick applied during training; for a rule
  with `norm=none` that is itself a normalization, at every k including K). A model
  trained with `K` evaluates its `native` cells the same way: k2 = K at every k1.

Draws come from the step's RNG (a stream folded out of it), so a resumed run draws the same
k's and resumes bitwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.errors import UserError, check_choice

TRAIN_K = ("fixed", "uniform", "schedule")
SCOPES = ("step", "layer", "token")
TRAIN_K2 = ("k", "K")
STREAM = 0x6B  # fold_in constant of the draws' RNG stream ("k")
KEY = "model.moe"


@dataclasses.dataclass(frozen=True)
class ElasticK:
  """The training-time k of one model (the `model.moe.train_k*` keys)."""

  mode: str = "fixed"
  k_min: int = 1
  scope: str = "layer"
  k2: str = "k"
  schedule: tuple[tuple[int, int], ...] = ()

  @property
  def active(self) -> bool:
    """Whether training departs from the rule at K: k's are drawn, or the weights are
    divided by the top-K mass (which, for `norm=none`, normalizes even at k = K)."""
    return self.mode != "fixed" or self.k2 == "K"


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
  """`"0:8,300:4,450:2"` -> ((0, 8), (300, 4), (450, 2)); steps strictly increasing from 0."""
  key = f"{KEY}.train_k_schedule"
  pairs = []
  for part in (p.strip() for p in text.split(",") if p.strip()):
    step, sep, k = part.partition(":")
    if not sep or not step.strip().isdigit() or not k.strip().isdigit():
      raise UserError(f"{key}={text!r} is not allowed; use step:k pairs like '0:8,300:4'")
    pairs.append((int(step), int(k)))
  if not pairs or pairs[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
    raise UserError(f"{key}={text!r} is not allowed; steps must start at 0 and increase")
  return tuple(pairs)


def validate(e: ElasticK, top_k: int) -> None:
  """Raises a one-line UserError naming the key that is out of range."""
  check_choice(f"{KEY}.train_k", e.mode, TRAIN_K)
  check_choice(f"{KEY}.train_k_scope", e.scope, SCOPES)
  check_choice(f"{KEY}.train_k2", e.k2, TRAIN_K2)
  if not 1 <= e.k_min <= top_k:
    raise UserError(
      f"{KEY}.train_k_min={e.k_min} is not allowed; use 1 <= train_k_min <= top_k={top_k}"
    )
  if e.mode == "schedule" and not e.schedule:
    raise UserError(f"{KEY}.train_k='schedule' needs {KEY}.train_k_schedule, e.g. '0:8,300:4'")
  for _, k in e.schedule:
    if not 1 <= k <= top_k:
      raise UserError(
        f"{KEY}.train_k_schedule has k={k}; use 1 <= k <= top_k={top_k} in every pair"
      )


def scheduled_k(schedule: tuple[tuple[int, int], ...], step: jax.Array) -> jax.Array:
  """The k of the last (start, k) pair with start <= step (a traced int32 scalar)."""
  starts = jnp.asarray([s for s, _ in schedule], jnp.int32)
  ks = jnp.asarray([k for _, k in schedule], jnp.int32)
  return ks[jnp.sum(starts <= step) - 1]


def draw(
  e: ElasticK, top_k: int, rng: jax.Array, step: jax.Array | None, n_layers: int, n_tokens: int
) -> jax.Array:
  """k per MoE layer and token, int32 [n_layers, n_tokens], for one training forward."""
  shape = (n_layers, n_tokens)
  if e.mode == "fixed":
    return jnp.full(shape, top_k, jnp.int32)
  if e.mode == "schedule":
    return jnp.broadcast_to(scheduled_k(e.schedule, jnp.asarray(step)), shape)
  key = jax.random.fold_in(rng, STREAM)
  drawn = {"step": (1, 1), "layer": (n_layers, 1), "token": shape}[e.scope]
  k = jax.random.randint(key, drawn, e.k_min, top_k + 1, dtype=jnp.int32)
  return jnp.broadcast_to(k, shape)
