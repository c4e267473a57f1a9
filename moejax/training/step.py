"""The jitted train and eval steps: pure functions of (graphdef, state, batch).

The model travels as `nnx.split` state: trainable `params` (nnx.Param) and `router`
(the non-trainable selection biases). The train step does gradient accumulation with
`lax.scan`, AdamW, and the aux-loss-free bias update on global-batch loads.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moejax.nn import balance, losses
from moejax.nn.losses import LossConfig
from moejax.nn.model import set_moe_biases
from moejax.nn.moe import RouterBias, RouterOut
from moejax.nn.overrides import NONE as NO_OVERRIDES
from moejax.nn.overrides import Overrides

State = dict[str, Any]  # {"step", "params", "router", "opt_state"}


def split_model(model: nnx.Module):
  """(graphdef, params, router) with the selection biases apart from the trainables."""
  graphdef, params, router = nnx.split(model, nnx.Param, RouterBias)
  return graphdef, params, router


class Loads(NamedTuple):
  """Per MoE layer assignment counts of one micro-batch."""

  all_LxE: jax.Array  # every selected expert (the aux-loss-free bias update)
  balance_LxE: jax.Array  # the choices the balance loss counts (loss.balance_choices)


def moe_losses(routers: dict[int, RouterOut], lc: LossConfig, f_LxE: jax.Array | None = None):
  """(balance loss, z-loss, metrics, Loads) averaged over MoE layers (docs/design.md §5, §6),
  from each layer's reduced router outputs (`RouterOut.balance`, `z_loss`, `diag`), stacked
  by layer [M, ...]: the per-token outputs are not read, so XLA computes the losses' inputs
  where the router runs (once in a scanned stack's body) and neither slices a stacked
  per-token array per layer nor concatenates per-layer ones (docs/performance.md)."""

  def stacked(field: str):
    return jax.tree.map(lambda *a: jnp.stack(a), *(getattr(r, field) for r in routers.values()))

  sums, z_M, diag = stacked("balance"), stacked("z_loss"), stacked("diag")
  layer_loss = functools.partial(
    balance.balance_from_sums,
    granularity=lc.balance_granularity,
    choices=lc.balance_choices,
    n_shards=lc.n_shards,
    convention=lc.balance_convention,
  )
  balance_M = jax.vmap(layer_loss)(sums, f_E=f_LxE)
  counts_MxSxE = sums.top1_SxE if lc.balance_choices == "top1" else sums.all_SxE
  per_layer = {"aux_loss": balance_M, "z_loss": z_M, **diag._asdict()}
  metrics = {
    f"moe/layer{layer}/{name}": v_M[m]
    for m, layer in enumerate(routers)
    for name, v_M in per_layer.items()
  }
  balance_loss, z_loss = balance_M.mean(), z_M.mean()
  metrics["moe/aux_loss"], metrics["moe/z_loss"] = balance_loss, z_loss
  metrics.update({f"moe/{name}": v_M.mean() for name, v_M in diag._asdict().items()})
  return balance_loss, z_loss, metrics, Loads(sums.all_SxE.sum(1), counts_MxSxE.sum(1))


def forward_loss(
  graphdef,
  params,
  router,
  tokens_BxL1: jax.Array,
  rng: jax.Array | None,
  lc: LossConfig,
  f_LxE: jax.Array | None = None,
  train: bool = True,
  step: jax.Array | None = None,
):
  """Total loss and its parts for one micro-batch; also per-layer assignment `Loads`.
  `step`: the optimizer step (elastic-k's `schedule`)."""
  model = nnx.merge(graphdef, params, router)
  logits_BxLxV, routers = model(tokens_BxL1[:, :-1], train=train, rng=rng, step=step)
  lm_loss, _ = losses.cross_entropy(logits_BxLxV, tokens_BxL1[:, 1:])
  metrics = {"lm_loss": lm_loss}
  loss = lm_loss
  loads = Loads(jnp.zeros((0,)), jnp.zeros((0,)))
  if routers:
    balance_loss, z_loss, moe_metrics, loads = moe_losses(routers, lc, f_LxE)
    loss = loss + lc.balance_weight * balance_loss + lc.z_loss_weight * z_loss
    metrics.update(moe_metrics)
  metrics["loss"] = loss
  return loss, (metrics, loads)


def _micro(tokens_BxL1: jax.Array, n: int) -> jax.Array:
  """[n, B/n, L+1] micro-batches, interleaved so each keeps rows from every data shard."""
  B = tokens_BxL1.shape[0]
  return tokens_BxL1.reshape(B // n, n, *tokens_BxL1.shape[1:]).swapaxes(0, 1)


def global_fractions(
  graphdef, params, router, tokens_BxL1, lc: LossConfig, rng, step=None
) -> jax.Array:
  """f_i over the whole batch (all accumulation steps) in the configured convention, from a
  forward-only pass."""

  def body(total, xs):
    toks, key = xs
    _, (_, loads) = forward_loss(graphdef, params, router, toks, key, lc, step=step)
    return total + loads.balance_LxE, None

  micro = _micro(tokens_BxL1, lc.grad_accum)
  keys = jax.random.split(rng, lc.grad_accum)
  _, (_, loads0) = jax.eval_shape(
    lambda: forward_loss(graphdef, params, router, micro[0], keys[0], lc, step=step)
  )
  total, _ = jax.lax.scan(body, jnp.zeros(loads0.balance_LxE.shape, jnp.float32), (micro, keys))
  n_tokens = tokens_BxL1.shape[0] * (tokens_BxL1.shape[1] - 1)
  return balance.balance_fractions(total, n_tokens, lc.balance_convention)


def make_train_step(
  graphdef, tx: optax.GradientTransformation, lc: LossConfig, schedule: optax.Schedule
):
  """Returns train_step(state, tokens_BxL1, rng) -> (state, metrics), to jit with donation."""

  def train_step(state: State, tokens_BxL1: jax.Array, rng: jax.Array):
    params, router = state["params"], state["router"]
    f_LxE = None
    if lc.balance_granularity == "global_batch" and lc.grad_accum > 1:
      f_LxE = global_fractions(graphdef, params, router, tokens_BxL1, lc, rng, state["step"])
    grad_fn = jax.value_and_grad(forward_loss, argnums=1, has_aux=True)
    step = state["step"]

    def micro_step(toks, key):
      (_, (metrics, loads)), grads = grad_fn(
        graphdef, params, router, toks, key, lc, f_LxE, True, step
      )
      return grads, metrics, loads

    micro = _micro(tokens_BxL1, lc.grad_accum)
    keys = jax.random.split(rng, lc.grad_accum)
    if lc.grad_accum == 1:  # no loop, and no second trace for the loop's zeros
      grads, metrics, loads = micro_step(micro[0], keys[0])
    else:
      grads, metrics, loads = accumulate(micro_step, micro, keys)
    scale = 1.0 / lc.grad_accum
    grads = jax.tree.map(lambda g: g * scale, grads)
    metrics = jax.tree.map(lambda m: m * scale, metrics)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    if lc.bias_update_rate > 0:
      router = update_router_bias(graphdef, params, router, loads.all_LxE, lc.bias_update_rate)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = schedule(state["step"])
    new_state = {
      "step": state["step"] + 1,
      "params": params,
      "router": router,
      "opt_state": opt_state,
    }
    return new_state, metrics

  return train_step


def accumulate(micro_step, micro, keys):
  """The sums of `micro_step(toks, key)`'s outputs over the micro-batches, as a scan whose
  zeros take their shapes from one more trace of the step (`jax.eval_shape`)."""

  def body(acc, xs):
    return jax.tree.map(jnp.add, acc, micro_step(*xs)), None

  zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(micro_step, micro[0], keys[0]))
  return jax.lax.scan(body, zeros, (micro, keys))[0]


def update_router_bias(graphdef, params, router, loads_LxE: jax.Array, rate: float):
  """b_i += γ·sign(mean load − load_i) in every MoE layer, on global-batch loads."""
  model = nnx.merge(graphdef, params, router)
  update = jax.vmap(losses.bias_update, in_axes=(0, 0, None))
  set_moe_biases(model, lambda b_RxE, rows: update(b_RxE, loads_LxE[jnp.asarray(rows)], rate))
  return nnx.state(model, RouterBias)


class EvalOut(NamedTuple):
  """One held-out batch through the model: per-sequence means and every MoE layer's router."""

  loss_B: jax.Array  # mean next-token cross-entropy of each sequence
  accuracy_B: jax.Array
  routers: dict[int, RouterOut]  # by layer index


def eval_forward(
  graphdef,
  params,
  router,
  tokens_BxL1: jax.Array,
  ov: Overrides = NO_OVERRIDES,
) -> EvalOut:
  """The eval forward shared by training's held-out loss (`make_eval_step`) and the k-grid
  (`kgrid.forward`): no dropout or noise, next-token loss and accuracy per sequence. `ov`:
  the grid's cell (docs/design.md §7); the default is the trained rule."""
  model = nnx.merge(graphdef, params, router)
  logits_BxLxV, routers = model(tokens_BxL1[:, :-1], train=False, ov=ov)
  _, loss_BxL = losses.cross_entropy(logits_BxLxV, tokens_BxL1[:, 1:])
  acc_BxL = losses.accuracy(logits_BxLxV, tokens_BxL1[:, 1:])
  return EvalOut(loss_BxL.mean(-1), acc_BxL.mean(-1), routers)


def make_eval_step(graphdef, ov: Overrides = NO_OVERRIDES):
  """eval_step(params, router, tokens_BxL1) -> per-sequence loss, accuracy and MoE aux."""

  def eval_step(params, router, tokens_BxL1: jax.Array):
    out = eval_forward(graphdef, params, router, tokens_BxL1, ov)
    aux = {layer: ro.diag._asdict() for layer, ro in out.routers.items()}
    return {"loss_B": out.loss_B, "accuracy_B": out.accuracy_B, "aux": aux}

  return eval_step


def evaluate_batches(eval_step, state: State, batches: list[np.ndarray]) -> dict:
  """Runs `eval_step` over held-out batches: per-sequence `loss_N` and `accuracy_N`, and
  per-layer `routed_mass` and `routed_ms` (mean square of the routed output)."""
  loss, acc, mass, ms = [], [], {}, {}
  for tokens in batches:
    out = jax.device_get(eval_step(state["params"], state["router"], tokens))
    loss.append(out["loss_B"])
    acc.append(out["accuracy_B"])
    n = tokens.shape[0]
    for layer, aux in out["aux"].items():
      mass[layer] = mass.get(layer, 0.0) + float(aux["routed_mass"]) * n
      ms[layer] = ms.get(layer, 0.0) + float(aux["routed_out_rms"]) ** 2 * n
  n_seq = sum(b.shape[0] for b in batches)
  return {
    "loss_N": np.concatenate(loss),
    "accuracy_N": np.concatenate(acc),
    "routed_mass": {l: v / n_seq for l, v in mass.items()},
    "routed_ms": {l: v / n_seq for l, v in ms.items()},
  }
