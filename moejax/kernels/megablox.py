"""The `megablox` kernel: the Pallas TPU grouped matmul shipped with JAX
(`jax.experimental.pallas.ops.tpu.megablox`), MaxText's TPU default (`megablox: true`).

A custom VJP like the shipped `ops.gmm`: dx by `gmm` against the transposed weights, dW by
`tgmm`, but each of the three calls gets tiles chosen for its own (m, k, n): the shipped
VJP reuses the forward tiling, which is illegal for the backward pass whenever the two
weight dims differ and are not both multiples of 128 (d_model 128 with d_expert 32). Rows are
sorted by expert without padding; the buffer is padded to a multiple of the m tile, and the
pad rows (zeros) are counted in the last expert's group, so every row belongs to a group
and contributes exactly zero (so do rows left empty by elastic-k's unused assignments, which
megablox therefore still computes). Inputs stay in the compute dtype (bf16 on TPU presets) and
accumulate in float32. Gate and up are one `gmm` against [E, D, 2F]: one kernel and one
[M, 2F] output instead of two, so fewer temporaries at the same FLOPs (the TPU preset's step:
benchmarks/results/tpu_ragged_dot_train_step.json). Lowered for TPU it is a Mosaic kernel; on any other platform the
same kernel runs in Pallas interpret mode (slow; for tests on CPU).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from moejax.backend import platforms
from moejax.kernels import plans, residuals

# the kernel module (the package's `gmm` attribute is its custom-VJP function, not the module)
backend = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

M_TILES = (512, 256, 128)  # MaxText's default m tile is 512; 128 is the MXU width
KN_TILES = (1024, 512, 256, 128)
# VMEM a call's tiles may take by `vmem_bytes`, of the 16 MiB of scoped VMEM XLA:TPU gives a
# kernel on v5e (v4 the same, v6e 32): below the limit by a margin, because `vmem_bytes`
# misses some of what the TPU compiler allocates (the refused tiling of the TPU sweep's
# widest experts: docs/cloud.md; test_megablox_compiles_at_the_tpu_sweeps_widest_experts).
VMEM_BUDGET = 12 << 20


def kn_tile(dim: int) -> int:
  """The largest tile in `KN_TILES` dividing `dim`, else the whole dim: a Mosaic block's
  last dim must be a multiple of 128 or the array's own."""
  return next((t for t in KN_TILES if dim % t == 0), dim)


def m_tile(n_rows: int, n_experts: int) -> int:
  """Rows per m tile: about one expert's mean rows, between 128 and 512 (a tile that
  straddles two groups is visited once per group, so smaller tiles waste less there)."""
  mean = max(n_rows // n_experts, 1)
  return next((t for t in M_TILES if t <= mean), M_TILES[-1])


def vmem_bytes(tile: tuple[int, int, int], in_bytes: int, transposed: bool = False) -> int:
  """VMEM of one grouped-matmul call with (tm, tk, tn) tiles: both inputs' tiles double
  buffered, the float32 accumulator and the float32 output tile double buffered. `gmm`'s
  output tile is [tm, tn]; `tgmm`'s (`transposed`, dW) is [tk, tn]."""
  tm, tk, tn = tile
  out = (tk if transposed else tm) * tn
  rhs = (tm if transposed else tk) * tn  # gmm's rhs tile is [tk, tn], tgmm's (dy) [tm, tn]
  return 2 * (tm * tk + rhs) * in_bytes + 3 * out * 4


def tiling(tm: int, k: int, n: int, in_bytes: int = 2, transposed: bool = False):
  """(tm, tk, tn): the largest k and n tiles dividing the dims (`kn_tile`), the larger of the
  two halved while the call's `vmem_bytes` exceed VMEM_BUDGET (a halved tile still divides)."""
  tk, tn = kn_tile(k), kn_tile(n)
  while vmem_bytes((tm, tk, tn), in_bytes, transposed) > VMEM_BUDGET:
    if tn >= tk and tn % 256 == 0:
      tn //= 2
    elif tk % 256 == 0:
      tk //= 2
    else:
      break
  return tm, tk, tn


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(lhs_MxK, rhs_ExKxN, counts_E, tm: int, interpret: bool):
  """out[rows of group e] = lhs[rows of e] @ rhs[e], accumulated in float32."""
  K, N = rhs_ExKxN.shape[1:]
  tile = tiling(tm, K, N, lhs_MxK.dtype.itemsize)
  return backend.gmm(lhs_MxK, rhs_ExKxN, counts_E, jnp.float32, tile, interpret=interpret)


def _gmm_fwd(lhs_MxK, rhs_ExKxN, counts_E, tm, interpret):
  res = residuals.named((lhs_MxK, rhs_ExKxN, counts_E))
  return gmm(lhs_MxK, rhs_ExKxN, counts_E, tm, interpret), res


def _gmm_bwd(tm, interpret, res, g_MxN):
  lhs_MxK, rhs_ExKxN, counts_E = res
  K, N = rhs_ExKxN.shape[1:]
  g = g_MxN.astype(lhs_MxK.dtype)
  size = lhs_MxK.dtype.itemsize
  dlhs_tile = tiling(tm, N, K, size)
  dlhs_MxK = backend.gmm(
    g, rhs_ExKxN, counts_E, jnp.float32, dlhs_tile, transpose_rhs=True, interpret=interpret
  )
  drhs_tile = tiling(tm, K, N, size, transposed=True)
  drhs_ExKxN = backend.tgmm(
    lhs_MxK.swapaxes(0, 1), g, counts_E, jnp.float32, drhs_tile, interpret=interpret
  )
  ints = np.zeros(counts_E.shape, jax.dtypes.float0)
  return dlhs_MxK.astype(lhs_MxK.dtype), drhs_ExKxN.astype(rhs_ExKxN.dtype), ints


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _gmm(lhs_MxK, rhs_ExKxN, counts_E, tm: int, interpret: bool):
  return gmm(lhs_MxK, rhs_ExKxN, counts_E, tm, interpret).astype(lhs_MxK.dtype)


def swiglu(x_MxD, ex: plans.ExpertWeights, counts_E, tm: int, interpret: bool) -> jax.Array:
  """Per-group SwiGLU on rows grouped by expert; M must divide by the m tile `tm`. Gate and
  up are one grouped matmul against [E, D, 2F] (as `fused` and `tokamax`): one kernel and
  one [M, 2F] output instead of two, and one dx and one dW call in the backward pass."""
  F = ex.w_down_ExFxD.shape[1]
  gu_Mx2F = _gmm(x_MxD, ex.w_gate_up_ExDx2F, counts_E, tm, interpret)
  h_MxF = jax.nn.silu(gu_Mx2F[:, :F]) * gu_Mx2F[:, F:]
  return _gmm(h_MxF, ex.w_down_ExFxD, counts_E, tm, interpret)


def _run(x_TxD, plan, counts_E, weights_TxK, ex, *, interpret: bool) -> jax.Array:
  K, E = weights_TxK.shape[1], ex.w_gate_up_ExDx2F.shape[0]
  x_AxD = plans.expand(x_TxD, plan, K)
  A = x_AxD.shape[0]
  tm = m_tile(A, E)
  pad = -A % tm
  x_MxD = jnp.pad(x_AxD, ((0, pad), (0, 0)))
  # pad rows, and rows left empty by unused assignments (elastic-k), join the last group
  counts_E = counts_E.astype(jnp.int32)
  counts_E = counts_E.at[-1].add(A + pad - counts_E.sum())
  y_AxD = swiglu(x_MxD, ex, counts_E, tm, interpret)[:A]
  return plans.combine(y_AxD, plan, weights_TxK)


def _compiled(*args):
  return _run(*args, interpret=False)


def _interpreted(*args):
  return _run(*args, interpret=True)


def run(a: plans.KernelArgs) -> jax.Array:
  """Mosaic on TPU, interpret mode elsewhere (chosen for the platform lowered for)."""
  args = (a.x_TxD, a.plan, a.counts_E, a.weights_TxK, a.ex)
  return platforms.platform_dependent(*args, tpu=_compiled, default=_interpreted)
