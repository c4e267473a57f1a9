"""The tensor-name map between an HF MoE state dict and moejax's parameter tree.

HF `nn.Linear` weights are [out, in]; moejax kernels are [in, out], so most tensors are
transposed. moejax holds a SwiGLU's gate and up as one array `w_gate_up [..., d_model, 2F]`
(gate in columns [0, F), up in [F, 2F)); each HF `gate_proj` / `up_proj` tensor is one half
of it (`Spec.cols`), so gate and up are split or joined here, at the boundary, and nowhere
else. Routed experts are one HF tensor per expert (`experts.{e}.gate_proj.weight`) and one
stacked moejax array (`experts.w_gate_up [E, d_model, 2·d_expert]`); transformers 5's fused
in-memory layout (`experts.gate_up_proj [E, 2F, D]`, `experts.down_proj [E, D, F]`) is read
too, `gate_up_proj` as the whole of `w_gate_up`.

With `model.scan_layers` a layer's arrays are rows of its segment's stacks
(`moejax.nn.stack`): a `Spec` names the stacked array and the layer's row in it, so import
fills the row in place and export reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from moejax.hf.families import Family
from moejax.nn import stack
from moejax.nn.model import ModelConfig, is_moe_layer, layer_segments

Path = tuple  # a moejax parameter path, e.g. ("layers", 0, "attn", "q_proj", "kernel")


class Spec(NamedTuple):
  """One HF tensor ↔ one moejax array, or a layer row, expert slice or gate/up half of one."""

  hf: str
  path: Path
  index: int | None = None  # expert index into a stacked [E, ...] array
  transpose: bool = False  # swap the last two axes
  layer_row: int | None = None  # the layer's row in a scanned stack [R, ...]
  cols: tuple[int, int] | None = None  # moejax columns [a, b) of the last axis (gate or up)
  rows: int | None = None  # the first rows of the first axis (a padded embedding's vocab)

  def view(self, arrays: dict[Path, np.ndarray]) -> np.ndarray:
    """The array, layer row, expert slice or gate/up half of `arrays` this tensor is: a view,
    not a copy."""
    a = arrays[self.path]
    a = a if self.rows is None else a[: self.rows]
    a = a if self.layer_row is None else a[self.layer_row]
    a = a if self.index is None else a[self.index]
    return a if self.cols is None else a[..., self.cols[0] : self.cols[1]]

  def where(self) -> str:
    """The moejax side for messages: 'stacks.1.blocks.0.mlp.router.kernel[row 2]'."""
    row = "" if self.layer_row is None else f"[row {self.layer_row}]"
    row += "" if self.rows is None else f"[:{self.rows}]"
    cols = "" if self.cols is None else f"[..., {self.cols[0]}:{self.cols[1]}]"
    return ".".join(map(str, self.path)) + row + cols

  def moejax_shape(self, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `to_moejax` gives a tensor of `hf_shape`."""
    return (*hf_shape[:-2], hf_shape[-1], hf_shape[-2]) if self.transpose else tuple(hf_shape)

  def to_moejax(self, hf_array: np.ndarray) -> np.ndarray:
    """The HF tensor as the moejax array (or expert slice) it fills."""
    return np.swapaxes(hf_array, -1, -2) if self.transpose else hf_array

  def to_hf(self, params: dict[Path, np.ndarray]) -> np.ndarray:
    """The HF tensor from moejax's arrays, either layout (legacy per-expert HF layout only)."""
    a = self.view(params)
    return np.ascontiguousarray(np.swapaxes(a, -1, -2) if self.transpose else a)


def _attention(mc: ModelConfig, i: int) -> list[Spec]:
  p, q = f"model.layers.{i}.self_attn.", ("layers", i, "attn")
  out = [Spec(f"{p}{n}_proj.weight", (*q, f"{n}_proj", "kernel"), None, True) for n in "qkvo"]
  if mc.qkv_bias:
    out += [Spec(f"{p}{n}_proj.bias", (*q, f"{n}_proj", "bias")) for n in "qkv"]
  if mc.qk_norm:
    out += [Spec(f"{p}{n}_norm.weight", (*q, f"{n}_norm", "scale")) for n in "qk"]
  return out


def _ffn(prefix: str, path: Path, names: tuple[str, str, str], F: int, index: int | None = None):
  """A SwiGLU of hidden width F: HF gate and up are the halves of `w_gate_up`."""
  (gate, up, down), w_gu = names, (*path, "w_gate_up")
  return [
    Spec(f"{prefix}{gate}.weight", w_gu, index, True, cols=(0, F)),
    Spec(f"{prefix}{up}.weight", w_gu, index, True, cols=(F, 2 * F)),
    Spec(f"{prefix}{down}.weight", (*path, "w_down"), index, True),
  ]


def _moe(mc: ModelConfig, fam: Family, i: int, fused: bool) -> list[Spec]:
  p, q = f"model.layers.{i}.{fam.moe_prefix}.", ("layers", i, "mlp")
  out = [Spec(f"{p}gate.weight", (*q, "router", "kernel"), None, True)]
  E, F = mc.moe.n_experts, mc.moe.d_expert
  if fused:
    out += [
      Spec(f"{p}experts.gate_up_proj", (*q, "experts", "w_gate_up"), None, True),
      Spec(f"{p}experts.down_proj", (*q, "experts", "w_down"), None, True),
    ]
  else:
    for e in range(E):
      out += _ffn(f"{p}experts.{e}.", (*q, "experts"), fam.expert_names, F, e)
  if fam.shared:
    names = ("gate_proj", "up_proj", "down_proj")
    out += _ffn(f"{p}shared_expert.", (*q, "shared"), names, mc.moe.d_shared)
    out.append(Spec(f"{p}shared_expert_gate.weight", (*q, "shared_gate", "kernel"), None, True))
  return out


def specs(
  mc: ModelConfig,
  fam: Family,
  fused_layers: frozenset[int] = frozenset(),
  *,
  attention: Callable[[ModelConfig, int], list[Spec]] = _attention,
  moe_extra: Callable[[ModelConfig, Family, int], list[Spec]] | None = None,
) -> list[Spec]:
  """Every tensor of the HF checkpoint, in HF order, mapped onto moejax's parameters (rows
  of the stacks when `mc.scan_layers`). A padded vocabulary (`mc.padded_vocab`) maps its
  first `mc.vocab_size` rows: the HF checkpoint holds the real ids only. `attention` and
  `moe_extra` (a family's tensors beside router and experts) are a family module's
  (`moejax.hf.deepseek_tensors`)."""
  padded = mc.padded_vocab > mc.vocab_size
  out = [Spec("model.embed_tokens.weight", ("embed", "embedding"), rows=_rows(mc))]
  for i in range(mc.n_layers):
    p = f"model.layers.{i}."
    out.append(Spec(f"{p}input_layernorm.weight", ("layers", i, "attn_norm", "scale")))
    out += attention(mc, i)
    out.append(Spec(f"{p}post_attention_layernorm.weight", ("layers", i, "mlp_norm", "scale")))
    if is_moe_layer(mc, i):
      out += _moe(mc, fam, i, i in fused_layers)
      out += moe_extra(mc, fam, i) if moe_extra else []
    else:
      names = ("gate_proj", "up_proj", "down_proj")
      out += _ffn(f"{p}mlp.", ("layers", i, "mlp"), names, mc.d_ff)
  out.append(Spec("model.norm.weight", ("final_norm", "scale")))
  if not mc.tie_embeddings:
    vocab_cols = (0, mc.vocab_size) if padded else None
    out.append(Spec("lm_head.weight", ("lm_head", "kernel"), None, True, cols=vocab_cols))
  if not mc.scan_layers:
    return out
  segs = layer_segments(mc)
  heads = {i: stack.scanned_path(("layers", i), segs) for i in range(mc.n_layers)}
  return [_scanned(s, heads) for s in out]


def _rows(mc: ModelConfig) -> int | None:
  """The embedding rows an HF tensor maps: the real vocab of a padded one, else all."""
  return mc.vocab_size if mc.padded_vocab > mc.vocab_size else None


def zero_vocab_padding(mc: ModelConfig, arrays: dict[Path, np.ndarray]) -> None:
  """The padded vocab rows (embedding) and columns (untied head) of `arrays` set to 0, as
  a trained run holds them: an import fills only the real ones."""
  n = mc.vocab_size
  arrays[("embed", "embedding")][n:] = 0
  if not mc.tie_embeddings:
    arrays[("lm_head", "kernel")][..., n:] = 0


def _scanned(spec: Spec, heads: dict[int, tuple[Path, int]]) -> Spec:
  """`spec` of the unrolled layout as its stacked array and layer row; `heads[i]`: layer i's
  (`("stacks", s, "blocks", j)`, row), `stack.scanned_path` of its prefix."""
  if spec.path[0] != "layers":
    return spec
  head, row = heads[spec.path[1]]
  return spec._replace(path=(*head, *spec.path[2:]), layer_row=row)


def fused_layers(names: set[str], fam: Family, n_layers: int) -> frozenset[int]:
  """Layers whose experts are stored in transformers 5's fused layout."""
  return frozenset(
    i for i in range(n_layers) if f"model.layers.{i}.{fam.moe_prefix}.experts.down_proj" in names
  )
