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
* `tokamax`: `tokamax.dot_product_attention` (openxla/tokamax), flash attention that keeps
  only the softmax statistics for the backward pass: for the platform lowered for, on CUDA
  its Mosaic GPU kernel (sm90/sm100, bf16) else its Triton kernel (sm80 and up, or f32), on
  TPU its Mosaic TPU kernel from a TPU host, elsewhere (and for a TPU lowered from another
  host) its "xla" reference, which does hold L×L (what the CPU tests check): the same
  per-platform lists as `moejax.kernels.tokamax_ragged.IMPLEMENTATIONS`.
  Per device in a `shard_map` over the batch axes under a context mesh, as splash.

The Pallas splash kernel and tokamax are imported when a program using them is traced
(`import moejax.nn.model` imports neither); without tokamax (the `cuda` extra),
`model.attention='tokamax'` is one UserError line.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax import sharding
from moejax.backend import platforms
from moejax.errors import UserError
from moejax.kernels import registry

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


def masked_attention(
  q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, mask_BxLxS: jax.Array
) -> jax.Array:
  """Softmax attention of L queries over S keys under an explicit mask (decode over a
  cache: `mixer.DecodeAt.mask_BxLxS`); float32 scores and softmax, GQA as `xla_attention`.
  The values' width may differ from the keys'."""
  B, L, H, K = q_BxLxHxK.shape
  G = k_BxSxGxK.shape[2]
  q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
  s_BxGxRxLxS = jnp.einsum(
    "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32
  ) * (K**-0.5)
  s_BxGxRxLxS = jnp.where(mask_BxLxS[:, None, None], s_BxGxRxLxS, jnp.finfo(jnp.float32).min)
  p_BxGxRxLxS = jax.nn.softmax(s_BxGxRxLxS, axis=-1).astype(v_BxSxGxK.dtype)
  o_BxLxGxRxV = jnp.einsum("bgrls,bsgv->blgrv", p_BxGxRxLxS, v_BxSxGxK)
  return o_BxLxGxRxV.reshape(B, L, H, v_BxSxGxK.shape[-1])


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
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

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

  return platforms.platform_dependent(
    q_BxHxLxK, k_BxGxLxK, v_BxGxLxK, tpu=run(False), default=run(True)
  )


def _per_device(fn, batch: int):
  """`fn(q, k, v)` per device in a shard_map over the batch axes of the context mesh (a
  Pallas kernel is opaque to GSPMD); `fn` itself when there is no mesh or no batch axis."""
  axes = sharding.batch_axes(batch)
  if not axes:
    return fn
  spec = jax.sharding.PartitionSpec(axes)
  return jax.shard_map(fn, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)


def splash_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
  """Causal GQA through the splash kernel (q pre-scaled by K^-1/2: the kernel does not
  scale). A Pallas call is opaque to GSPMD, so under a context mesh (`jax.set_mesh`) it
  runs per device in a `shard_map` over the batch axes; without one it sees the whole
  batch."""
  B, L, _, K = q_BxLxHxK.shape
  splash_block(L)
  q = jnp.swapaxes(q_BxLxHxK * jnp.asarray(K**-0.5, q_BxLxHxK.dtype), 1, 2)
  k, v = jnp.swapaxes(k_BxLxGxK, 1, 2), jnp.swapaxes(v_BxLxGxK, 1, 2)
  return jnp.swapaxes(_per_device(_splash_local, B)(q, k, v), 1, 2).astype(q_BxLxHxK.dtype)


def _tokamax_kernels():
  """moejax's tokamax module (`kernels.tokamax_ragged`: the implementation lists, the GPU
  checks), imported now; a UserError line without tokamax."""
  if (reason := registry.module_missing("tokamax")) is not None:
    raise UserError(f"model.attention='tokamax' cannot run here: {reason}; use 'xla' or 'splash'")
  from moejax.kernels import tokamax_ragged

  return tokamax_ragged


def _tokamax_call(q, k, v, impls):
  import tokamax

  return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation=impls)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tokamax_attend(q, k, v, impls: tuple[str, ...]):
  """tokamax's attention and its own VJP, each traced with its GPU checks off (a backward
  pass is traced after the forward's context has closed)."""
  with _tokamax_kernels().cross_compile(impls):
    return _tokamax_call(q, k, v, impls)


def _tokamax_fwd(q, k, v, impls):
  with _tokamax_kernels().cross_compile(impls):
    return jax.vjp(functools.partial(_tokamax_call, impls=impls), q, k, v)


def _tokamax_bwd(impls, vjp, do):
  with _tokamax_kernels().cross_compile(impls):
    return vjp(do)


_tokamax_attend.defvjp(_tokamax_fwd, _tokamax_bwd)


def _tokamax_local(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
  """tokamax flash attention on one device's batch, its implementations per lowering platform
  (`tokamax_ragged.IMPLEMENTATIONS`: the same lists, the same GPU checks turned off)."""
  branches = {
    p: functools.partial(_tokamax_attend, impls=i)
    for p, i in _tokamax_kernels().IMPLEMENTATIONS.items()
  }
  return platforms.platform_dependent(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, **branches)


def tokamax_attention(
  q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array
) -> jax.Array:
  """Causal GQA through tokamax's flash attention (it groups the kv heads itself, as HF's
  `repeat_kv`), per device in a shard_map under a context mesh."""
  fn = _per_device(_tokamax_local, q_BxLxHxK.shape[0])
  return fn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK).astype(q_BxLxHxK.dtype)


ATTENTION_IMPLS = {
  "xla": xla_attention,
  "dot_product": dot_product_attention,
  "splash": splash_attention,
  "tokamax": tokamax_attention,
}
