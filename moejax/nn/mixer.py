"""The mixer interface: what every token-mixing layer offers a block (docs/design.md §5).

A *mixer* is the attention half of a block: softmax GQA today (`layers.Attention`), and the
kinds the MLA and Gated DeltaNet issues add. Each is an `nnx.Module` with

    __call__(x_BxLxD, positions_BxL, *, cache=None, at=None) -> (y_BxLxD, cache)
    init_cache(batch, max_len, dtype) -> cache

* Training and scoring: `cache=None`, `at=None`; the mixer is causal over the L tokens it is
  given and returns `(y, None)`.
* Decode: the same module with its own cache (a NamedTuple of arrays, whatever the kind
  needs: per-head K/V for GQA, the compressed latent and the rope key for MLA, the recurrent
  state and the conv window for a Gated DeltaNet) and a `DecodeAt`, shared by every layer,
  saying where the call's L tokens land. Prefill is a call with L = the prompt's padded
  length at `at.index = 0`; a step is a call with L = 1. It returns the updated cache.

Batches are left-padded: row b's real tokens occupy slots `start_B[b]` onwards, so that all
rows write the same slot at each step. A slot before `start_B[b]` is padding: no query
attends to it, and a recurrent mixer must leave its state unchanged there (`valid_BxL`).
Positions (RoPE) count from each row's first real token (`positions_BxL`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DecodeAt(NamedTuple):
  """Where a decode call's L tokens land in every layer's cache."""

  index: jax.Array  # int32 []: the cache slot of the call's first token
  start_B: jax.Array  # int32 [B]: each row's first real slot (its left padding)

  def slots_L(self, L: int) -> jax.Array:
    """The cache slots of the call's tokens."""
    return self.index + jnp.arange(L, dtype=jnp.int32)

  def valid_BxL(self, L: int) -> jax.Array:
    """Whether each of the call's tokens is real (not left padding)."""
    return self.slots_L(L)[None, :] >= self.start_B[:, None]

  def positions_BxL(self, L: int) -> jax.Array:
    """Each token's position in its row (0 at the row's first real token; 0 on padding)."""
    return jnp.maximum(self.slots_L(L)[None, :] - self.start_B[:, None], 0)

  def mask_BxLxS(self, L: int, S: int) -> jax.Array:
    """Which cache slots (of S) each query may read: real (from `start_B`) and causal."""
    slot_S = jnp.arange(S, dtype=jnp.int32)
    causal_LxS = slot_S[None, :] <= self.slots_L(L)[:, None]
    real_BxS = slot_S[None, :] >= self.start_B[:, None]
    return causal_LxS[None] & real_BxS[:, None, :]


def start_at(start_B: jax.Array) -> DecodeAt:
  """The prefill's `DecodeAt`: slot 0 onwards, rows starting at `start_B`."""
  return DecodeAt(jnp.zeros((), jnp.int32), jnp.asarray(start_B, jnp.int32))


def write_slots(cache_BxSx: jax.Array, new_BxLx: jax.Array, index: jax.Array) -> jax.Array:
  """`cache` with slots index … index+L−1 replaced by `new` (in the cache's dtype)."""
  starts = (0, index) + (0,) * (cache_BxSx.ndim - 2)
  return jax.lax.dynamic_update_slice(cache_BxSx, new_BxLx.astype(cache_BxSx.dtype), starts)
