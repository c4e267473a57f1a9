"""The transformers MoE families and their config translation, both ways.

A `Family` records what differs between OLMoE, Qwen3-MoE, Qwen2-MoE and Mixtral in their
HF modeling code (transformers 5.x, checked against the installed source):
- router: softmax over all E logits in float32, top-k, then renormalize iff
  `norm_topk_prob` (Mixtral: always);
- attention: q/k RMSNorm over the whole projection (OLMoE) or per head (Qwen3), q/k/v
  biases (Qwen2: `qkv_bias`, default true), rotate-half RoPE with `rope_theta`;
- Qwen2-MoE adds a shared expert scaled by sigmoid(x·w_g); Qwen2/Qwen3 place dense
  layers with `decoder_sparse_step` and `mlp_only_layers`.
DeepSeek-V2/V2-Lite and V3/Kimi-K2 (`mla`) differ in attention, router and shared experts
alike: their translation is `moejax.hf.deepseek`, their tensors `moejax.hf.deepseek_tensors`.
The hybrid families (Qwen3.5/3.6-MoE, Qwen3-Next: Gated DeltaNet and gated attention layers,
zero-centred norms) add what `moejax.hf.qwen3_5` translates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moejax.errors import UserError
from moejax.nn import routing


@dataclasses.dataclass(frozen=True)
class Family:
  """What one HF MoE family looks like on disk and in its config.json."""

  name: str  # moejax's name for it (also its native routing rule)
  model_type: str
  architecture: str
  moe_prefix: str  # the MoE module's name inside a decoder layer
  expert_names: tuple[str, str, str]  # HF names of (gate, up, down) in one expert
  n_experts_key: str
  d_expert_key: str
  qk_norm_scope: str | None  # "proj" (OLMoE), "head" (Qwen3) or None
  qkv_bias_key: str | None  # config key of q/k/v biases, None: never
  qkv_bias_default: bool = False
  shared: bool = False  # sigmoid-gated shared expert (Qwen2-MoE)
  sparse_step: bool = False  # decoder_sparse_step / mlp_only_layers
  always_renorm: bool = False  # Mixtral renormalizes whatever the config says
  mla: bool = False  # DeepSeek: MLA, `shared_experts`, a router bias (moejax.hf.deepseek)
  hybrid: bool = False  # Gated DeltaNet / gated attention layers (moejax.hf.qwen3_5)


FAMILIES: dict[str, Family] = {
  f.name: f
  for f in (
    Family(
      "olmoe", "olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
      "num_experts", "intermediate_size", "proj", "attention_bias",
    ),
    Family(
      "qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
      "num_experts", "moe_intermediate_size", "head", "attention_bias", sparse_step=True,
    ),
    Family(
      "qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
      "num_experts", "moe_intermediate_size", None, "qkv_bias", True, shared=True,
      sparse_step=True,
    ),
    Family(
      "mixtral", "mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"),
      "num_local_experts", "intermediate_size", None, None, always_renorm=True,
    ),
    Family(
      "deepseek_v2", "deepseek_v2", "DeepseekV2ForCausalLM", "mlp",
      ("gate_proj", "up_proj", "down_proj"), "n_routed_experts", "moe_intermediate_size", None,
      None, mla=True,
    ),
    Family(
      "deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM", "mlp",
      ("gate_proj", "up_proj", "down_proj"), "n_routed_experts", "moe_intermediate_size", None,
      None, mla=True,
    ),
    Family(
      "qwen3_5_moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "mlp",
      ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size", "head",
      "attention_bias", shared=True, always_renorm=True, hybrid=True,
    ),
    Family(
      "qwen3_next", "qwen3_next", "Qwen3NextForCausalLM", "mlp",
      ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size", "head",
      "attention_bias", shared=True, sparse_step=True, hybrid=True,
    ),
  )
}  # fmt: skip
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}
BY_MODEL_TYPE["kimi_k2"] = FAMILIES["deepseek_v3"]  # Kimi-K2's config.json (DeepSeek-V3's code)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",)}
ATTN_BIAS_WITH_O = ("attention_bias",)  # these keys also put a bias on o_proj


def detect(hf: dict, where: str) -> Family:
  """The family of an HF config.json, by `architectures` or `model_type`."""
  for arch in hf.get("architectures") or []:
    if arch in BY_ARCHITECTURE:
      return BY_ARCHITECTURE[arch]
  if hf.get("model_type") in BY_MODEL_TYPE:
    return BY_MODEL_TYPE[hf["model_type"]]
  found = hf.get("architectures") or hf.get("model_type")
  if not found:
    raise UserError(f"{where}: no architectures or model_type key; cannot tell the family")
  allowed = ", ".join(BY_ARCHITECTURE)
  raise UserError(f"{where}: architecture {found} is not supported; use one of {allowed}")


def rule_name(fam: Family, shared: bool, renorm: bool) -> str:
  """The moejax rule with softmax scores, α = 1 and this normalization / shared gate: the
  family's own name when its rule is that one (Mixtral, OLMoE, ...), else the generic one."""
  generic = {
    (False, False): "olmoe",
    (False, True): "qwen3_moe",
    (True, False): "qwen2_moe",
    (True, True): "qwen3_5_moe",
  }[(shared, renorm)]
  own = routing.RULES.get(fam.name)
  return fam.name if own == routing.RULES[generic] else generic


def _get(hf: dict, key: str, where: str) -> Any:
  if hf.get(key) is None:
    raise UserError(f"{where}: missing key {key}")
  return hf[key]


def rope_theta(hf: dict, where: str) -> float:
  """rope_theta from `rope_parameters` (transformers 5) or the legacy top-level keys."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
  if kind != "default":
    raise UserError(f"{where}: rope_scaling/rope_type={kind!r} is not supported; only default")
  return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def moe_layers(fam: Family, hf: dict, n_layers: int) -> list[int]:
  """Layers that are MoE in the HF model (decoder_sparse_step, mlp_only_layers)."""
  if not fam.sparse_step:
    return list(range(n_layers))
  step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
  return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def placement(moe: list[int], n_layers: int, where: str) -> tuple[int, int]:
  """(first_dense, moe_every) giving exactly these MoE layers, or a UserError."""
  if not moe:
    raise UserError(f"{where}: decoder_sparse_step/mlp_only_layers leave no MoE layer")
  first = moe[0]
  every = moe[1] - moe[0] if len(moe) > 1 else n_layers
  if moe != list(range(first, n_layers, every)):
    raise UserError(
      f"{where}: mlp_only_layers/decoder_sparse_step give MoE layers {moe}, which moejax's "
      "first_dense + moe_every cannot express"
    )
  return first, every
