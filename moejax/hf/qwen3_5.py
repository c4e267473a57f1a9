"""The hybrid families' configs, both ways: Qwen3.5/3.6-MoE (`qwen3_5_moe`: the text model
`Qwen3_5MoeForCausalLM` and the published vision-language wrapper
`Qwen3_5MoeForConditionalGeneration`) and Qwen3-Next (`qwen3_next`).

What `hfconfig.to_moejax` does not already translate (transformers 5.24's modeling, read):
- `layer_types` (or `full_attention_interval`): `linear_attention` is moejax's
  `gated_deltanet` mixer, `full_attention` its `gated_attention`; the list becomes its
  shortest period (`model.mixers`), which reproduces it exactly (a list with no shorter
  period is its own period);
- the block, final and q/k norms are zero-centred (x̂·(1 + w), `model.norm=zero_centred`);
  the Gated DeltaNet's gated output norm keeps a plain weight (the mixer's `norm_weight`);
- `partial_rotary_factor` (in `rope_parameters`; transformers' default 0.25); text-only
  mRoPE (`mrope_section`) is 1-D RoPE on the rotary dims (tests/test_gated_deltanet.py);
- the `linear_*` shapes (`model.gated_deltanet.*`);
- the router: softmax, top-k, renormalized (Qwen3.5 always; Qwen3-Next iff `norm_topk_prob`),
  plus the sigmoid-gated shared expert: moejax's `qwen3_5_moe` rule (`qwen2_moe` for a
  Qwen3-Next with `norm_topk_prob` false).
The wrapper's text model is its `text_config`, its tensors `model.language_model.*`
(`qwen3_5_tensors.WRAPPER`).
"""

from __future__ import annotations

from typing import Any

from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.hf import families as fl
from moejax.hf.qwen3_5_tensors import PLAIN, TEXT, WRAPPER, Layout
from moejax.nn import mixers
from moejax.nn.model import is_moe_layer

WRAPPER_ARCH, WRAPPER_TYPE = "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"
MIXER_OF = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
LAYER_TYPE_OF = {m: t for t, m in MIXER_OF.items()}
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim")  # fmt: skip
PARTIAL_ROTARY_FACTOR = 0.25  # transformers' default for both families


def is_wrapper(hf: dict) -> bool:
  return WRAPPER_ARCH in (hf.get("architectures") or []) or hf.get("model_type") == WRAPPER_TYPE


def unwrap(hf: dict, where: str) -> tuple[dict, Layout]:
  """(the text model's config, where its tensors are) of any checkpoint's config.json."""
  if not is_wrapper(hf):
    fam = fl.BY_ARCHITECTURE.get(next(iter(hf.get("architectures") or []), ""))
    fam = fam or fl.BY_MODEL_TYPE.get(hf.get("model_type"))
    return hf, (TEXT if fam is not None and fam.hybrid else PLAIN)
  text = hf.get("text_config")
  if not isinstance(text, dict):
    raise UserError(f"{where}: {WRAPPER_ARCH} without a text_config; cannot read the text model")
  eos = text["eos_token_id"] if text.get("eos_token_id") is not None else hf.get("eos_token_id")
  return {**text, "model_type": fl.FAMILIES["qwen3_5_moe"].model_type, "eos_token_id": eos}, WRAPPER


def layer_types(hf: dict, where: str) -> list[str]:
  """`layer_types`, or the list `full_attention_interval` gives (transformers' rule)."""
  n = hf.get("num_hidden_layers")
  types = hf.get("layer_types")
  if types is None:
    every = hf.get("full_attention_interval", 4)
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
  if len(types) != n:
    raise UserError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers={n}")
  for i, t in enumerate(types):
    if t not in MIXER_OF:
      raise UserError(
        f"{where}: layer_types[{i}]={t!r} is not supported; use {' or '.join(MIXER_OF)}"
      )
  return types


def period(types: list[str]) -> list[str]:
  """The shortest prefix that, repeated, is `types`."""
  return next(types[:p] for p in range(1, len(types) + 1)
              if all(t == types[i % p] for i, t in enumerate(types)))  # fmt: skip


def partial_rotary_factor(hf: dict) -> float:
  params = hf.get("rope_parameters") or {}
  return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                          PARTIAL_ROTARY_FACTOR)))  # fmt: skip


def model_keys(hf: dict, fam: fl.Family, where: str) -> dict[str, Any]:
  """The `model.*` keys a hybrid family adds to `hfconfig.to_moejax`'s ({} for the others)."""
  if not fam.hybrid:
    return {}
  missing = [k for k in LINEAR_KEYS if hf.get(k) is None]
  if missing:
    raise UserError(f"{where}: missing key {missing[0]}")
  hk, hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
  if hv % hk:
    raise UserError(
      f"{where}: linear_num_value_heads={hv} must be a multiple of linear_num_key_heads={hk}"
    )
  return {
    "mixers": ",".join(MIXER_OF[t] for t in period(layer_types(hf, where))),
    "norm": "zero_centred",
    "partial_rotary_factor": partial_rotary_factor(hf),
    "gated_deltanet": {k: hf[k] for k in LINEAR_KEYS},
  }


def is_hybrid(rc: RunConfig) -> bool:
  """Whether the run has a Gated DeltaNet or gated attention layer."""
  return any(n in LAYER_TYPE_OF for n in mixers.pattern(rc.model.mixers))


def _refuse(field: str, value: Any, why: str) -> None:
  raise UserError(f"cannot export: {field}={value!r} {why}")


def choose(rc: RunConfig, saved: dict) -> tuple[fl.Family, Layout]:
  """The hybrid family (and layout) of a run: the one it was imported from, else Qwen3.5-MoE
  when every layer is MoE with a renormalized rule, else Qwen3-Next. A field neither has is
  a UserError naming it."""
  m = rc.model
  rule = m.moe.merge_rule if m.moe else None
  why = "has no counterpart in Qwen3.5-MoE or Qwen3-Next"
  for field, value, ok in (
    ("model.mixers", m.mixers, all(n in LAYER_TYPE_OF for n in mixers.pattern(m.mixers))),
    ("model.norm", m.norm, m.norm == "zero_centred"),
    ("model.qkv_bias", m.qkv_bias, not m.qkv_bias),
    ("model.moe_every", m.moe_every, m.moe is not None and m.moe_every > 0),
  ):
    if not ok:
      _refuse(field, value, why)
  for field, value, ok in (
    ("model.moe.dispatch", m.moe.dispatch, m.moe.dispatch == "dropless"),
    ("model.moe.score", rule.score, rule.score == "softmax"),
    ("model.moe.norm", rule.norm, rule.norm in ("none", "sum")),
    ("model.moe.scale", rule.scale, rule.scale == 1),
    ("model.moe.selection_bias", rule.selection_bias, not rule.selection_bias),
    ("model.moe.n_groups", rule.n_groups, rule.n_groups == 1),
    ("model.moe.shared", rule.shared, rule.shared == "sigmoid"),
    ("model.moe.d_shared", m.moe.d_shared, m.moe.d_shared > 0),
  ):
    if not ok:
      _refuse(field, value, why)
  imported = saved.get("resolved", {}).get("hf_import") or {}
  fits_qwen3_5 = rule.norm == "sum" and all(is_moe_layer(m, i) for i in range(m.n_layers))
  name = imported.get("family")
  if name not in ("qwen3_5_moe", "qwen3_next") or (name == "qwen3_5_moe" and not fits_qwen3_5):
    name = "qwen3_5_moe" if fits_qwen3_5 else "qwen3_next"
  wrapper = name == "qwen3_5_moe" and is_wrapper(imported.get("config") or {})
  return fl.FAMILIES[name], (WRAPPER if wrapper else TEXT)


def _over_source(text: dict, source: dict) -> dict:
  """`text` over the imported text config: what moejax does not model (mRoPE sections,
  max_position_embeddings, special token ids) kept as it was."""
  out = {**source, **text}
  out["rope_parameters"] = {**(source.get("rope_parameters") or {}), **text["rope_parameters"]}
  for key in ("max_position_embeddings", "bos_token_id", "pad_token_id", "eos_token_id"):
    if source.get(key) is not None:
      out[key] = source[key]
  return out


def to_hf(rc: RunConfig, fam: fl.Family, eos_id: int | None, layout: Layout,
          saved: dict) -> dict[str, Any]:  # fmt: skip
  """The config.json transformers loads: the causal LM's, or the wrapper's (its other keys,
  vision_config included, from the imported checkpoint's) with the text model in it."""
  m = rc.model
  dense = [i for i in range(m.n_layers) if not is_moe_layer(m, i)]
  theta = m.rope_theta
  text: dict[str, Any] = {
    "architectures": [fam.architecture],
    "model_type": fam.model_type,
    "vocab_size": m.vocab_size,
    "hidden_size": m.d_model,
    "num_hidden_layers": m.n_layers,
    "num_attention_heads": m.n_heads,
    "num_key_value_heads": m.n_kv_heads,
    "head_dim": m.resolved_head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": m.norm_eps,
    "rope_parameters": {
      "rope_type": "default",
      "rope_theta": theta,
      "partial_rotary_factor": m.partial_rotary_factor,
    },
    "tie_word_embeddings": bool(m.tie_embeddings),
    "attention_bias": False,
    "layer_types": [LAYER_TYPE_OF[mixers.layer_mixer(m.mixers, i)] for i in range(m.n_layers)],
    **{k: getattr(m.gated_deltanet, k) for k in LINEAR_KEYS},
    "num_experts": m.moe.n_experts,
    "num_experts_per_tok": m.moe.top_k,
    "moe_intermediate_size": m.moe.d_expert,
    "shared_expert_intermediate_size": m.moe.d_shared,
    "max_position_embeddings": max(4096, rc.data.seq_len),
    "attention_dropout": 0.0,
    "dtype": "float32",
    "eos_token_id": eos_id,
    "bos_token_id": None,
    "pad_token_id": None,
  }
  if fam.name == "qwen3_next":
    text.update(
      norm_topk_prob=m.moe.merge_rule.norm == "sum", decoder_sparse_step=1,
      mlp_only_layers=dense, intermediate_size=m.d_ff if dense else m.moe.d_expert,
    )  # fmt: skip
  imported = saved.get("resolved", {}).get("hf_import") or {}
  if imported.get("family") == fam.name:
    text = _over_source(text, unwrap(imported["config"], "config.json")[0])
  if layout is not WRAPPER:
    return text
  source = imported["config"]
  text.pop("architectures", None)
  return {**source, "architectures": [WRAPPER_ARCH], "model_type": WRAPPER_TYPE,
          "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}  # fmt: skip
