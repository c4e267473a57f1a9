"""The `tokamax` kernel: grouped SwiGLU on rows sorted by expert through `tokamax.ragged_dot`
(openxla/tokamax, Google's Pallas kernel library, whose grouped matmuls MaxText uses for
its MoE layers on GPU).

Rows are sorted by expert without padding; rows past the last expert's (zeros: elastic-k's
unused assignments) join the last group, so every row of the buffer is in a group (no
kernel is relied on to zero rows outside every group) and contributes exactly zero.
Gate and up are one ragged dot against [E, D, 2F]. Inputs stay in the compute dtype (bf16
on the GPU presets), accumulate in float32 and are written in the compute dtype.

A custom VJP of the three products tokamax's own VJP (`ragged_dot.base.vjp`) computes:
forward `mk,ekn->mn`, dx `mn,ekn->mk` (the transposed-RHS ragged dot), dW `mk,mn->ekn`
(the ragged-contracting dot). Each calls `tokamax.ragged_dot_general` with its own
implementation list, so each falls back on its own: tokamax 0.0.12's Mosaic GPU kernel has
no ragged-contracting dot on sm100, and its own VJP would call Mosaic for dW there.

Implementations, for the platform the program is lowered for (`jax.lax.platform_dependent`):
* cuda: `("mosaic_gpu", "triton")`; tokamax takes the first that does not raise
  NotImplementedError. Its Mosaic GPU kernel reads the GPU from JAX's default device (a GPU
  host, or a compile-only GPU made the default with `jax.default_device` for a deviceless
  compile): on sm90 it serves forward, dx and dW for bf16/f16 inputs; on sm100 forward and
  dx, dW is Triton; sm80, f32 inputs and a host whose default device is no GPU (an export)
  are Triton (the deprecated Pallas Triton backend on jax 0.11, lowered for the GPU that
  `compat.gpu_target` names). (On sm90 Mosaic's dW reads its inputs transposed, so XLA
  materializes x and h transposed, more temporaries than Triton's: measured in
  docs/dispatch.md.) tokamax's "is a GPU present" checks are off in this branch
  (`tokamax.config.cross_compile`): the branch is only lowered for CUDA.
* tpu: `("mosaic_tpu", "xla")`: tokamax's Mosaic TPU kernel where it accepts the default
  device (a TPU host, or a compile-only TPU as above); else "xla" (`jax.lax.ragged_dot`,
  native on TPU but with its dW expanded over the groups: see `dispatch.AUTO`).
Each platform names its own kernel: tokamax's "mosaic" means Mosaic GPU or Mosaic TPU by
the default device, not by the platform lowered for, so a TPU program traced on a GPU host
(or, with tokamax 0.0.17's device checks off, a GPU program on a CPU host) would hold the
other platform's kernel (`aot.custom_calls` checks every preset's compile for it).
* elsewhere: "xla", `jax.lax.ragged_dot` (densified on CPU: for tests).

A Pallas kernel is opaque to GSPMD, so dispatch runs this per device in a shard_map
(`Kernel.per_device`), as megablox.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import tokamax
from absl import flags
from tokamax._src.ops import op as tokamax_op  # the autotuning overlay's user context

from moejax.backend import platforms
from moejax.kernels import plans, residuals

# (lhs, rhs) dimension numbers of the three products, as `tokamax.ragged_dot_general` takes them
FORWARD = jax.lax.RaggedDotDimensionNumbers(((([1], [1]), ([], []))), [0], [0])  # mk,ekn->mn
DX = jax.lax.RaggedDotDimensionNumbers(((([1], [2]), ([], []))), [0], [0])  # mn,ekn->mk
DW = jax.lax.RaggedDotDimensionNumbers(((([0], [0]), ([], []))), [0], [])  # mk,mn->ekn

IMPLEMENTATIONS = {
  "cuda": ("mosaic_gpu", "triton"),
  "tpu": ("mosaic_tpu", "xla"),
  "default": ("xla",),
}
# The Triton and Mosaic custom calls carry no compatibility guarantee, so `jax.export` refuses
# to serialize them unless told (tokamax's own list); a lowering or a compile needs nothing.
EXPORT_DISABLED_CHECKS = tokamax.DISABLE_JAX_EXPORT_CHECKS


def _register_user_context() -> None:
  """tokamax's autotuning overlay is a `jax.make_user_context`, part of JAX's trace context:
  0.0.13+ registers it when imported, 0.0.12 at its first op in a thread (its private
  `get_autotuning_cache_overlay_state`), i.e. inside a trace, which left that program's jit
  cache entry stale (`registry.preload`). Registered here, when this module is loaded."""
  getattr(tokamax_op, "get_autotuning_cache_overlay_state", lambda: None)()


_register_user_context()


class _CacheMisses(logging.Filter):
  """tokamax warns "Autotuning cache miss" at each traced call, with the whole op and its
  arguments (the group sizes included). Every host traces the GPU and TPU branches of
  `platform_dependent`, so a line for another platform's op (a Triton op on a TPU default
  device, a CPU default) says nothing about the program lowered: dropped. On a device, one
  short line per op and device kind says that tokamax's heuristic config is used instead of
  a tuned one."""

  def __init__(self):
    super().__init__()
    self.seen: set[tuple[str, str]] = set()

  def filter(self, record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    if not (str(record.msg).startswith("Autotuning cache miss") and len(args) > 1):
      return True
    op, kind = type(args[0]).__name__, str(args[1])
    gpu_op = "MosaicGpu" in op or "Triton" in op
    if kind == "cpu" or gpu_op != kind.startswith("NVIDIA") or (op, kind) in self.seen:
      return False
    self.seen.add((op, kind))
    record.msg, record.args = "tokamax %s on %s: no tuned config, its heuristics", (op, kind)
    return True


logging.getLogger("absl").addFilter(_CacheMisses())


def flags_parsed() -> None:
  """tokamax reads its options through absl flags, parsing sys.argv on first use when no one
  has; under a host program with its own argv (pytest, a script) that fails, so mark the
  flags parsed with their defaults (an absl CLI has parsed them before any trace)."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def cross_compile(impls: tuple[str, ...]):
  """The context a tokamax call is traced in: its flags parsed, and its "is a GPU present"
  checks off unless `impls` is the CPU list (a GPU or TPU branch is only lowered here)."""
  flags_parsed()
  return tokamax.config.cross_compile(impls != IMPLEMENTATIONS["default"])


def _dot(lhs, rhs, counts_E, dims, impls: tuple[str, ...], out_dtype) -> jax.Array:
  """One ragged dot in tokamax, written in `out_dtype`. Every implementation accumulates in
  float32 whatever the output dtype (the Triton and Mosaic kernels' accumulators are f32;
  "xla" asks ragged_dot for f32 and casts), so a bf16 output costs no precision in the sum
  and halves the buffer an f32 output would need."""
  with cross_compile(impls):
    out = tokamax.ragged_dot_general(
      lhs,
      rhs,
      counts_E,
      dims,
      preferred_element_type=out_dtype,
      implementation=impls,
    )
  return out.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(lhs_MxK, rhs_ExKxN, counts_E, impls: tuple[str, ...]) -> jax.Array:
  """out[rows of group e] = lhs[rows of e] @ rhs[e], accumulated in float32, in lhs's dtype."""
  return _dot(lhs_MxK, rhs_ExKxN, counts_E, FORWARD, impls, lhs_MxK.dtype)


def _gmm_fwd(lhs_MxK, rhs_ExKxN, counts_E, impls):
  return gmm(lhs_MxK, rhs_ExKxN, counts_E, impls), residuals.named((lhs_MxK, rhs_ExKxN, counts_E))


def _gmm_bwd(impls, res, g_MxN):
  lhs_MxK, rhs_ExKxN, counts_E = res
  g_MxN = g_MxN.astype(lhs_MxK.dtype)
  dlhs_MxK = _dot(g_MxN, rhs_ExKxN, counts_E, DX, impls, lhs_MxK.dtype)
  drhs_ExKxN = _dot(lhs_MxK, g_MxN, counts_E, DW, impls, rhs_ExKxN.dtype)
  return dlhs_MxK, drhs_ExKxN, np.zeros(counts_E.shape, jax.dtypes.float0)


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def swiglu(x_MxD, ex: plans.ExpertWeights, counts_E, impls: tuple[str, ...]) -> jax.Array:
  """Per-group SwiGLU on rows grouped by expert (every row in a group)."""
  F = ex.w_down_ExFxD.shape[1]
  gu_Mx2F = gmm(x_MxD, ex.w_gate_up_ExDx2F, counts_E, impls)
  h_MxF = jax.nn.silu(gu_Mx2F[:, :F]) * gu_Mx2F[:, F:]
  return gmm(h_MxF, ex.w_down_ExFxD, counts_E, impls)


def _run(x_TxD, plan, counts_E, weights_TxK, ex, *, impls: tuple[str, ...]) -> jax.Array:
  K = weights_TxK.shape[1]
  x_AxD = plans.expand(x_TxD, plan, K)
  counts_E = counts_E.astype(jnp.int32)
  counts_E = counts_E.at[-1].add(x_AxD.shape[0] - counts_E.sum())  # empty rows: last group
  return plans.combine(swiglu(x_AxD, ex, counts_E, impls), plan, weights_TxK)


def run(a: plans.KernelArgs) -> jax.Array:
  """The kernel on `plans.KernelArgs`, tokamax's implementations chosen per lowering platform."""
  args = (a.x_TxD, a.plan, a.counts_E, a.weights_TxK, a.ex)
  branches = {p: functools.partial(_run, impls=i) for p, i in IMPLEMENTATIONS.items()}
  return platforms.platform_dependent(*args, **branches)
