"""Rematerialization of transformer blocks (`model.remat`): what a block keeps for backward.

Each block is wrapped in `jax.checkpoint` with a saving policy, as MaxText
does per decoder layer (`remat_policy` in its base.yml; its decoders' `get_remat_policy`):

* `none`: no checkpoint; autodiff keeps every residual (the program of a plain forward).
* `full`: nothing saved; the backward pass recomputes the whole block from its input.
* `minimal`: MaxText's name; saves matmul outputs without batch dimensions (the q/k/v/o
  projections and dense FFN matmuls), recomputes the rest, attention's batched einsums
  included (`jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`).
* `dots_saveable`: saves every matmul output, attention's score einsums included
  (`jax.checkpoint_policies.dots_saveable`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

# name -> jax.checkpoint policy; `none` is the only name that is not wrapped at all.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def block_call(name: str, **static) -> Callable:
  """`call(block, x, positions, rng, routed_scale, train_k)` running `block` with the keyword
  arguments `static` (python values: k, k2, train), rematerialized by policy `name`.

  The block is split into graph and state and run as a pure function under
  `jax.checkpoint`: a forward pass never writes the block's state (the router bias is
  updated outside, `step.update_router_bias`), so nothing flows back out."""

  def call(block, x_BxLxD, positions_BxL, rng, routed_scale, train_k=None):
    return block(
      x_BxLxD, positions_BxL, rng=rng, routed_scale=routed_scale, train_k=train_k, **static
    )

  if name == "none":
    return call
  policy = REMAT_POLICIES[name]

  def remat_call(block, x_BxLxD, positions_BxL, rng, routed_scale, train_k=None):
    graphdef, state = nnx.split(block)

    def pure(state, *args):
      return call(nnx.merge(graphdef, state), *args)

    args = (x_BxLxD, positions_BxL, rng, routed_scale, train_k)
    return jax.checkpoint(pure, policy=policy)(state, *args)

  return remat_call
