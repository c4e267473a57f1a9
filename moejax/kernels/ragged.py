"""The `ragged` kernel: `jax.lax.ragged_dot` over rows sorted by expert (no padding).

A native instruction on TPU. On CPU it densifies (about 17x a dense matmul of equal FLOPs,
measured), and on NVIDIA GPUs XLA's `RaggedDotRewriter` (openxla/xla
`xla/hlo/transforms/expanders/ragged_dot_rewriter.cc`) rewrites it into a dense dot over
all E groups with the LHS broadcast and masked, so FLOPs and temporaries grow with E,
unless an opt-in cuDNN (`--xla_gpu_experimental_use_ragged_dot_fusion`) or Triton path is
enabled. So `auto` never picks it off TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import plans


def run(a: plans.KernelArgs) -> jax.Array:
  K = a.weights_TxK.shape[1]
  counts_E = a.counts_E.astype(jnp.int32)
  x_AxD = plans.expand(a.x_TxD, a.plan, K)

  def dot(lhs, w):
    return jax.lax.ragged_dot(lhs, w, counts_E, preferred_element_type=jnp.float32).astype(
      lhs.dtype
    )

  F = a.ex.w_down_ExFxD.shape[1]
  gu_Ax2F = dot(x_AxD, a.ex.w_gate_up_ExDx2F)
  h_AxF = jax.nn.silu(gu_Ax2F[:, :F]) * gu_Ax2F[:, F:]
  return plans.combine(dot(h_AxF, a.ex.w_down_ExFxD), a.plan, a.weights_TxK)
