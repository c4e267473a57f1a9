"""DeepSeek-V2 / V2-Lite (`deepseek_v2`) and V3 / Kimi-K2 (`deepseek_v3`) configs, both ways.

What transformers 5.24's modeling code does with each config key (checked against its
source), and the moejax keys that reproduce it:

* attention: MLA (`model.mixers=mla`, `model.mla.*`): `q_lora_rank` (null: a plain
  `q_proj`), `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; RoPE on
  adjacent pairs (V2 always, V3 under `rope_interleave`), YaRN from `rope_parameters` (or the
  legacy `rope_scaling` + `rope_theta` of the published config.json files). The saved
  `head_dim` is the rope head dim (transformers sets it so): it is not read.
* V2's router (`DeepseekV2TopkRouter`): softmax over the E logits, top-k (`greedy`), or
  top-k within the `topk_group` groups of `n_group` with the best max score
  (`group_limited_greedy`), then × `routed_scaling_factor`. It never renormalizes:
  `norm_topk_prob` is ignored there, and here.
* V3's router (`DeepseekV3TopkRouter`, whatever `topk_method` says; the published configs
  say `noaux_tc`): sigmoid scores, selection on score + `e_score_correction_bias` (moejax's
  router bias, `selection_bias`) within the `topk_group` groups of `n_group` with the best
  sum of their top-2 keys, weights from the unbiased scores, renormalized iff
  `norm_topk_prob`, × `routed_scaling_factor`.
* `n_shared_experts` shared experts of `moe_intermediate_size` are one SwiGLU of
  n_shared × moe_intermediate_size (`mlp.shared_experts.*`) added with gain 1 (rule
  `shared='unit'`). Layers from `first_k_dense_replace` on are MoE, the others a dense SwiGLU
  of `intermediate_size`; transformers ignores `moe_layer_freq`, so only 1 is accepted.
* V3's multi-token-prediction layers (`num_nextn_predict_layers`, stored as
  `model.layers.{num_hidden_layers}.*`) are not modelled: import skips them.
"""

from __future__ import annotations

from typing import Any

from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.hf import families as fl
from moejax.nn import mixers, routing
from moejax.nn.model import is_moe_layer

TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}
SCORES = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}  # `scoring_func`, as each router
BASE_RULES = {"deepseek_v2": "deepseek_v2_lite", "deepseek_v3": "deepseek_v3"}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' `or 32` / `or 1`


def _refuse(where: str, key: str, value: Any, allowed: str) -> None:
  raise UserError(f"{where}: {key}={value!r} is not supported; {allowed}")


def _get(hf: dict, key: str, where: str) -> Any:
  if hf.get(key) is None:
    raise UserError(f"{where}: missing key {key}")
  return hf[key]


def check_supported(hf: dict, fam: fl.Family, where: str) -> None:
  """One-line refusals of what transformers' DeepSeek code would compute differently."""
  method = hf.get("topk_method") or TOPK_METHODS[fam.name][0]
  allowed = TOPK_METHODS[fam.name]
  for key, value, ok, use in (
    ("hidden_act", hf.get("hidden_act", "silu"), hf.get("hidden_act", "silu") == "silu", "silu"),
    ("attention_bias", hf.get("attention_bias"), not hf.get("attention_bias"), "false"),
    ("mlp_bias", hf.get("mlp_bias"), not hf.get("mlp_bias"), "false"),
    ("moe_layer_freq", hf.get("moe_layer_freq"), hf.get("moe_layer_freq", 1) in (None, 1), "1"),
    ("topk_method", method, method in allowed, f"one of {', '.join(allowed)}"),
    ("scoring_func", hf.get("scoring_func"), hf.get("scoring_func") in (None, SCORES[fam.name]),
     SCORES[fam.name]),
    ("n_shared_experts", hf.get("n_shared_experts"), (hf.get("n_shared_experts") or 0) >= 1,
     ">= 1"),
  ):  # fmt: skip
    if not ok:
      _refuse(where, key, value, f"use {use} ({fam.architecture} in transformers 5.24)")


def rope(hf: dict, where: str) -> tuple[float, dict[str, Any]]:
  """(rope_theta, the `model.mla.rope_*` keys) from `rope_parameters` or the legacy
  `rope_scaling` (`type`) + `rope_theta`, as transformers standardizes them."""
  p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  kind = p.get("rope_type", p.get("type", "default"))
  theta = float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))
  if kind == "default":
    return theta, {"rope_type": "default"}
  if kind != "yarn":
    _refuse(where, "rope_type", kind, "use default or yarn")
  if p.get("attention_factor") is not None:
    _refuse(where, "rope_parameters.attention_factor", p["attention_factor"], "leave it unset")
  if p.get("truncate", True) is not True:
    _refuse(where, "rope_parameters.truncate", p["truncate"], "use true")
  original = p.get("original_max_position_embeddings") or _get(hf, "max_position_embeddings", where)
  return theta, {
    "rope_type": "yarn",
    "rope_factor": float(_get(p, "factor", f"{where} rope_parameters")),
    "rope_original_max_position_embeddings": int(original),
    "rope_beta_fast": float(p.get("beta_fast") or YARN_DEFAULTS["beta_fast"]),
    "rope_beta_slow": float(p.get("beta_slow") or YARN_DEFAULTS["beta_slow"]),
    "rope_mscale": float(p.get("mscale") or 0.0),
    "rope_mscale_all_dim": float(p.get("mscale_all_dim") or 0.0),
  }


def mla_keys(hf: dict, fam: fl.Family, where: str) -> tuple[float, dict[str, Any]]:
  """(rope_theta, `model.mla.*`)."""
  theta, keys = rope(hf, where)
  keys.update(
    q_lora_rank=int(hf.get("q_lora_rank") or 0),
    kv_lora_rank=_get(hf, "kv_lora_rank", where),
    qk_nope_head_dim=_get(hf, "qk_nope_head_dim", where),
    qk_rope_head_dim=_get(hf, "qk_rope_head_dim", where),
    v_head_dim=_get(hf, "v_head_dim", where),
    rope_interleave=fam.name == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
  )
  return theta, keys


def hf_rule(hf: dict, fam: fl.Family, where: str) -> routing.MergeRule:
  """The merge rule transformers' router computes for this config."""
  scale = float(hf.get("routed_scaling_factor") or 1.0)
  if fam.name == "deepseek_v2":
    grouped = hf.get("topk_method") == "group_limited_greedy"
    n_groups = _get(hf, "n_group", where) if grouped else 1
    topk_groups = _get(hf, "topk_group", where) if grouped else 1
    return routing.MergeRule(
      norm="none", scale=scale, shared="unit", n_groups=n_groups, topk_groups=topk_groups
    )
  return routing.MergeRule(
    score="sigmoid",
    norm="sum" if hf.get("norm_topk_prob") else "none",
    scale=scale,
    shared="unit",
    selection_bias=True,
    n_groups=_get(hf, "n_group", where),
    topk_groups=_get(hf, "topk_group", where),
    group_score="top2_sum",
  )


def rule_keys(rule: routing.MergeRule, base: str) -> dict[str, Any]:
  """`model.moe` rule keys giving `rule`: a rule's name when one is it (the family's base
  first), else the base with the fields that differ (`routing.compose_rule`)."""
  for name in (base, *routing.RULES):
    if routing.RULES[name] == rule:
      return {"rule": name}
  base_rule = routing.RULES[base]
  diff = {
    f: getattr(rule, f) for f in routing.RULE_FIELDS if getattr(rule, f) != getattr(base_rule, f)
  }
  return {"rule": base, **diff}


def to_moejax(hf: dict, fam: fl.Family, where: str) -> dict[str, Any]:
  """`model.*` overrides (nested `moe` and `mla` dicts) reproducing the HF model exactly."""
  check_supported(hf, fam, where)
  D, H, L = (
    _get(hf, k, where) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers")
  )
  first = int(hf.get("first_k_dense_replace") or 0)
  if first >= L:
    _refuse(where, "first_k_dense_replace", first, f"it leaves no MoE layer of {L}")
  theta, mla = mla_keys(hf, fam, where)
  d_expert = _get(hf, fam.d_expert_key, where)
  moe = {
    **rule_keys(hf_rule(hf, fam, where), BASE_RULES[fam.name]),
    "n_experts": _get(hf, fam.n_experts_key, where),
    "top_k": _get(hf, "num_experts_per_tok", where),
    "d_expert": d_expert,
    "d_shared": hf["n_shared_experts"] * d_expert,
    "dispatch": "dropless",
  }
  model = {
    "vocab_size": _get(hf, "vocab_size", where),
    "d_model": D,
    "n_layers": L,
    "n_heads": H,
    "n_kv_heads": H,  # MLA has no KV heads; GQA's check needs a divisor of n_heads
    "head_dim": 0,
    "d_ff": _get(hf, "intermediate_size", where) if first else 0,
    "qk_norm": False,
    "qkv_bias": False,
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    "rope_theta": theta,
    "norm_eps": float(_get(hf, "rms_norm_eps", where)),
    "mixers": "mla",
    "mla": mla,
    "moe_every": 1,
    "first_dense": first,
    "moe": moe,
  }
  if hf.get("num_nextn_predict_layers"):
    model["not_modelled"] = mtp_note(hf)
  return model


def mtp_note(hf: dict) -> str:
  """What import skips of a checkpoint with multi-token-prediction layers."""
  n, L = hf["num_nextn_predict_layers"], hf["num_hidden_layers"]
  return f"the {n} multi-token-prediction layer(s) model.layers.{L}.* (skipped on import)"


def _export_refuse(field: str, value: Any, why: str) -> None:
  raise UserError(f"cannot export: {field}={value!r} {why}")


def choose_family(rc: RunConfig) -> fl.Family:
  """DeepSeek-V3 for a sigmoid rule, V2 for a softmax one, or a UserError naming the field
  transformers' DeepSeek code has no counterpart for."""
  m = rc.model
  if m.moe is None:
    _export_refuse("model.moe_every", 0, "has no counterpart in DeepSeek-V2/V3 (MoE models)")
  rule, moe = m.moe.merge_rule, m.moe
  v3 = rule.score == "sigmoid"
  group = "top2_sum" if v3 else "max"
  for field, value, ok in (
    ("model.mixers", m.mixers, mixers.pattern(m.mixers) == ("mla",)),
    ("model.norm", m.norm, m.norm == "rms"),
    ("model.moe_every", m.moe_every, m.moe_every == 1),
    ("model.moe.dispatch", moe.dispatch, moe.dispatch == "dropless"),
    ("model.moe.shared", rule.shared, rule.shared == "unit"),
    ("model.moe.d_shared", moe.d_shared, moe.d_shared > 0 and moe.d_shared % moe.d_expert == 0),
    ("model.moe.norm", rule.norm, rule.norm == "none" or (v3 and rule.norm == "sum")),
    ("model.moe.selection_bias", rule.selection_bias, v3 or not rule.selection_bias),
    ("model.moe.group_score", rule.group_score, rule.n_groups == 1 or rule.group_score == group),
    ("model.mla.rope_interleave", m.mla.rope_interleave, v3 or m.mla.rope_interleave),
  ):
    if not ok:
      _export_refuse(field, value, "has no counterpart in DeepSeek-V2/V3 (transformers 5.24)")
  return fl.FAMILIES["deepseek_v3" if v3 else "deepseek_v2"]


def rope_hf(rc: RunConfig) -> dict[str, Any]:
  """`rope_parameters` and `max_position_embeddings` of the run's MLA."""
  m, mla = rc.model, rc.model.mla
  params: dict[str, Any] = {"rope_type": mla.rope_type, "rope_theta": m.rope_theta}
  max_pos = max(4096, rc.data.seq_len)
  if mla.rope_type == "yarn":
    y = mla.rope_scaling
    params.update(
      factor=y.factor,
      original_max_position_embeddings=y.original_max_position_embeddings,
      beta_fast=y.beta_fast,
      beta_slow=y.beta_slow,
      mscale=y.mscale,
      mscale_all_dim=y.mscale_all_dim,
    )
    max_pos = max(max_pos, int(y.factor * y.original_max_position_embeddings))
  return {"rope_parameters": params, "rope_theta": m.rope_theta, "max_position_embeddings": max_pos}


def to_hf(rc: RunConfig, fam: fl.Family, eos_id: int | None) -> dict[str, Any]:
  """The HF config.json of a run whose vocabulary is resolved (what transformers writes)."""
  m, moe, mla = rc.model, rc.model.moe, rc.model.mla
  rule = moe.merge_rule
  first = next(i for i in range(m.n_layers) if is_moe_layer(m, i))
  grouped = rule.n_groups > 1
  hf: dict[str, Any] = {
    "architectures": [fam.architecture],
    "model_type": fam.model_type,
    "vocab_size": m.vocab_size,
    "hidden_size": m.d_model,
    "intermediate_size": m.d_ff if first else moe.d_expert,
    "moe_intermediate_size": moe.d_expert,
    "num_hidden_layers": m.n_layers,
    "num_attention_heads": m.n_heads,
    "num_key_value_heads": m.n_heads,
    "n_routed_experts": moe.n_experts,
    "num_experts_per_tok": moe.top_k,
    "n_shared_experts": moe.d_shared // moe.d_expert,
    "first_k_dense_replace": first,
    "moe_layer_freq": 1,
    "routed_scaling_factor": rule.alpha(moe.top_k),
    "norm_topk_prob": rule.norm == "sum",
    "scoring_func": SCORES[fam.name],
    "n_group": rule.n_groups,
    "topk_group": rule.topk_groups,
    "topk_method": "noaux_tc" if fam.name == "deepseek_v3" else
                   ("group_limited_greedy" if grouped else "greedy"),
    "q_lora_rank": mla.q_lora_rank or None,
    "kv_lora_rank": mla.kv_lora_rank,
    "qk_nope_head_dim": mla.qk_nope_head_dim,
    "qk_rope_head_dim": mla.qk_rope_head_dim,
    "v_head_dim": mla.v_head_dim,
    "head_dim": mla.qk_rope_head_dim,  # transformers' meaning: the rope head dim
    **rope_hf(rc),
    "hidden_act": "silu",
    "rms_norm_eps": m.norm_eps,
    "tie_word_embeddings": bool(m.tie_embeddings),
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "float32",
    "torch_dtype": "float32",
    "eos_token_id": eos_id,
    "bos_token_id": None,
    "pad_token_id": None,
  }  # fmt: skip
  if fam.name == "deepseek_v3":
    hf.update(rope_interleave=mla.rope_interleave, num_nextn_predict_layers=0)
  else:
    hf["mlp_bias"] = False
  return hf
