"""Training losses: next-token cross-entropy, router z-loss, the selection-bias update, and
the losses' config (the load-balance loss is `moejax.nn.balance`).

All functions are pure and jit-able. Losses are returned unweighted: the caller multiplies
by its coefficient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.errors import UserError
from moejax.nn.balance import BALANCE_CHOICES, BALANCE_CONVENTIONS, GRANULARITIES
from moejax.schema import check_fields, key


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Weights and granularity of the auxiliary losses (config `loss.*`)."""

  balance_weight: float = key(0.01, "weight of the load-balance loss", ge=0)
  balance_granularity: str = key(
    "global_batch", "over which tokens the balance loss counts loads", GRANULARITIES
  )
  z_loss_weight: float = key(0.001, "weight of the router z-loss", ge=0)
  bias_update_rate: float = key(
    0.0,
    "aux-loss-free balancing: the selection bias's update rate (rules with selection_bias)",
    ge=0,
  )
  balance_convention: str = key(
    "fraction",
    "f_i over all assignments (fraction, Σf = 1) or over tokens (count)",
    BALANCE_CONVENTIONS,
  )
  balance_choices: str = key("all", "which choices count in f: all top-k, or top1", BALANCE_CHOICES)
  n_shards: int = 1  # data-parallel shards, for `micro_batch` granularity (from the mesh)
  grad_accum: int = 1  # train.grad_accum

  def __post_init__(self):
    check_fields(self, "loss")


@jax.custom_vjp
def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  """−log softmax(logits)[target] per row of float32 logits, with its gradient (softmax − onehot)
  computed in the same pass as the loss (`_token_nll_fwd`)."""
  return _token_nll_fwd(logits_NxV, targets_N)[0]


def _token_nll_fwd(logits_NxV, targets_N):
  """The loss and its logits gradient, tied by an optimization barrier: the backward needs
  the gradient first, so the loss cannot be scheduled after the backward layer loop, which
  would keep the [tokens, vocab] logits alive through it (XLA:TPU did so with scanned
  layers; the bytes: docs/design.md §5)."""
  x_NxV = logits_NxV
  lse_N = jax.nn.logsumexp(x_NxV, axis=-1)
  nll_N = lse_N - jnp.take_along_axis(x_NxV, targets_N[:, None], axis=-1)[:, 0]
  onehot_NxV = jax.nn.one_hot(targets_N, x_NxV.shape[-1], dtype=jnp.float32)
  dnll_NxV = jnp.exp(x_NxV - lse_N[:, None]) - onehot_NxV
  nll_N, dnll_NxV = jax.lax.optimization_barrier((nll_N, dnll_NxV))
  return nll_N, dnll_NxV


def _token_nll_bwd(dnll_NxV, g_N):
  return (dnll_NxV * g_N[:, None], None)


token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


def cross_entropy(
  logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Next-token CE in float32: `targets_BxL[b, t]` is the token predicted at position t.

  Returns (mean over unmasked tokens, per-token loss_BxL with masked positions set to 0).
  """
  if logits_BxLxV.shape[:-1] != targets_BxL.shape:
    raise UserError(
      f"targets_BxL: shape {targets_BxL.shape} must equal logits_BxLxV.shape[:-1] "
      f"{logits_BxLxV.shape[:-1]}"
    )
  V = logits_BxLxV.shape[-1]
  tgt_N = targets_BxL.reshape(-1).astype(jnp.int32)
  logits_NxV = logits_BxLxV.reshape(-1, V).astype(jnp.float32)  # its cotangent: the input's dtype
  loss_BxL = token_nll(logits_NxV, tgt_N).reshape(targets_BxL.shape)
  if mask_BxL is None:
    return loss_BxL.mean(), loss_BxL
  if mask_BxL.shape != targets_BxL.shape:
    raise UserError(
      f"mask_BxL: shape {mask_BxL.shape} must equal targets_BxL.shape {targets_BxL.shape}"
    )
  m_BxL = mask_BxL.astype(jnp.float32)
  loss_BxL = loss_BxL * m_BxL
  return loss_BxL.sum() / jnp.maximum(m_BxL.sum(), 1.0), loss_BxL


def accuracy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Per-token next-token accuracy (float32 0/1): argmax of logits equals the target."""
  return (jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32)


def router_z_loss(logits_TxE: jax.Array) -> jax.Array:
  """ST-MoE router z-loss mean(logsumexp(z)²) in float32 (unweighted); any leading shape."""
  return jnp.square(jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)).mean()


def bias_update(bias_E: jax.Array, load_E: jax.Array, gamma: float | jax.Array) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek-V3): b_i += γ · sign(mean(load) − load_i).

  `load_E` are global-batch assignment counts; the result keeps `bias_E`'s dtype.
  """
  if bias_E.shape != load_E.shape or bias_E.ndim != 1:
    raise UserError(f"load_E: shape {load_E.shape} must equal bias_E shape {bias_E.shape} (1-D)")
  load_E = jax.lax.stop_gradient(load_E).astype(jnp.float32)
  step_E = gamma * jnp.sign(load_E.mean() - load_E)
  return (bias_E.astype(jnp.float32) + step_E).astype(bias_E.dtype)
