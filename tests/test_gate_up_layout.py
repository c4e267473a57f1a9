"""Gate and up are one parameter `w_gate_up [E, D, 2F]` (issue 50): no kernel joins them or
splits the weight (or its gradient) into halves, forward or backward. Read from each
kernel's lowered StableHLO on this host, with shapes chosen so that nothing else is
[..., D, F] or [..., D, 2F]; the detector is checked on a program that does join them.
(The accelerator presets' compiled steps: benchmarks/expert_concats.py.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import dispatch as dsp
from moejax.kernels import plans
from moejax.kernels.plans import ExpertWeights
from moejax.kernels.registry import KERNELS

T, E, K, D, F = 10, 3, 2, 8, 6
OP = re.compile(r"stablehlo\.(concatenate|slice)\b.*->\s*tensor<([\dx]+)x\w+>")


def weight_halves(text: str) -> list[str]:
  """Concatenates that end in [D, 2F] and slices that end in [D, F]: gate and up joined or
  split at run time."""
  want = {"concatenate": (D, 2 * F), "slice": (D, F)}
  found = []
  for op, dims in OP.findall(text):
    shape = tuple(int(v) for v in dims.split("x"))
    if shape[-2:] == want[op]:
      found.append(f"{op} -> {dims}")
  return found


def case():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(T, D)), jnp.float32)
  ex = ExpertWeights(
    jnp.asarray(r.normal(size=(E, D, 2 * F)), jnp.float32),
    jnp.asarray(r.normal(size=(E, F, D)), jnp.float32),
  )
  experts = jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(T)]), jnp.int32)
  weights = jnp.asarray(r.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
  return x, experts, weights, ex


def lowered_grad(layer) -> str:
  """The StableHLO of the layer's output and its gradients (inputs and both weights)."""
  x, experts, weights, ex = case()
  loss = lambda x, ex: jnp.sum(layer(x, experts, weights, ex) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ex).as_text()


def runs_here(name: str, mode: str) -> bool:
  k = KERNELS[name]
  return mode in k.modes and k.missing() is None


# megablox (interpret mode) and tokamax lower slowly here (~5 s each): full tier
SLOW = {"megablox", "tokamax"}
DROPLESS = [
  pytest.param(n, marks=pytest.mark.full if n in SLOW else ())
  for n in KERNELS
  if runs_here(n, "dropless")
]
CAPACITY = [n for n in KERNELS if runs_here(n, "capacity")]


def test_the_detector_finds_a_join_and_a_split():
  def joined(x, experts, weights, ex):  # the layout before issue 50, written out
    gate, up = ex.w_gate_up_ExDx2F[..., :F], ex.w_gate_up_ExDx2F[..., F:]
    w = jnp.concatenate([gate, up], axis=-1)
    h = jnp.einsum("td,edf->tef", x, w)
    return jnp.einsum("tef,efd->td", jax.nn.silu(h[..., :F]) * h[..., F:], ex.w_down_ExFxD)

  found = weight_halves(lowered_grad(joined))
  assert any(f.startswith("concatenate") for f in found), found
  assert any(f.startswith("slice") for f in found), found


@pytest.mark.parametrize("impl", DROPLESS)
def test_no_dropless_kernel_joins_or_splits_gate_and_up(impl):
  layer = lambda x, e, w, ex: dsp.dropless(x, e, w, ex, impl=impl, block=4)
  assert weight_halves(lowered_grad(layer)) == []


@pytest.mark.parametrize("impl", CAPACITY)
def test_no_capacity_kernel_joins_or_splits_gate_and_up(impl):
  def layer(x, e, w, ex):
    order = plans.drop_order("position", e, w, None, T)
    cap = plans.capacity(1.0, K, T, E, min_capacity=2)
    return dsp.capacity_dispatch(x, e, w, ex, cap=cap, group_size=T, order=order, impl=impl)[0]

  assert weight_halves(lowered_grad(layer)) == []
