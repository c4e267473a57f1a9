"""The on-device non-finite check of every train step (config `train.on_nonfinite`).

The wrapped step returns `metrics["nonfinite"]`: 0 when every checked quantity is finite,
else 1 + the index of the first non-finite one in forward order (router logits of each MoE
layer, seen through its z-loss = mean(logsumexp(z)²); the loss; the gradient norm; the
parameters after the update). It is fetched with the step's other outputs, so the check
adds no host sync. Under `skip` a non-finite step keeps the old params, router state and
optimizer state (the batch is still consumed and the step counter still advances).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

POLICIES = ("stop", "skip")


def quantity_names(moe_layers: list[int]) -> list[str]:
  """Names of the checked quantities, in the order of the flag's index."""
  routers = [f"router logits of layer {i}" for i in moe_layers]
  return routers + ["loss", "gradient norm", "parameters after the update"]


def _router_keys(moe_layers: list[int]) -> list[str]:
  return [f"moe/layer{i}/z_loss" for i in moe_layers]


def first_nonfinite(values: list[jax.Array]) -> jax.Array:
  """int32: 0 if all scalars are finite, else 1 + index of the first non-finite one."""
  bad_N = ~jnp.isfinite(jnp.stack([jnp.asarray(v, jnp.float32) for v in values]))
  return jnp.where(bad_N.any(), jnp.argmax(bad_N) + 1, 0).astype(jnp.int32)


def guard(train_step: Callable, moe_layers: list[int], policy: str) -> Callable:
  """train_step(state, tokens, rng) -> (state, metrics) plus the `nonfinite` flag; with
  `skip`, a flagged step's update is dropped on device (`metrics["skipped"]` = 1)."""

  def guarded(state, tokens_BxL1, rng):
    new_state, metrics = train_step(state, tokens_BxL1, rng)
    values = [metrics[k] for k in _router_keys(moe_layers)]
    values += [metrics["loss"], metrics["grad_norm"], optax.tree.norm(new_state["params"])]
    flag = first_nonfinite(values)
    metrics = {**metrics, "nonfinite": flag}
    if policy == "skip":
      bad = flag > 0
      kept = jax.tree.map(lambda new, old: jnp.where(bad, old, new), new_state, state)
      new_state = {**kept, "step": new_state["step"]}
      metrics["skipped"] = bad.astype(jnp.int32)
    return new_state, metrics

  return guarded


def describe(flag: int, moe_layers: list[int]) -> str:
  """The name of the quantity a nonzero flag points at."""
  return quantity_names(moe_layers)[flag - 1]
