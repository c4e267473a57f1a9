"""Compiled eval forwards of the grid: per-sequence loss and accuracy, per-layer MoE stats.

One jitted function per k1, for every cell at that k1: k2 is a traced scalar (an integer
k2, or `routing.OWN_K2` for `native` and the rescaling cells, whose forward keeps the rule's
own normalization) and so is the per-layer routed scale (ones but for the rescaling cells).
k1 stays static: it sets the shape of the top-k.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.backend import compile_options
from moejax.kgrid import masses
from moejax.nn import routing
from moejax.nn import model as model_lib
from moejax.nn.model import moe_biases
from moejax.nn.moe import RouterOut
from moejax.nn.overrides import Overrides
from moejax.training.step import eval_forward

# Per-layer block diagnostics averaged over sequences; `*_rms` are averaged as mean squares.
LAYER_STATS = (
  "mass_k1",
  "mass_K",
  "mass_k2",
  "routed_mass",
  "shared_coef",
  "routed_out_rms",
  "moe_out_rms",
)


class CellResult(NamedTuple):
  """Outputs of one cell over the evaluated sequences."""

  loss_N: np.ndarray  # float64 mean next-token loss per sequence
  accuracy_N: np.ndarray
  layers: dict[str, np.ndarray]  # LAYER_STATS name -> [M] per MoE layer; rms names as squares


def _stat(ro: RouterOut, name: str) -> jax.Array:
  """A per-layer scalar from the block's diagnostics, or its grid-only output rms."""
  return ro.moe_out_rms if name == "moe_out_rms" else getattr(ro.diag, name)


def _make_forward(graphdef, k1: int):
  def forward(params, router, tokens_BxL1, k2, scale_M):
    ov = Overrides(k=k1, k2=k2, routed_scale=scale_M, grid_stats=True)
    out = eval_forward(graphdef, params, router, tokens_BxL1, ov)
    model = nnx.merge(graphdef, params, router)
    stats = masses.layer_masses(out.routers, moe_biases(model), model.cfg.moe, k1, k2)
    for n in LAYER_STATS[len(masses.MASSES) :]:
      stats[n] = jnp.stack([_stat(ro, n) for ro in out.routers.values()])
    return out.loss_B, out.accuracy_B, stats

  return forward


class CellForward:
  """Runs cells of one restored model, compiling once per k1."""

  def __init__(self, graphdef, params, router, n_moe_layers: int):
    self.graphdef, self.params, self.router = graphdef, params, router
    self.n_moe_layers = n_moe_layers
    self._compiled: dict[int, object] = {}
    model_lib.preload_kernels(graphdef, params, router)  # meshless: every platform's

  def compiled(self, k1: int):
    if k1 not in self._compiled:
      self._compiled[k1] = compile_options.jit(_make_forward(self.graphdef, k1))
    return self._compiled[k1]

  def run(
    self, batches: list[np.ndarray], k1: int, k2: int | None = None, scale_M=None
  ) -> CellResult:
    """Cell (k1, k2) with the routed output of MoE layer l times `scale_M[l]` (default 1);
    `k2=None`: the rule's own normalization."""
    fn = self.compiled(k1)
    scale_M = np.ones((self.n_moe_layers,), np.float32) if scale_M is None else scale_M
    k2_arr = jnp.int32(routing.OWN_K2 if k2 is None else k2)
    scale_arr = jnp.asarray(scale_M, jnp.float32)
    loss, acc, sums, n_seq = [], [], {n: 0.0 for n in LAYER_STATS}, 0
    for tokens in batches:
      out = jax.device_get(fn(self.params, self.router, tokens, k2_arr, scale_arr))
      loss.append(np.asarray(out[0], np.float64))
      acc.append(np.asarray(out[1], np.float64))
      n = tokens.shape[0]
      for name, v_M in out[2].items():
        v_M = np.asarray(v_M, np.float64)
        sums[name] = sums[name] + (v_M**2 if name.endswith("_rms") else v_M) * n
      n_seq += n
    layers = {name: np.asarray(v) / n_seq for name, v in sums.items()}
    return CellResult(np.concatenate(loss), np.concatenate(acc), layers)
