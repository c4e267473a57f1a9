"""The rescaling cells' scales (moejax.kgrid.gain): the in-order layer fit, a known scale
recovered, and the gain cell's calibration split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kgrid import forward, gain
from moejax.kgrid.loading import load_config
from moejax.training import checkpoint, trainer

from .helpers import BATCH, CALIB, RULES, SEQUENCES, K, cells_of, my_forward
from runconfig import as_run

# ---------------------------------------------------------------- gain fit, compiles, loading


def test_fit_gain_fits_layers_in_order():
  """A fake 3-layer chain where layer l's routed output is a_l times the product of the
  earlier layers' scales: only an in-order fit makes every layer hit its target."""
  a_M, target_M = np.array([2.0, 3.0, 0.5]), np.array([1.0, 4.0, 0.25])
  calls = []

  def measure_ms(scale_M):
    calls.append(scale_M.copy())
    rms_M = a_M * np.concatenate([[1.0], np.cumprod(scale_M)[:-1]]) * scale_M
    return rms_M**2

  got = gain.fit_gain(measure_ms, target_M**2)
  assert np.allclose(np.sqrt(measure_ms(got)), target_M, rtol=1e-6)
  # by hand: c0 = 1/2; layer 1 sees 3·c0 = 1.5 -> c1 = 4/1.5; layer 2 sees 0.5·c0·c1
  want = [0.5, 4 / 1.5, 0.25 / (0.5 * 0.5 * 4 / 1.5)]
  assert got == pytest.approx(want, rel=1e-6)
  assert len(calls) == 4 and calls[0].tolist() == [1.0, 1.0, 1.0]
  assert gain.sqrt_scale(2, 8, 3) == pytest.approx([0.5, 0.5, 0.5])


def test_gain_cell_fitted_on_disjoint_calibration_split(mixtral_grid):
  """The gain scales equal an independent layer-by-layer fit (NumPy forward) on the CALIB
  held-out windows that follow the SEQUENCES evaluated ones, never on the evaluated ones."""
  workdir, rows = mixtral_grid
  got = cells_of(rows)[(2, "gain")]["scale_per_layer"]
  c = load_config(workdir)
  run = trainer.build(as_run(c), workdir)
  _, state, _ = checkpoint.restore(checkpoint.manager(workdir), run.state)
  toks = np.concatenate([np.asarray(b) for b in run.data.eval_batches(SEQUENCES + CALIB, BATCH)])
  calib = toks[SEQUENCES:]
  assert calib.shape[0] == CALIB
  rule = RULES["mixtral"]
  target = my_forward(state["params"], state["router"], calib, rule, K, None)["ms"]
  scale = [1.0, 1.0]
  for layer in range(2):
    ms = my_forward(state["params"], state["router"], calib, rule, 2, None, K, scale)["ms"]
    scale[layer] = float(np.sqrt(target[layer] / ms[layer]))
  assert list(got.values()) == pytest.approx(scale, rel=1e-4)
  # fitting on the evaluated windows instead would give other scales
  evaluated = toks[:SEQUENCES]
  ms_eval = my_forward(state["params"], state["router"], evaluated, rule, 2, None)["ms"]
  ms_ref = my_forward(state["params"], state["router"], evaluated, rule, K, None)["ms"]
  assert abs(np.sqrt(ms_ref[0] / ms_eval[0]) - scale[0]) > 1e-3


def test_gain_fit_recovers_known_scale(restored):
  """Routed output linear in its coefficient: multiply layer l's routed experts' w_down by
  f_l; fitting k1 = K on the scaled model to the original's routed RMS gives c_l = 1/f_l,
  for layer 1 only because layer 0's fit is applied first (its input is then the original)."""
  _, ev, fwd = restored
  calib = [ev.heldout_NxL1[SEQUENCES : SEQUENCES + CALIB]]
  target_ms = fwd.run(calib, K).layers["routed_out_rms"]
  factors = [2.0, 0.25]
  params = jax.tree.map(lambda a: a, ev.params)
  w = params["stacks"][0]["blocks"][0]["mlp"]["experts"]["w_down"]  # [layer, E, F, D]
  w[...] = w[...] * jnp.asarray(factors)[:, None, None, None]
  scaled = forward.CellForward(ev.graphdef, params, ev.router, ev.n_moe_layers)
  scaled._compiled = fwd._compiled  # same graph, same compiled forwards
  got = gain.fit_gain(lambda s: scaled.run(calib, K, scale_M=s).layers["routed_out_rms"], target_ms)
  assert got == pytest.approx([1 / f for f in factors], rel=1e-4)
  assert scaled.run(calib, K).layers["routed_out_rms"][0] == pytest.approx(4 * target_ms[0])
