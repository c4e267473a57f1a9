"""Causal grouped-query attention, one function per implementation (`model.attention`).

Every implementation takes q [B, L, H, K] and k, v [B, L, G, K] (G kv heads, each shared
by H/G consecutive query heads, HF `repeat_kv`) and returns o [B, L, H, K]; scores and
softmax are float32 whatever the input dtype, and the output has the inputs' dtype.

* `xla`: einsum, mask, softmax, einsum. Autodiff keeps the [B, H, L, L] probabilities for
  the backward pass.
* `dot_product`: `jax.nn.dot_product_attention(implementation=None)`. In jax 0.10.2 `None`
  is the XLA lowering on every backend (jax/_src/nn/functions.py: "defaults to XLA for
  now"); its cuDNN flash kernel is `implementation="cudnn"`, which checks for cuDNN when
  traced, so it cannot be traced or exported on a machine without a GPU.
* `splash`: the splash-attention Pallas TPU kernel that ships with jax
  (`jax.experimental.pallas.ops.tpu.splash_attention`, as MaxText's `attention=flash` on
  TPU): a flash-attention forward and backward that keep only the softmax statistics.
  Lowered for TPU it is a Mosaic kernel; on any other platform it runs in Pallas
  interpret mode (`jax.lax.platform_dependent`), which is what the CPU tests check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from moejax import sharding
from moejax.errors import UserError

# Splash tiles: MaxText's `sa_block_*` default (512), or the largest smaller one that divides
# the sequence; the kernel needs multiples of 128 (the TPU lane width).
SPLASH_BLOCKS = (512, 256, 128)


def xla_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
  """Causal softmax attention as einsums; query head h reads kv head h // (H/G)."""
  B, L, H, K = q_BxLxHxK.shape
  G = k_BxLxGxK.shape[2]
  q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
  s_BxGxRxLxS = jnp.einsum(
    "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxLxGxK, preferred_element_type=jnp.float32
  ) * (K**-0.5)
  causal_LxS = jnp.tril(jnp.ones((L, L), dtype=bool))
  s_BxGxRxLxS = jnp.where(causal_LxS, s_BxGxRxLxS, jnp.finfo(jnp.float32).min)
  p_BxGxRxLxS = jax.nn.softmax(s_BxGxRxLxS, axis=-1).astype(v_BxLxGxK.dtype)
  o_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", p_BxGxRxLxS, v_BxLxGxK)
  return o_BxLxGxRxK.reshape(B, L, H, K)


def dot_product_attention(
  q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array
) -> jax.Array:
  """`jax.nn.dot_product_attention`, causal, GQA by its own head grouping (the same)."""
  return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True)


def splash_block(seq_len: int) -> int:
  """The splash tile for a sequence length (a UserError when none divides it)."""
  for block in SPLASH_BLOCKS:
    if seq_len % block == 0:
      return block
  raise UserError(
    f"model.attention='splash' needs the sequence length (data.seq_len) to be a multiple "
    f"of 128; got {seq_len}"
  )


def _splash_kernel(n_heads: int, seq_len: int, interpret: bool):
  """A causal splash kernel for (heads, length), built at each trace: its mask tables are
  arrays of that trace (a cached kernel would leak them into the next)."""
  b = splash_block(seq_len)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((seq_len, seq_len))] * n_heads)
  sizes = splash.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=b,
    block_kv_dq=b,
  )
  return splash.make_splash_mha(
    mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
  )


def _splash_local(q_BxHxLxK, k_BxGxLxK, v_BxGxLxK):
  """Splash over one device's batch: the kernel is per sequence, vmapped over B."""
  _, H, L, _ = q_BxHxLxK.shape

  def run(interpret: bool):
    return jax.vmap(_splash_kernel(H, L, interpret))

  return jax.lax.platform_dependent(
    q_BxHxLxK, k_BxGxLxK, v_BxGxLxK, tpu=run(False), default=run(True)
  )


def splash_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
  """Causal GQA through the splash kernel (q pre-scaled by K^-1/2: the kernel does not
  scale). A Pallas call is opaque to GSPMD, so under a context mesh (`jax.set_mesh`) it
  runs per device in a `shard_map` over the batch axes; without one it sees the whole
  batch."""
  B, L, _, K = q_BxLxHxK.shape
  splash_block(L)
  q = jnp.swapaxes(q_BxLxHxK * jnp.asarray(K**-0.5, q_BxLxHxK.dtype), 1, 2)
  k, v = jnp.swapaxes(k_BxLxGxK, 1, 2), jnp.swapaxes(v_BxLxGxK, 1, 2)
  axes = sharding.batch_axes(B)
  fn = _splash_local
  if axes:
    spec = jax.sharding.PartitionSpec(axes)
    fn = jax.shard_map(fn, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
  return jnp.swapaxes(fn(q, k, v), 1, 2).astype(q_BxLxHxK.dtype)


ATTENTION_IMPLS = {
  "xla": xla_attention,
  "dot_product": dot_product_attention,
  "splash": splash_attention,
}
