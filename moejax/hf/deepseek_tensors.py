"""DeepSeek-V2/V3's tensor names (transformers 5.24, as `save_pretrained` writes them) on
moejax's MLA mixer, shared expert and router bias.

Per layer i, beside the generic norms, router (`mlp.gate.weight`), experts and dense MLP
(`moejax.hf.tensors`):

* `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa`,
  `kv_a_layernorm`, `kv_b_proj`, `o_proj` ↔ `layers.{i}.attn.<same name>.{kernel|scale}`
  (`moejax.nn.mla.MLAttention`): every projection transposed ([out, in] ↔ [in, out]),
  `kv_b_proj`'s [H·(dn+dv), C] included (moejax reshapes its [C, H·(dn+dv)] kernel per head
  at use, in the same [k_nope | v] order);
* `mlp.shared_experts.{gate,up,down}_proj` ↔ the shared SwiGLU `mlp.shared` (gate and up the
  halves of `w_gate_up`);
* V3: `mlp.gate.e_score_correction_bias` [E] ↔ the router bias `mlp.router.bias` (router
  state, not a trainable parameter).

Tensors of the multi-token-prediction layers (`model.layers.{i}.*` for i >= the layer
count: V3's `num_nextn_predict_layers`) are dropped from the index before planning.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from moejax.hf import tensors
from moejax.hf.families import Family
from moejax.hf.tensors import Spec
from moejax.nn.model import ModelConfig

LAYER = re.compile(r"model\.layers\.(\d+)\.")


def attention(mc: ModelConfig, i: int) -> list[Spec]:
  """MLA's projections and latent norms of layer i."""
  p, q = f"model.layers.{i}.self_attn.", ("layers", i, "attn")
  lora = mc.mla.q_lora_rank > 0
  projs = ("q_a_proj", "q_b_proj") if lora else ("q_proj",)
  projs += ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
  norms = ("q_a_layernorm", "kv_a_layernorm") if lora else ("kv_a_layernorm",)
  out = [Spec(f"{p}{n}.weight", (*q, n, "kernel"), None, True) for n in projs]
  return out + [Spec(f"{p}{n}.weight", (*q, n, "scale")) for n in norms]


def moe_extra(mc: ModelConfig, fam: Family, i: int) -> list[Spec]:
  """The shared experts as one SwiGLU, and V3's selection bias."""
  p, q = f"model.layers.{i}.mlp.", ("layers", i, "mlp")
  F, shared = mc.moe.d_shared, (*q, "shared")
  out = [
    Spec(f"{p}shared_experts.gate_proj.weight", (*shared, "w_gate_up"), None, True, cols=(0, F)),
    Spec(f"{p}shared_experts.up_proj.weight", (*shared, "w_gate_up"), None, True, cols=(F, 2 * F)),
    Spec(f"{p}shared_experts.down_proj.weight", (*shared, "w_down"), None, True),
  ]
  if fam.name == "deepseek_v3":
    out.append(Spec(f"{p}gate.e_score_correction_bias", (*q, "router", "bias")))
  return out


def specs(mc: ModelConfig, fam: Family, fused_layers: frozenset[int] = frozenset()) -> list[Spec]:
  """Every tensor of a DeepSeek checkpoint (`tensors.specs` with MLA and shared experts)."""
  return tensors.specs(mc, fam, fused_layers, attention=attention, moe_extra=moe_extra)


def specs_for(fam: Family) -> Callable[..., list[Spec]]:
  """The family's tensor map: this module's for DeepSeek, else the generic one."""
  return specs if fam.mla else tensors.specs


def without_mtp(where: dict[str, str], n_layers: int, log=print) -> dict[str, str]:
  """The tensor index without the layers past `n_layers` (V3's multi-token prediction), with
  a note of what was skipped."""
  mtp = {n for n in where if (m := LAYER.match(n)) and int(m[1]) >= n_layers}
  if mtp:
    layers = sorted({int(LAYER.match(n)[1]) for n in mtp})
    log(
      f"skipping {len(mtp)} tensors of model.layers.{','.join(map(str, layers))}.*: "
      "the multi-token-prediction module, not modelled by moejax"
    )
  return {n: f for n, f in where.items() if n not in mtp}
