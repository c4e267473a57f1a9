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

from moejax.kernels import residuals

# name -> jax.checkpoint policy; `none` is the only name that is not wrapped at all.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


# What a scanned block with `remat="none"` saves for the backward: the outputs of matmuls,
# kernels (custom VJPs, Pallas and FFI calls), reductions, gathers, scatters and sorts. The
# rest (elementwise ops, casts, layout) is recomputed inside the backward's fusions. A scan
# saves every residual of its body as a stacked array that lives for the whole step, where
# the unrolled program lets XLA fuse cheap producers into the backward instead of keeping
# them: saving everything, the GPU preset's scanned step on 8 x H100 needed about 1.5x the
# unrolled step's temporaries, and with this policy about the same (docs/cloud.md, "Scanned
# layers"; benchmarks/results/aot_compile_time_h100_8.json has the current figures).
SAVED = frozenset(
  {
    "dot_general",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "pallas_call",
    "ffi_call",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "argmax",
    "argmin",
    "cumsum",
    "sort",
    "top_k",
    "gather",
    "scatter",
    "scatter-add",
  }
)


def save_expensive(prim, *_, **params) -> bool:
  """A `jax.checkpoint` policy: save the outputs of `SAVED` primitives and the kernels'
  named residuals (`kernels.residuals`: else JAX reruns a kernel's forward in the backward)."""
  return prim.name in SAVED or (prim.name == "name" and params.get("name") == residuals.NAME)


def block_call(name: str, *, train: bool, scanned: bool = False) -> Callable:
  """`call(block, x, positions, rng, ov, per_layer)` running `block` with the overrides `ov`
  and this layer's rows of its per-layer fields (`Overrides.rows`), rematerialized by
  policy `name`.

  `scanned`: inside a layer scan that loops, where `none` is `save_expensive` (see `SAVED`;
  a scan unrolled whole, `model.scan_unroll` 0 or -1 on CPU, keeps no stacked residuals and
  passes False). There `jax.checkpoint` keeps `prevent_cse=True` too (MaxText passes False
  when scanning): with False, XLA:CPU fuses the recomputation differently and a scanned
  gradient differs from the unrolled one in the last bits; with True, a remat policy gives
  bitwise-equal gradients in both layouts (tests/test_scan.py).

  The block is split into graph and state and run as a pure function under
  `jax.checkpoint`: a forward pass never writes the block's state (the router bias is
  updated outside, `step.update_router_bias`), so nothing flows back out."""

  def call(block, x_BxLxD, positions_BxL, rng, ov, per_layer):
    return block(x_BxLxD, positions_BxL, train=train, rng=rng, ov=ov.with_per_layer(*per_layer))

  if name == "none" and not scanned:
    return call
  policy = REMAT_POLICIES[name] if name != "none" else save_expensive

  def remat_call(block, x_BxLxD, positions_BxL, rng, ov, per_layer):
    graphdef, state = nnx.split(block)
    static_ov = ov.with_per_layer(None, None)  # k, k2, grid_stats: closed over

    def pure(state, x_BxLxD, positions_BxL, rng, per_layer):
      return call(nnx.merge(graphdef, state), x_BxLxD, positions_BxL, rng, static_ov, per_layer)

    checkpointed = jax.checkpoint(pure, policy=policy)
    return checkpointed(state, x_BxLxD, positions_BxL, rng, per_layer)

  return remat_call
