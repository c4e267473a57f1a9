"""The tensor-name map of the hybrid families (Qwen3.5/3.6-MoE, Qwen3-Next) and their layouts.

Layer i's mixer (`model.mixers`) decides its attention tensors:

| moejax (`layers.{i}.attn.`) | Qwen3.5 (`model.layers.{i}.linear_attn.`) | Qwen3-Next |
|---|---|---|
| `in_proj_qkv.kernel [D, 2·Hk·dk + Hv·dv]` | `in_proj_qkv.weight` (transposed) | rows of `in_proj_qkvz.weight` |
| `in_proj_z.kernel [D, Hv·dv]` | `in_proj_z.weight` | rows of `in_proj_qkvz.weight` |
| `in_proj_b.kernel`, `in_proj_a.kernel [D, Hv]` | `in_proj_b.weight`, `in_proj_a.weight` | rows of `in_proj_ba.weight` |
| `conv_kernel [W, C]` | `conv1d.weight [C, 1, W]` (`[:, 0, :]ᵀ`) | same |
| `A_log`, `dt_bias`, `norm_weight`, `out_proj.kernel` | `A_log`, `dt_bias`, `norm.weight`, `out_proj.weight` | same |

Qwen3-Next groups its projections per key head (`in_proj_qkvz` rows [q_g|k_g|v_g|z_g] per
key head g, `in_proj_ba` rows [b_g|a_g]): each of its two tensors is read as sets of rows
(`Rows`), the row indices being `moejax.nn.gated_deltanet.split_qwen3_next` applied to the
row numbers, and written back whole by `assemble`. Gated attention layers
(`model.layers.{i}.self_attn.`) map q/k/v/o_proj (transposed) and q/k_norm.weight as is. The
block and final norms are zero-centred: their `weight` is moejax's `weight`.

A `Layout` is where the text model's tensors sit in the checkpoint: `model.*` (the causal LM
classes), or `model.language_model.*` in the published vision-language wrapper
(`Qwen3_5MoeForConditionalGeneration`), whose `model.visual.*` and multi-token-prediction
`mtp.*` tensors moejax does not model (import skips them, export carries them over).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from moejax.hf import tensors
from moejax.hf.families import Family
from moejax.hf.shard import Shard
from moejax.hf.tensors import Spec
from moejax.nn import mixers, stack
from moejax.nn.gated_deltanet import split_qwen3_next
from moejax.nn.model import ModelConfig, is_moe_layer, layer_segments

Path = tuple


class Layout(NamedTuple):
  """Where the text model's tensors are: `prefix` replaces `model.` of the causal LM's names
  (`lm_head.weight` stays at the top); tensors under `skipped` are not the text model's."""

  prefix: str = "model."
  skipped: tuple[str, ...] = ()

  def disk(self, name: str) -> str:
    """The checkpoint's name of the causal LM's tensor `name`."""
    return self.prefix + name[len("model.") :] if name.startswith("model.") else name

  def canonical(self, disk: str) -> str | None:
    """The causal LM's name of a checkpoint tensor; None for a skipped one."""
    if disk.startswith(self.skipped):
      return None
    return "model." + disk[len(self.prefix) :] if disk.startswith(self.prefix) else disk


PLAIN = Layout()  # the other families: every tensor is the model's
TEXT = Layout(skipped=("mtp.",))  # Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
WRAPPER = Layout("model.language_model.", ("model.visual.", "mtp."))


class Rows(NamedTuple):
  """Rows `rows` of an HF [out, in] tensor (in this order) as the moejax array `spec` says."""

  spec: Spec
  rows: np.ndarray

  @property
  def hf(self) -> str:
    return self.spec.hf

  def view(self, arrays: dict[Path, np.ndarray]) -> np.ndarray:
    return self.spec.view(arrays)

  def where(self) -> str:
    return self.spec.where()

  def moejax_shape(self, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    return self.spec.moejax_shape((len(self.rows), *hf_shape[1:]))

  def to_moejax(self, hf_array: np.ndarray) -> np.ndarray:
    return self.spec.to_moejax(hf_array[self.rows])

  def to_hf(self, params: dict[Path, np.ndarray]) -> np.ndarray:
    return self.spec.to_hf(params)


class Conv(NamedTuple):
  """An HF depthwise conv weight [C, 1, W] as moejax's `conv_kernel [W, C]`."""

  spec: Spec

  @property
  def hf(self) -> str:
    return self.spec.hf

  def view(self, arrays: dict[Path, np.ndarray]) -> np.ndarray:
    return self.spec.view(arrays)

  def where(self) -> str:
    return self.spec.where()

  def moejax_shape(self, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (hf_shape[-1], hf_shape[0]) if len(hf_shape) == 3 else tuple(hf_shape)

  def to_moejax(self, hf_array: np.ndarray) -> np.ndarray:
    return hf_array[:, 0, :].T

  def to_hf(self, params: dict[Path, np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(self.spec.view(params).T[:, None, :])


def _gated_deltanet(mc: ModelConfig, fam: Family, i: int) -> list:
  p, q = f"model.layers.{i}.linear_attn.", ("layers", i, "attn")

  def linear(hf: str, name: str) -> Spec:
    return Spec(f"{p}{hf}.weight", (*q, name, "kernel"), None, True)

  out: list = [Conv(Spec(f"{p}conv1d.weight", (*q, "conv_kernel")))]
  if fam.name == "qwen3_next":
    g = mc.gated_deltanet
    n_qkvz, n_ba = 2 * g.key_dim + 2 * g.value_dim, 2 * g.linear_num_value_heads
    rows = split_qwen3_next(np.arange(n_qkvz), np.arange(n_ba), g)
    out += [Rows(linear("in_proj_qkvz", n), rows[n]) for n in ("in_proj_qkv", "in_proj_z")]
    out += [Rows(linear("in_proj_ba", n), rows[n]) for n in ("in_proj_b", "in_proj_a")]
  else:
    out += [linear(n, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
  out += [Spec(f"{p}{n}", (*q, n)) for n in ("A_log", "dt_bias")]
  out += [Spec(f"{p}norm.weight", (*q, "norm_weight")), linear("out_proj", "out_proj")]
  return out


def _gated_attention(i: int) -> list[Spec]:
  p, q = f"model.layers.{i}.self_attn.", ("layers", i, "attn")
  out = [Spec(f"{p}{n}_proj.weight", (*q, f"{n}_proj", "kernel"), None, True) for n in "qkvo"]
  return out + [Spec(f"{p}{n}_norm.weight", (*q, f"{n}_norm", "weight")) for n in "qk"]


def specs(mc: ModelConfig, fam: Family, fused_layers: frozenset[int] = frozenset()) -> list:
  """Every tensor of a hybrid family's causal LM (`model.*` names), in HF order, mapped onto
  moejax's parameters (`tensors.specs`'s conventions: rows of the stacks when scanned)."""
  out: list = [Spec("model.embed_tokens.weight", ("embed", "embedding"), rows=tensors._rows(mc))]
  for i in range(mc.n_layers):
    p, q = f"model.layers.{i}.", ("layers", i)
    out.append(Spec(f"{p}input_layernorm.weight", (*q, "attn_norm", "weight")))
    if mixers.layer_mixer(mc.mixers, i) == "gated_deltanet":
      out += _gated_deltanet(mc, fam, i)
    else:
      out += _gated_attention(i)
    out.append(Spec(f"{p}post_attention_layernorm.weight", (*q, "mlp_norm", "weight")))
    if is_moe_layer(mc, i):
      out += tensors._moe(mc, fam, i, i in fused_layers)
    else:
      out += tensors._ffn(f"{p}mlp.", (*q, "mlp"), ("gate_proj", "up_proj", "down_proj"), mc.d_ff)
  out.append(Spec("model.norm.weight", ("final_norm", "weight")))
  if not mc.tie_embeddings:
    cols = (0, mc.vocab_size) if mc.padded_vocab > mc.vocab_size else None
    out.append(Spec("lm_head.weight", ("lm_head", "kernel"), None, True, cols=cols))
  if not mc.scan_layers:
    return out
  segs = layer_segments(mc)
  heads = {i: stack.scanned_path(("layers", i), segs) for i in range(mc.n_layers)}
  return [_scanned(s, heads) for s in out]


def _scanned(item, heads):
  if isinstance(item, Spec):
    return tensors._scanned(item, heads)
  return item._replace(spec=tensors._scanned(item.spec, heads))


def assemble(items: list, params: dict[Path, np.ndarray], layout: Layout) -> list:
  """(checkpoint name, HF tensor) of every tensor, in order: a tensor read as several `Rows`
  is put back together from them."""
  n_rows: dict[str, int] = {}
  for item in items:
    if isinstance(item, Rows):
      n_rows[item.hf] = n_rows.get(item.hf, 0) + len(item.rows)
  out: dict[str, np.ndarray] = {}
  for item in items:
    piece = item.to_hf(params)
    if isinstance(item, Rows):
      shape = (n_rows[item.hf], *piece.shape[1:])
      out.setdefault(layout.disk(item.hf), np.zeros(shape, piece.dtype))[item.rows] = piece
    else:
      out[layout.disk(item.hf)] = piece
  return list(out.items())


def carried(src: str, layout: Layout) -> list[tuple[str, np.ndarray]]:
  """The tensors moejax does not model (`layout.skipped`: the wrapper's vision tower, the
  multi-token-prediction head), read from the imported checkpoint `src` as they are."""
  out = []
  for name in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
    with Shard(os.path.join(src, name)) as shard:
      out += [(n, shard.read(n)) for n in shard.entries if layout.canonical(n) is None]
  return out
