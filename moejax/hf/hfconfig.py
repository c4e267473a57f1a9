"""Config translation: HF config.json → moejax `model.*` keys, and a moejax run → HF config."""

from __future__ import annotations

from typing import Any

from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.hf import deepseek
from moejax.hf import families as fl
from moejax.nn import mixers
from moejax.nn.model import is_moe_layer


def to_moejax(hf: dict, fam: fl.Family, where: str) -> dict[str, Any]:
  """`model.*` overrides (with a nested `moe` dict) reproducing the HF model exactly."""
  if fam.mla:
    return deepseek.to_moejax(hf, fam, where)

  def get(key: str) -> Any:
    for k in (key, *fl.ALIASES.get(key, ())):
      if hf.get(k) is not None:
        return hf[k]
    raise UserError(f"{where}: missing key {key}")

  for key, ok, allowed in (
    ("hidden_act", hf.get("hidden_act", "silu") == "silu", "silu"),
    ("clip_qkv", hf.get("clip_qkv") is None, "null"),
    ("use_sliding_window", not hf.get("use_sliding_window"), "false"),
  ):
    if not ok:
      raise UserError(f"{where}: {key}={hf[key]!r} is not supported; use {allowed}")
  d, H, L = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
  head_dim = hf.get("head_dim") or d // H
  if fam.qk_norm_scope == "proj" and head_dim * H != d:
    raise UserError(f"{where}: head_dim={head_dim} must be hidden_size/num_attention_heads")
  bias = bool(hf.get(fam.qkv_bias_key, fam.qkv_bias_default)) if fam.qkv_bias_key else False
  if bias and fam.qkv_bias_key in fl.ATTN_BIAS_WITH_O:
    raise UserError(f"{where}: attention_bias=true (an o_proj bias) is not supported")
  first_dense, moe_every = fl.placement(fl.moe_layers(fam, hf, L), L, where)
  all_moe = (first_dense, moe_every) == (0, 1)
  renorm = fam.always_renorm or bool(hf.get("norm_topk_prob", False))
  moe = {
    "rule": fl.rule_name(fam, fam.shared, renorm),
    "n_experts": get(fam.n_experts_key),
    "top_k": get("num_experts_per_tok"),
    "d_expert": get(fam.d_expert_key),
    "d_shared": get("shared_expert_intermediate_size") if fam.shared else 0,
    "dispatch": "dropless",
  }
  return {
    "vocab_size": get("vocab_size"),
    "d_model": d,
    "n_layers": L,
    "n_heads": H,
    "n_kv_heads": hf.get("num_key_value_heads") or H,
    "head_dim": head_dim,
    "d_ff": 0 if all_moe else get("intermediate_size"),
    "qk_norm": fam.qk_norm_scope is not None,
    "qk_norm_scope": fam.qk_norm_scope or "head",
    "qkv_bias": bias,
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    "rope_theta": fl.rope_theta(hf, where),
    "norm_eps": float(get("rms_norm_eps")),
    "moe_every": moe_every,
    "first_dense": first_dense,
    "moe": moe,
  }


def _refuse(field: str, value: Any, why: str) -> None:
  raise UserError(f"cannot export: {field}={value!r} {why}")


def choose_family(rc: RunConfig) -> fl.Family:
  """The family that expresses this run's architecture and rule, or a UserError naming the
  field without a counterpart."""
  m = rc.model
  if "mla" in mixers.pattern(m.mixers):
    return deepseek.choose_family(rc)
  if m.moe is None:
    _refuse("model.moe_every", 0, "has no counterpart in OLMoE, Qwen3-MoE, Qwen2-MoE or Mixtral")
  rule = m.moe.merge_rule
  for field, value, ok in (
    ("model.moe_every", m.moe_every, m.moe_every > 0),
    ("model.moe.dispatch", m.moe.dispatch, m.moe.dispatch == "dropless"),
    ("model.moe.score", rule.score, rule.score == "softmax"),
    ("model.moe.norm", rule.norm, rule.norm in ("none", "sum")),
    ("model.moe.scale", rule.scale, rule.scale == 1),
    ("model.moe.selection_bias", rule.selection_bias, not rule.selection_bias),
    ("model.moe.n_groups", rule.n_groups, rule.n_groups == 1),
    ("model.moe.shared", rule.shared, rule.shared in ("none", "sigmoid")),
  ):
    if not ok:
      _refuse(field, value, "has no counterpart in OLMoE, Qwen3-MoE, Qwen2-MoE or Mixtral")
  if rule.shared == "sigmoid" and m.moe.d_shared > 0:
    fam = fl.FAMILIES["qwen2_moe"]
  elif m.qk_norm:
    fam = fl.FAMILIES["qwen3_moe" if m.qk_norm_scope == "head" else "olmoe"]
  elif rule.norm == "sum":
    fam = fl.FAMILIES["mixtral"]
  else:
    _refuse("model.qk_norm", False, "with an unrenormalized rule: only Qwen2-MoE (shared expert)")
  if fam.name == "qwen2_moe" and m.qk_norm:
    _refuse("model.qk_norm", True, "with a sigmoid shared expert: Qwen2-MoE has no QK-norm")
  if fam.name == "mixtral" and m.qkv_bias:
    _refuse("model.qkv_bias", True, "with no QK-norm: Mixtral has no attention biases")
  head_dim = m.head_dim or m.d_model // m.n_heads
  if fam.name == "olmoe" and head_dim * m.n_heads != m.d_model:
    _refuse("model.head_dim", m.head_dim, "with qk_norm_scope=proj: OLMoE needs d_model/n_heads")
  if not fam.sparse_step and not all(is_moe_layer(m, i) for i in range(m.n_layers)):
    _refuse("model.first_dense", m.first_dense, f"(dense layers): {fam.architecture} has none")
  return fam


def to_hf(rc: RunConfig, fam: fl.Family, eos_id: int | None) -> dict[str, Any]:
  """The HF config.json of a run whose vocabulary is resolved (transformers 5 keys, plus
  legacy `rope_theta`)."""
  if fam.mla:
    return deepseek.to_hf(rc, fam, eos_id)
  m = mc = rc.model
  rule = mc.moe.merge_rule
  dense = [i for i in range(m.n_layers) if not is_moe_layer(mc, i)]
  hf: dict[str, Any] = {
    "architectures": [fam.architecture],
    "model_type": fam.model_type,
    "vocab_size": mc.vocab_size,
    "hidden_size": m.d_model,
    "num_hidden_layers": m.n_layers,
    "num_attention_heads": m.n_heads,
    "num_key_value_heads": m.n_kv_heads,
    "head_dim": mc.resolved_head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": m.norm_eps,
    "rope_theta": m.rope_theta,
    "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
    "tie_word_embeddings": bool(m.tie_embeddings),
    "num_experts_per_tok": m.moe.top_k,
    fam.n_experts_key: m.moe.n_experts,
    "intermediate_size": m.d_ff if dense else m.moe.d_expert,
    fam.d_expert_key: m.moe.d_expert,
    "norm_topk_prob": rule.norm == "sum",
    "max_position_embeddings": max(4096, rc.data.seq_len),
    "attention_dropout": 0.0,
    "dtype": "float32",
    "torch_dtype": "float32",
    "eos_token_id": eos_id,
    "bos_token_id": None,
    "pad_token_id": None,
  }
  if fam.sparse_step:
    hf.update(decoder_sparse_step=1, mlp_only_layers=dense, use_sliding_window=False)
  if fam.shared:
    hf.update(shared_expert_intermediate_size=m.moe.d_shared, qkv_bias=True)
  elif fam.qkv_bias_key:
    hf[fam.qkv_bias_key] = bool(m.qkv_bias)
  if fam.name == "mixtral":
    hf["sliding_window"] = None
  return hf
