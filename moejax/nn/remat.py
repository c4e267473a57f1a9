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


# Ops that only move or cast data. A scanned block with `remat="none"` recomputes them in the
# backward instead of saving their outputs: a scan saves each residual as a stacked array,
# so the bf16 casts, reshapes and gate/up concatenations of every layer's weights would
# stay alive for the whole step (unrolled, XLA recomputes or frees them itself).
# `python benchmarks/scan_memory.py` (8 CPU devices, FSDP 8, bf16): 72.2 MiB of temporaries
# unrolled, 105.6 scanned saving everything, 73.6 scanned with this policy.
MOVES = frozenset(
  {
    "convert_element_type",
    "concatenate",
    "transpose",
    "reshape",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
  }
)


def save_all_but_moves(prim, *_, **__) -> bool:
  """A `jax.checkpoint` policy: save every output but those of `MOVES`."""
  return prim.name not in MOVES


def block_call(name: str, *, train: bool, scanned: bool = False) -> Callable:
  """`call(block, x, positions, rng, ov, per_layer)` running `block` with the overrides `ov`
  and this layer's rows of its per-layer fields (`Overrides.rows`), rematerialized by
  policy `name`.

  `scanned`: inside a layer scan, where `none` is `save_all_but_moves` (see `MOVES`). There
  `jax.checkpoint` keeps `prevent_cse=True` too (MaxText passes False when scanning): with
  False, XLA:CPU fuses the recomputation differently and a scanned gradient differs from
  the unrolled one in the last bits; with True, a remat policy gives bitwise-equal
  gradients in both layouts (tests/test_scan.py).

  The block is split into graph and state and run as a pure function under
  `jax.checkpoint`: a forward pass never writes the block's state (the router bias is
  updated outside, `step.update_router_bias`), so nothing flows back out."""

  def call(block, x_BxLxD, positions_BxL, rng, ov, per_layer):
    return block(x_BxLxD, positions_BxL, train=train, rng=rng, ov=ov.with_per_layer(*per_layer))

  if name == "none" and not scanned:
    return call
  policy = REMAT_POLICIES[name] if name != "none" else save_all_but_moves

  def remat_call(block, x_BxLxD, positions_BxL, rng, ov, per_layer):
    graphdef, state = nnx.split(block)
    static_ov = ov.with_per_layer(None, None)  # k, k2, grid_stats: closed over

    def pure(state, x_BxLxD, positions_BxL, rng, per_layer):
      return call(nnx.merge(graphdef, state), x_BxLxD, positions_BxL, rng, static_ov, per_layer)

    checkpointed = jax.checkpoint(pure, policy=policy)
    return checkpointed(state, x_BxLxD, positions_BxL, rng, per_layer)

  return remat_call
