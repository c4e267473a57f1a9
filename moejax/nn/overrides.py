"""`Overrides`: what the k-grid and elastic-k change in one forward, as one pytree argument.

The Transformer takes them at model level (`routed_scale` [M] and `train_k` [M, B, L], one
row per MoE layer in layer order) and hands each MoE block its own row (`row(m)`), or each
scanned stack its rows (`rows(m_R)`). `k` and `grid_stats` are static (they set shapes and
what is computed); `k2` may be a traced scalar (`routing.OWN_K2`: the rule's own
normalization), so one compiled grid forward serves every cell at a k1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Overrides:
  """None everywhere is the trained model: the rule's k, its own normalization, scale 1.

  * `k`: experts per token (the grid's k1); None: the trained top-k K.
  * `k2`: the denominator's top-k2 (docs/design.md §2); None, or an array holding
    `routing.OWN_K2`: the rule's own.
  * `routed_scale`: a multiplier of the routed output Σ r_i·Expert_i(x), not the shared
    expert (the grid's `sqrt`/`gain` cells).
  * `train_k`: int32 experts each token uses in a training forward (elastic-k).
  * `grid_stats`: also return what only the grid reads (`RouterOut.moe_out_rms`).
  """

  k: int | None = dataclasses.field(default=None, metadata={"static": True})
  k2: int | jax.Array | None = None
  routed_scale: jax.Array | None = None
  train_k: jax.Array | None = None
  grid_stats: bool = dataclasses.field(default=False, metadata={"static": True})

  def per_layer(self) -> tuple[jax.Array | None, jax.Array | None]:
    """The fields with one row per MoE layer: (routed_scale, train_k)."""
    return self.routed_scale, self.train_k

  def with_per_layer(self, routed_scale, train_k) -> Overrides:
    return dataclasses.replace(self, routed_scale=routed_scale, train_k=train_k)

  def rows(self, m) -> tuple[jax.Array | None, jax.Array | None]:
    """The per-layer fields' rows `m` (an int, or an int array of MoE layer indices)."""
    m = jnp.asarray(m, jnp.int32) if not isinstance(m, int) else m
    return tuple(None if a is None else a[m] for a in self.per_layer())


NONE = Overrides()
