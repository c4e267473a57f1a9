"""Decoder-only Transformer (docs/design.md §5): pre-norm blocks, dense or MoE feed-forward.

Layer i is MoE iff `is_moe_layer(cfg, i)`; MoE placement follows `moe_every` (GShard) and
`first_dense` (DeepSeek).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.backend import platforms
from moejax.errors import UserError
from moejax.kernels import registry
from moejax.nn import elastic, mixer, mixers, remat, stack
from moejax.nn.attention import ATTENTION_IMPLS
from moejax.nn.gated_deltanet import GatedDeltaNetConfig
from moejax.nn.layers import DTYPES, QK_NORM_SCOPES, DenseFFN, RMSNorm, init_normal
from moejax.nn.mla import MLAConfig
from moejax.nn.moe import EVAL_SECOND_EXPERT_SEED, MoEBlock, MoEConfig, RouterOut
from moejax.nn.norms import ZeroCentredRMSNorm
from moejax.nn.overrides import NONE as NO_OVERRIDES
from moejax.nn.overrides import Overrides
from moejax.schema import check_fields, key

NORMS = ("rms", "zero_centred")  # `model.norm`
NORM_CLASSES = {"rms": RMSNorm, "zero_centred": ZeroCentredRMSNorm}

# A run's embedding has its vocabulary rounded up to a multiple of this many rows (MaxText's
# and llm.c's convention: whole tiles for the head's matmul and the vocab axis's shards);
# the ids past the vocabulary are masked out of every score (`mask_padded_vocab`).
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and options of the Transformer; `head_dim=0` means d_model // n_heads.

  `dtype` is the compute dtype of attention, FFNs, experts and the residual stream;
  parameters, optimizer state, norms' statistics, router, softmax and losses stay float32.
  `remat` names a block rematerialization policy (`moejax.nn.remat.REMAT_POLICIES`),
  `attention` an attention implementation (`moejax.nn.attention.ATTENTION_IMPLS`)."""

  vocab_size: int = key(
    0, "vocabulary size (0: the tokenizer's); the embedding pads it to a multiple of 128 rows", ge=0
  )
  d_model: int = key(128, "residual stream width", ge=1)
  n_layers: int = key(4, "Transformer blocks", ge=1)
  n_heads: int = key(4, "query heads", ge=1)
  n_kv_heads: int = key(2, "key/value heads (GQA); must divide n_heads", ge=1)
  head_dim: int = key(0, "width of a head (0: d_model // n_heads)", ge=0)
  d_ff: int = key(512, "hidden width of the dense layers' FFN", ge=0)
  qk_norm: bool = key(False, "RMSNorm on queries and keys")
  qk_norm_scope: str = key(
    "head", "qk_norm per head (Qwen3) or over the projection (OLMoE)", QK_NORM_SCOPES
  )
  qkv_bias: bool = key(False, "biases on the q/k/v projections (Qwen2)")
  tie_embeddings: bool = key(True, "the output head is the embedding's transpose")
  rope_theta: float = key(10000.0, "RoPE base", gt=0)
  norm_eps: float = key(1e-6, "RMSNorm epsilon", gt=0)
  dtype: str = key(
    "float32", "compute dtype; parameters, optimizer, router and losses stay float32", DTYPES
  )
  init_std: float = key(0.02, "std of the normal initialization", gt=0)
  moe: MoEConfig | None = None
  mixers: str = key(
    "gqa",
    "token mixer of each layer (moejax.nn.mixers): gqa, mla, gated_attention, gated_deltanet;"
    " a comma-separated period repeats over the layers",
  )
  norm: str = key(
    "rms", "block and final norms: rms (x̂·w) or zero_centred (x̂·(1 + w), Qwen3.5)", NORMS
  )
  partial_rotary_factor: float = key(
    1.0, "gated_attention: the fraction of head_dim RoPE rotates (Qwen3.5: 0.25)", gt=0, le=1
  )
  mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
  gated_deltanet: GatedDeltaNetConfig = dataclasses.field(default_factory=GatedDeltaNetConfig)
  moe_every: int = key(
    1, "every moe_every-th layer is MoE from first_dense on (0: dense model)", ge=0
  )
  first_dense: int = key(0, "leading dense layers (DeepSeek)", ge=0)
  remat: str = key(
    "none", "rematerialization policy of a block (moejax.nn.remat)", tuple(remat.REMAT_POLICIES)
  )
  attention: str = key(
    "xla", "attention implementation (moejax.nn.attention)", tuple(ATTENTION_IMPLS)
  )
  scan_layers: bool = key(
    True,
    "the layer stack as lax.scans over stacked parameters (moejax.nn.stack): compiles that"
    " do not grow with depth, slower steps at shallow depth (model.scan_unroll;"
    " docs/performance.md)",
  )
  scan_unroll: int = key(
    -1,
    "periods of layers per trip of a layer scan; 0: no loop (each scan written out whole);"
    " -1: 0 on CPU with remat none, else 1 (docs/performance.md)",
    ge=-1,
  )
  not_modelled: str = key(
    "", "what the source architecture has that this model lacks (the worksheet prints it)"
  )
  # Not a config key: the embedding's rows are vocab_size rounded up to a multiple of this
  # (`RunConfig.with_vocab` sets VOCAB_MULTIPLE; 1, unpadded, for runs saved before it).
  vocab_multiple: int = 1

  def __post_init__(self):
    check_fields(self, "model")
    mixers.pattern(self.mixers)
    if self.head_dim == 0 and self.d_model % self.n_heads:
      raise UserError(
        f"model.n_heads={self.n_heads} must divide model.d_model="
        f"{self.d_model} (or set model.head_dim)"
      )
    if self.n_heads % self.n_kv_heads:
      raise UserError(
        f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
      )
    if self.resolved_head_dim % 2:
      raise UserError(
        f"model.head_dim={self.resolved_head_dim} is not allowed; RoPE needs an even head_dim"
      )
    if not 0 <= self.first_dense <= self.n_layers:
      raise UserError(
        f"model.first_dense={self.first_dense} is not allowed; use 0 <= "
        f"first_dense <= n_layers={self.n_layers}"
      )
    if self.moe is not None and self.moe.d_model != self.d_model:
      raise UserError(
        f"model.moe.d_model={self.moe.d_model} must equal model.d_model={self.d_model}"
      )
    if self.d_ff < 1 and not all(is_moe_layer(self, i) for i in range(self.n_layers)):
      raise UserError(f"model.d_ff={self.d_ff} is not allowed; dense layers need d_ff >= 1")

  @property
  def padded_vocab(self) -> int:
    """The embedding's (and untied head's) rows: vocab_size rounded up to vocab_multiple.
    Ids from vocab_size on are never inputs or targets, and their logits are masked."""
    return round_up_vocab(self.vocab_size, self.vocab_multiple)

  @property
  def resolved_head_dim(self) -> int:
    """head_dim, or d_model // n_heads when head_dim is 0."""
    return self.head_dim or self.d_model // self.n_heads


def round_up_vocab(vocab_size: int, multiple: int) -> int:
  """`vocab_size` rounded up to a multiple of `multiple`."""
  return -(-vocab_size // multiple) * multiple


def mask_padded_vocab(logits_BxLxV: jax.Array, vocab_size: int) -> jax.Array:
  """The logits with every id from `vocab_size` on set to the dtype's lowest finite value:
  a softmax, log-softmax or argmax over them is the one over the first `vocab_size` ids
  (exp underflows to exactly 0), and their gradient is 0. Finite, so p·log p stays 0."""
  ids_V = jnp.arange(logits_BxLxV.shape[-1])
  low = jnp.finfo(logits_BxLxV.dtype).min
  return jnp.where(ids_V < vocab_size, logits_BxLxV, low)


def padded_init(init: nnx.Initializer, n_real: int, axis: int) -> nnx.Initializer:
  """`init` drawn at `n_real` along `axis` (the shape of the unpadded array, so the real rows
  are the unpadded model's draw) and zero-padded to the full shape: padded rows start at 0,
  get no gradient (never an input; masked logits), and so stay 0 under AdamW."""

  def padded(key, shape, dtype=jnp.float32):
    real = list(shape)
    real[axis] = n_real
    widths = [(0, 0)] * len(shape)
    widths[axis] = (0, shape[axis] - n_real)
    return jnp.pad(init(key, tuple(real), dtype), widths)

  return padded


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
  """Whether layer i uses the MoE block (every `moe_every`-th layer from `first_dense` on)."""
  return (
    cfg.moe is not None
    and cfg.moe_every > 0
    and i >= cfg.first_dense
    and (i - cfg.first_dense) % cfg.moe_every == 0
  )


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); mlp dense or MoE."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.is_moe = is_moe_layer(cfg, layer)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    norm = NORM_CLASSES[cfg.norm]
    self.mixer = mixers.layer_mixer(cfg.mixers, layer)
    self.attn_norm = norm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    self.attn = mixers.MIXERS[self.mixer](cfg, out_std, rngs)
    self.mlp_norm = norm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    if self.is_moe:
      moe_cfg = dataclasses.replace(cfg.moe, dtype=cfg.dtype)  # the model's dtype wins
      self.mlp = MoEBlock(moe_cfg, rngs=rngs)
    else:
      self.mlp = DenseFFN(
        cfg.d_model, cfg.d_ff, dtype=cfg.dtype, init_std=cfg.init_std, out_std=out_std, rngs=rngs
      )

  def __call__(
    self, x_BxLxD, positions_BxL, *, train: bool = False, rng=None, ov: Overrides = NO_OVERRIDES
  ) -> tuple[jax.Array, RouterOut | None]:
    """`ov`: this layer's overrides (the per-layer rows, `Overrides.rows`); MoE blocks read them."""
    x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL)[0]
    h_BxLxD = self.mlp_norm(x_BxLxD)
    if not self.is_moe:
      return x_BxLxD + self.mlp(h_BxLxD), None
    y_BxLxD, router_out = self.mlp(h_BxLxD, train=train, rng=rng, ov=ov)
    return x_BxLxD + y_BxLxD.astype(x_BxLxD.dtype), router_out

  def decode(self, x_BxLxD, at: mixer.DecodeAt, cache, ov: Overrides, rng):
    """The block at decode (`moejax.nn.mixer`): the mixer reads and writes its cache; `ov`
    is this layer's overrides. Returns (x, cache)."""
    L = x_BxLxD.shape[1]
    h_BxLxD, cache = self.attn(self.attn_norm(x_BxLxD), at.positions_BxL(L), cache=cache, at=at)
    x_BxLxD = x_BxLxD + h_BxLxD
    h_BxLxD = self.mlp_norm(x_BxLxD)
    if not self.is_moe:
      return x_BxLxD + self.mlp(h_BxLxD), cache
    y_BxLxD, _ = self.mlp(h_BxLxD, train=False, rng=rng, ov=ov)
    return x_BxLxD + y_BxLxD.astype(x_BxLxD.dtype), cache


class Transformer(nnx.Module):
  """Decoder-only LM: embed → blocks → final RMSNorm → float32 logits (tied/untied head).

  The embedding has `cfg.padded_vocab` rows; the logits of the padded ids (from
  `cfg.vocab_size` on) are masked (`mask_padded_vocab`), so every loss, accuracy and
  log-likelihood is over the real ids, as an unpadded model with the same rows scores.

  With `scan_layers` the blocks run as one `lax.scan` per segment of identical periods
  (`moejax.nn.stack`), their parameters stacked on a leading layer axis; without, as a
  Python loop over `layers`. Both initialize the same numbers from the same seed (the
  scanned stacks are the unrolled blocks, stacked) and compute the same function.

  The head multiplies in the compute dtype and accumulates and returns float32 logits
  (MaxText's default `logits_dot_in_fp32: False` with `cast_logits_to_fp32: True`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.vocab_size < 1:  # 0: the tokenizer's, which RunConfig.with_vocab resolves first
      raise ValueError(f"ModelConfig.vocab_size={cfg.vocab_size} is unresolved; use >= 1")
    self.cfg = cfg
    V, init = cfg.padded_vocab, init_normal(cfg.init_std)
    self.embed = nnx.Embed(
      V,
      cfg.d_model,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.float32,
      embedding_init=padded_init(init, cfg.vocab_size, 0) if V > cfg.vocab_size else init,
      rngs=rngs,
    )
    blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)]
    if cfg.scan_layers:
      self.stacks = nnx.List([_stack(seg, blocks) for seg in layer_segments(cfg)])
    else:
      self.layers = nnx.List(blocks)
    self.final_norm = NORM_CLASSES[cfg.norm](cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    if cfg.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Linear(
        cfg.d_model,
        V,
        use_bias=False,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        preferred_element_type=jnp.float32,
        kernel_init=padded_init(init, cfg.vocab_size, 1) if V > cfg.vocab_size else init,
        rngs=rngs,
      )

  def __call__(
    self,
    tokens_BxL: jax.Array,
    *,
    train: bool = False,
    rng: jax.Array | None = None,
    ov: Overrides = NO_OVERRIDES,
    step: jax.Array | None = None,
  ) -> tuple[jax.Array, dict[int, RouterOut]]:
    """Float32 logits [B, L, V] and the `RouterOut` of each MoE layer, by layer index:
    `head(hidden(...))`."""
    x_BxLxD, routers = self.hidden(tokens_BxL, train=train, rng=rng, ov=ov, step=step)
    return self.head(x_BxLxD), routers

  def hidden(
    self,
    tokens_BxL: jax.Array,
    *,
    train: bool = False,
    rng: jax.Array | None = None,
    ov: Overrides = NO_OVERRIDES,
    step: jax.Array | None = None,
  ) -> tuple[jax.Array, dict[int, RouterOut]]:
    """The last block's output [B, L, D] (before the final norm) and the `RouterOut` of each
    MoE layer, by layer index; `head` maps any positions of it to logits.

    At eval without `rng`, routing randomness (GShard's random second expert) uses a fixed
    seed, so evaluations are reproducible. `ov` (`moejax.nn.overrides`, model level): the
    grid's cell at eval, a traced `routed_scale` [M] so one compiled forward serves every
    value. `step` (training): the optimizer step, for elastic-k's `schedule`; elastic-k
    draws come from `rng` (`moejax.nn.elastic`) and fill `ov.train_k`."""
    B, L = tokens_BxL.shape
    positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    x_BxLxD = self.embed(tokens_BxL)
    if rng is None and not train:
      rng = jax.random.key(EVAL_SECOND_EXPERT_SEED)
    k_MxBxL = self._train_k(train, rng, step, B, L)
    if k_MxBxL is not None:
      ov = dataclasses.replace(ov, train_k=k_MxBxL)
    run = self._scanned if self.cfg.scan_layers else self._unrolled
    return run(x_BxLxD, positions_BxL, train, rng, ov)

  def init_cache(self, batch: int, max_len: int):
    """Every mixer's decode state for `batch` rows of `max_len` slots (`moejax.nn.mixer`):
    a tuple by layer, or, scanned, by segment and body position, stacked over repeats."""
    dt = jnp.dtype(self.cfg.dtype)
    if not self.cfg.scan_layers:
      return tuple(b.attn.init_cache(batch, max_len, dt) for b in self.layers)
    out = []
    for seg, stacked in zip(layer_segments(self.cfg), self.stacks):
      one = lambda b: b.attn.init_cache(batch, max_len, dt)
      out.append(tuple(
        jax.tree.map(lambda a, R=seg.repeats: jnp.broadcast_to(a, (R, *a.shape)), one(b))
        for b in stacked.blocks
      ))  # fmt: skip
    return tuple(out)

  def decode(self, tokens_BxL, cache, at: mixer.DecodeAt, ov: Overrides = NO_OVERRIDES):
    """Float32 logits [B, L, V] of L new tokens written at `at` (prefill or a step), and the
    updated cache (`init_cache`). Eval routing at the cell `ov` (k, k2, routed scale), as the
    scoring forward routes; the model should be built with `decode_config` (dropless)."""
    x_BxLxD = self.embed(tokens_BxL)
    rng = jax.random.key(EVAL_SECOND_EXPERT_SEED)
    index = moe_indices(self.cfg)
    if not self.cfg.scan_layers:
      new = []
      for i, (block, c) in enumerate(zip(self.layers, cache)):
        rows = ov.rows(index[i]) if block.is_moe else (None, None)
        lov = ov.with_per_layer(*rows)
        x_BxLxD, c = block.decode(x_BxLxD, at, c, lov, jax.random.fold_in(rng, i))
        new.append(c)
      return self.head(x_BxLxD), tuple(new)
    new = []
    for seg, stacked, c in zip(layer_segments(self.cfg), self.stacks, cache):
      x_BxLxD, c = decode_segment(seg, stacked, x_BxLxD, c, at, ov, index, rng)
      new.append(c)
    return self.head(x_BxLxD), tuple(new)

  def head(self, x_BxLxD):
    """Final norm and the (tied or untied) head: float32 logits, padded ids masked. Per
    position, so it may be given any positions of `hidden`'s output ([B, C, D])."""
    cdt = jnp.dtype(self.cfg.dtype)
    h_BxLxD = self.final_norm(x_BxLxD).astype(cdt)
    if self.lm_head is None:
      emb_VxD = self.embed.embedding[...].astype(cdt)
      logits_BxLxV = jnp.einsum("bld,vd->blv", h_BxLxD, emb_VxD, preferred_element_type=jnp.float32)
    else:
      logits_BxLxV = self.lm_head(h_BxLxD)
    if self.cfg.padded_vocab > self.cfg.vocab_size:
      logits_BxLxV = mask_padded_vocab(logits_BxLxV, self.cfg.vocab_size)
    return logits_BxLxV

  def _unrolled(self, x_BxLxD, positions_BxL, train, rng, ov):
    """The blocks as a Python loop: layer i's rng is `fold_in(rng, i)`."""
    call = remat.block_call(self.cfg.remat, train=train)
    moe_index, routers = moe_indices(self.cfg), {}
    for i, block in enumerate(self.layers):
      layer_rng = None if rng is None else jax.random.fold_in(rng, i)
      per_layer = ov.rows(moe_index[i]) if block.is_moe else (None, None)
      x_BxLxD, out = call(block, x_BxLxD, positions_BxL, layer_rng, ov, per_layer)
      if out is not None:
        routers[i] = out
    return x_BxLxD, routers

  def _scanned(self, x_BxLxD, positions_BxL, train, rng, ov):
    """Each segment as one scan over its periods (`run_segment`), `scan_unroll` periods a
    trip. A segment whose scan loops remats its blocks as a scanned body
    (`remat.block_call(scanned=True)`); one unrolled whole keeps no stacked residuals
    across a loop, and remats as the unrolled stack does."""
    moe_index, routers = moe_indices(self.cfg), {}
    for seg, stacked in zip(layer_segments(self.cfg), self.stacks):
      unroll = scan_unroll(self.cfg, seg)
      call = remat.block_call(self.cfg.remat, train=train, scanned=unroll < seg.repeats)
      x_BxLxD, outs = run_segment(
        seg, stacked, call, x_BxLxD, positions_BxL, rng, ov, moe_index, unroll
      )
      routers.update(outs)
    return x_BxLxD, dict(sorted(routers.items()))

  def _train_k(self, train: bool, rng, step, B: int, L: int) -> jax.Array | None:
    """Elastic-k: experts used per MoE layer and token in this training forward."""
    moe = self.cfg.moe
    if not (train and moe is not None and moe.elastic.active):
      return None
    n_moe = len(moe_layers(self.cfg))
    k_MxT = elastic.draw(moe.elastic, moe.top_k, rng, step, n_moe, B * L)
    return k_MxT.reshape(n_moe, B, L)


# The named scope of the layer scans: their while loops' op_name holds it.
LAYER_SCAN_SCOPE = "scan_layers"


def moe_layers(cfg: ModelConfig) -> list[int]:
  """Indices of the MoE layers, in order."""
  return [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]


def moe_indices(cfg: ModelConfig) -> dict[int, int]:
  """Layer index -> its row m among the MoE layers (`Overrides` rows, losses' stacks)."""
  return {i: m for m, i in enumerate(moe_layers(cfg))}


def layer_segments(cfg: ModelConfig) -> tuple[stack.Segment, ...]:
  """The scanned layout's segments of `cfg` (`moejax.nn.stack`)."""
  is_moe = tuple(is_moe_layer(cfg, i) for i in range(cfg.n_layers))
  period = len(mixers.pattern(cfg.mixers))
  return stack.segments(cfg.n_layers, is_moe, cfg.first_dense, cfg.moe_every, period)


class Stack(nnx.Module):
  """One segment's blocks: `blocks[j]` is body position j, its parameters stacked over the
  segment's repeats on a leading axis."""

  def __init__(self, blocks: list[Block]):
    self.blocks = nnx.List(blocks)


def _stack(seg: stack.Segment, blocks: list[Block]) -> Stack:
  """The segment's unrolled `blocks` (by layer index) as a `Stack`: each position's blocks'
  states stacked into one block of the same graph."""
  stacked = []
  for j in range(seg.period):
    graphdef, *_ = nnx.split(blocks[seg.layer(0, j)])
    states = [nnx.split(blocks[seg.layer(r, j)])[1] for r in range(seg.repeats)]
    stacked.append(nnx.merge(graphdef, jax.tree.map(lambda *a: jnp.stack(a), *states)))
  return Stack(stacked)


def auto_unroll(remat_policy: str, platform: str) -> int:
  """`model.scan_unroll=-1`'s value: 0 (no loop) for a CPU program without remat, else 1.
  XLA:CPU's while loop slows the step and saves no compile time at shallow depth; on TPU and
  GPU the loop keeps the compile from growing with depth; with a remat policy the loop keeps
  what remat frees, which the stack written out whole mostly does not (the figures:
  benchmarks/results/scan_layers.json, docs/performance.md)."""
  return 0 if platform == "cpu" and remat_policy == "none" else 1


def scan_unroll(cfg: ModelConfig, seg: stack.Segment) -> int:
  """The `unroll` of segment `seg`'s scan: `model.scan_unroll` periods a trip, all of them
  for 0, `auto_unroll`'s for -1 on the platform lowered for. From `seg.repeats` on there
  is no loop (jax unrolls such a scan whole)."""
  unroll = cfg.scan_unroll
  if unroll < 0:
    unroll = auto_unroll(cfg.remat, platforms.lowering_platform())
  return seg.repeats if unroll == 0 else min(unroll, seg.repeats)


def segment_inputs(seg, stacked: Stack, ov, moe_index):
  """What a segment's scan takes, for the forward and for decode: each position's graph and
  stacked state, the layer indices by position and repeat (and transposed, to scan), and
  each position's MoE override rows."""
  graphdefs, states = zip(*(nnx.split(b) for b in stacked.blocks))
  layers_PxR = [[seg.layer(r, j) for r in range(seg.repeats)] for j in range(seg.period)]
  layers_RxP = jnp.asarray(layers_PxR, jnp.int32).T
  rows = tuple(
    ov.rows([moe_index[i] for i in ids]) if seg.moe[j] else (None, None)
    for j, ids in enumerate(layers_PxR)
  )
  return graphdefs, states, layers_PxR, layers_RxP, rows


def run_segment(seg, stacked: Stack, call, x_BxLxD, positions_BxL, rng, ov, moe_index, unroll):
  """x through `seg.repeats` periods as one `lax.scan`, `unroll` periods a trip; the
  scanned inputs are each position's parameter rows, its layer indices (layer rngs) and its
  MoE layers' override rows. Returns x and the MoE layers' `RouterOut`s by layer index."""
  graphdefs, states, layers_PxR, layers_RxP, rows = segment_inputs(seg, stacked, ov, moe_index)
  R = seg.repeats

  def body(x_BxLxD, xs):
    states_P, layer_P, rows_P = xs
    outs = []
    for j, graphdef in enumerate(graphdefs):
      layer_rng = None if rng is None else jax.random.fold_in(rng, layer_P[j])
      block = nnx.merge(graphdef, states_P[j])
      x_BxLxD, out = call(block, x_BxLxD, positions_BxL, layer_rng, ov, rows_P[j])
      outs.append(out)
    return x_BxLxD, tuple(outs)

  xs = (tuple(states), layers_RxP, rows)
  with jax.named_scope(LAYER_SCAN_SCOPE):  # how the loop report (aot.loops) names these loops
    x_BxLxD, outs_P = jax.lax.scan(body, x_BxLxD, xs, length=R, unroll=unroll)
  routers = {}
  for j, out in enumerate(outs_P):
    for r in range(R) if out is not None else ():
      routers[layers_PxR[j][r]] = jax.tree.map(lambda a, r=r: a[r], out)
  return x_BxLxD, routers


def decode_segment(seg, stacked: Stack, x_BxLxD, cache_P, at, ov, moe_index, rng):
  """A segment at decode: one `lax.scan` over its repeats, each position's parameters and
  cache rows scanned together; returns x and the segment's updated caches."""
  graphdefs, states, layers_PxR, layers_RxP, rows = segment_inputs(seg, stacked, ov, moe_index)
  R = seg.repeats

  def body(x_BxLxD, xs):
    states_P, caches_P, layer_P, rows_P = xs
    new = []
    for j, graphdef in enumerate(graphdefs):
      block = nnx.merge(graphdef, states_P[j])
      lov = ov.with_per_layer(*rows_P[j])
      layer_rng = jax.random.fold_in(rng, layer_P[j])
      x_BxLxD, c = block.decode(x_BxLxD, at, caches_P[j], lov, layer_rng)
      new.append(c)
    return x_BxLxD, tuple(new)

  xs = (tuple(states), tuple(cache_P), layers_RxP, rows)
  with jax.named_scope(LAYER_SCAN_SCOPE):
    return jax.lax.scan(body, x_BxLxD, xs, length=R)


def preload_kernels(graphdef, params, router) -> None:
  """Every platform's MoE kernel libraries imported now, before a meshless program (the grid's
  forwards, the task scorer, decode) traces every `platform_dependent` branch; a model built
  under the trainer's mesh preloaded only its platform's (`registry.preload`)."""
  moe = nnx.merge(graphdef, params, router).cfg.moe
  if moe is not None:
    registry.preload(moe.impl, moe.dispatch)


def decode_config(cfg: ModelConfig) -> ModelConfig:
  """The model config a decode runs (the one place decode's routing is decided): dropless
  dispatch whatever the run trained with, since a generated token must not depend on what
  else is in the step's batch, and with GShard's random second expert always sent
  (`eval_second_expert="all"`), since the scoring forward's fixed-seed draw depends on a
  token's index in its call. Everything else (rule, k1, k2, scale) routes as the scoring
  forward does. A capacity-only kernel becomes `auto`."""
  if cfg.moe is None:
    return cfg
  modes = ("dropless",) if cfg.moe.impl == "auto" else registry.KERNELS[cfg.moe.impl].modes
  impl = cfg.moe.impl if "dropless" in modes else "auto"
  moe = dataclasses.replace(cfg.moe, dispatch="dropless", eval_second_expert="all", impl=impl)
  return dataclasses.replace(cfg, moe=moe)


def router_biases(model: Transformer) -> list[tuple[nnx.Variable, list[int]]]:
  """Each MoE router's selection-bias variable with the MoE layer rows m it holds: one row
  [E] unrolled; a segment position's repeats, stacked [R, E], when scanned."""
  cfg, index = model.cfg, moe_indices(model.cfg)
  if not cfg.scan_layers:
    return [(b.mlp.router.bias, [index[i]]) for i, b in enumerate(model.layers) if b.is_moe]
  out = []
  for seg, stacked in zip(layer_segments(cfg), model.stacks):
    for j, block in enumerate(stacked.blocks):
      if seg.moe[j]:
        out.append((block.mlp.router.bias, [index[seg.layer(r, j)] for r in range(seg.repeats)]))
  return out


def moe_biases(model: Transformer) -> jax.Array:
  """Every MoE layer's selection bias, [M, E] in layer order."""
  rows = {}
  for bias, ms in router_biases(model):
    b_RxE = bias[...].reshape(len(ms), -1)
    rows.update({m: b_RxE[r] for r, m in enumerate(ms)})
  return jnp.stack([rows[m] for m in sorted(rows)])


def set_moe_biases(model: Transformer, fn) -> None:
  """bias rows ← `fn(bias_RxE, rows)` in every MoE router (rows: their MoE layer indices)."""
  for bias, ms in router_biases(model):
    b = bias[...]
    bias[...] = fn(b.reshape(len(ms), -1), ms).reshape(b.shape)
