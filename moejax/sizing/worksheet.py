"""The worksheet: what a config builds (parameter groups, placement, router, dispatch,
losses, mesh), from `jax.eval_shape` of the real model. The library half of
`python -m moejax.describe` (the CLI, which adds the ahead-of-time fit).
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import NamedTuple

import jax

from moejax import build, sharding
from moejax.config.run import RunConfig
from moejax.config.sections import MeshConfig
from moejax.kernels import dispatch, plans
from moejax.nn import mixers, routing
from moejax.nn.losses import LossConfig
from moejax.nn.model import ModelConfig, moe_layers

ARCHITECTURE = "decoder-only Transformer: pre-norm RMSNorm, RoPE, SwiGLU, no biases"

# Parameter group -> how it is counted (the order is the worksheet's).
GROUPS: dict[str, str] = {
  "embeddings": "V x D lookup table",
  "lm_head": "D x V output; 0 when tied",
  "attention": "q, k, v, o of every layer",
  "norms": "RMSNorm scales (2/layer, final, QK)",
  "dense_ffn": "SwiGLU of the dense layers",
  "router": "D x E per MoE layer (b: state)",
  "shared_experts": "shared SwiGLU (+ gate), always on",
  "routed_experts": "E x 3 D F per MoE layer; K of E",
}
# Module name under a block's `mlp` -> group.
_MLP_PARTS = {
  "router": "router",
  "experts": "routed_experts",
  "shared": "shared_experts",
  "shared_gate": "shared_experts",
  "w_gate_up": "dense_ffn",
  "w_down": "dense_ffn",
}
# Published-count conventions: name -> (groups left out, where it is used).
CONVENTIONS: dict[str, tuple[tuple[str, ...], str]] = {
  "all": ((), "everything: the published totals"),
  "no_input_embedding": (("embeddings",), "no lookup table: DeepSeek-V3 active"),
  "non_embedding": (("embeddings", "lm_head"), "no table, no head: 'non-embedding'"),
}
_SCORE = {"softmax": "softmax over all E logits", "sigmoid": "sigmoid of each logit"}
_SHARED = {
  "none": "c(x) = 0",
  "unit": "c(x) = 1",
  "sigmoid": "c(x) = sigmoid(x w_g), learned per token",
  "kplus1": "c(x) = 1/(K+1), routed r_i times K/(K+1)",
}
_BALANCE = {
  "fraction": "f_i = fraction of assignments (sum f = 1; Megatron, MegaBlocks, OLMo-core)",
  "count": "f_i = assignments per token (sum f = K; HF, MaxText, flaxformer)",
}


class ParamGroup(NamedTuple):
  """Parameters of one group: total and read per token at k1 = K."""

  name: str
  total: int
  active: int


@dataclasses.dataclass(frozen=True)
class Worksheet:
  """Everything the worksheet states; `to_dict()` is what config.json records."""

  architecture: str
  vocab_size: int
  padded_vocab: int  # the embedding's rows (vocab_size rounded up; the padding is masked)
  n_layers: int
  d_model: int
  attention: str
  groups: tuple[ParamGroup, ...]
  conventions: dict[str, tuple[int, int]]  # name -> (total, active)
  moe_layers: tuple[int, ...]
  placement: str
  experts: str
  shared: str
  router: str
  rule: dict
  dispatch: str
  losses: str
  mesh: str
  not_modelled: str

  @property
  def total(self) -> int:
    return self.conventions["all"][0]

  @property
  def active(self) -> int:
    return self.conventions["all"][1]

  def group(self, name: str) -> ParamGroup:
    return next(g for g in self.groups if g.name == name)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["groups"] = {g.name: {"total": g.total, "active": g.active} for g in self.groups}
    d["conventions"] = {k: {"total": t, "active": a} for k, (t, a) in self.conventions.items()}
    d["moe_layers"] = list(self.moe_layers)
    d.update(total=self.total, active=self.active)
    return d


def group_of(names: tuple[str, ...]) -> str:
  """The group of a parameter path, unrolled ('layers', '3', 'mlp', 'experts', 'w_down') or
  scanned ('stacks', '1', 'blocks', '0', 'mlp', 'experts', 'w_down'): a stack is counted whole,
  every layer of its segment at once (`moejax.nn.stack`)."""
  if names[0] in ("embed", "lm_head"):
    return "embeddings" if names[0] == "embed" else "lm_head"
  if names[-2].endswith("norm"):
    return "norms"
  if "attn" in names:
    return "attention"
  if "mlp" in names and names[names.index("mlp") + 1] in _MLP_PARTS:
    return _MLP_PARTS[names[names.index("mlp") + 1]]
  raise ValueError(f"parameter {'.'.join(names)} belongs to no worksheet group")


def count_groups(mc: ModelConfig) -> tuple[ParamGroup, ...]:
  """Totals and actives per group of the abstract parameters, each counted by
  `build.param_count` (so the groups add up to `build.count_params`); the same in both
  layouts of `model.scan_layers`."""
  totals, actives = dict.fromkeys(GROUPS, 0), dict.fromkeys(GROUPS, 0)
  for path, leaf in jax.tree_util.tree_leaves_with_path(build.abstract_params(mc)):
    names = build.param_names(path)
    n = build.param_count(names, leaf.shape, mc.moe)
    group = group_of(names)
    totals[group], actives[group] = totals[group] + n.total, actives[group] + n.active
  return tuple(ParamGroup(n, totals[n], actives[n]) for n in GROUPS)


def conventions(groups: tuple[ParamGroup, ...]) -> dict[str, tuple[int, int]]:
  """(total, active) under each published convention."""
  out = {}
  for name, (left_out, _) in CONVENTIONS.items():
    kept = [g for g in groups if g.name not in left_out]
    out[name] = (sum(g.total for g in kept), sum(g.active for g in kept))
  return out


def _ranges(layers: list[int]) -> str:
  """'0-2, 5, 7-9' for [0, 1, 2, 5, 7, 8, 9]."""
  parts, start = [], None
  for i, n in enumerate(layers):
    start = n if start is None else start
    if i + 1 == len(layers) or layers[i + 1] != n + 1:
      parts.append(str(n) if start == n else f"{start}-{n}")
      start = None
  return ", ".join(parts) or "none"


def describe_attention(mc: ModelConfig) -> str:
  names = mixers.pattern(mc.mixers)
  return "; then ".join(_describe_mixer(mc, n) for n in dict.fromkeys(names)) + (
    f" (pattern {mc.mixers}, repeated)" if len(names) > 1 else ""
  )


def _describe_mixer(mc: ModelConfig, name: str) -> str:
  H, G, hd = mc.n_heads, mc.n_kv_heads, mc.resolved_head_dim
  if name == "mla":
    m = mc.mla
    q = f"q LoRA rank {m.q_lora_rank}" if m.q_lora_rank else "plain q"
    rope = "YaRN" if m.rope_type == "yarn" else "RoPE"
    return (f"MLA: {H} heads, latent {m.kv_lora_rank}, q/k {m.qk_nope_head_dim}+"
            f"{m.qk_rope_head_dim} rope, v {m.v_head_dim}; {q}; {rope} theta {mc.rope_theta:g}")  # fmt: skip
  if name == "gated_deltanet":
    g = mc.gated_deltanet
    return (f"Gated DeltaNet: {g.linear_num_key_heads} key / {g.linear_num_value_heads} value "
            f"heads x {g.linear_key_head_dim}/{g.linear_value_head_dim}, conv "
            f"{g.linear_conv_kernel_dim}")  # fmt: skip
  kind = "MHA" if G == H else ("MQA" if G == 1 else "GQA")
  qk = "on (per head)" if mc.qk_norm else "off"
  if name == "gated_attention":
    return (f"gated {kind}: {H} query / {G} kv heads x {hd}; partial RoPE "
            f"{mc.partial_rotary_factor:g}, theta {mc.rope_theta:g}; zero-centred QK-norm")  # fmt: skip
  return f"{kind}: {H} query / {G} kv heads x {hd}; RoPE theta {mc.rope_theta:g}; QK-norm {qk}"


def describe_placement(mc: ModelConfig) -> tuple[tuple[int, ...], str]:
  moe = moe_layers(mc)
  dense = [i for i in range(mc.n_layers) if i not in moe]
  text = (
    f"{len(moe)} of {mc.n_layers} layers MoE: {_ranges(moe)} (first_dense {mc.first_dense}, "
    f"moe_every {mc.moe_every}); dense: {_ranges(dense)}"
  )
  return tuple(moe), text


def describe_router(rule: routing.MergeRule, K: int) -> str:
  sel = "s + b (aux-loss-free bias b)" if rule.selection_bias else "s"
  alpha = f"K = {K}" if rule.scale == "k" else f"{rule.scale:g}"
  groups = ""
  if rule.n_groups > 1:
    groups = f"; group-limited: best {rule.topk_groups} of {rule.n_groups} groups by "
    groups += rule.group_score
  norm = routing.NORMS[rule.norm].worksheet.format(lp=f"{rule.lp:g}")
  return f"s = {_SCORE.get(rule.score, rule.score)}; top-{K} on {sel}{groups}; {norm}; a = {alpha}"


def describe_shared(moe, rule: routing.MergeRule) -> str:
  if moe.d_shared == 0:
    return "none"
  n = f" (= {moe.d_shared // moe.d_expert} x d_expert)" if moe.d_shared % moe.d_expert == 0 else ""
  return f"one SwiGLU of width {moe.d_shared}{n}; {_SHARED.get(rule.shared, rule.shared)}"


def describe_kernel(moe) -> str:
  """The expert kernel: for `auto`, the one each platform gets on this install (dispatch.AUTO,
  or its fallback where that kernel cannot run here)."""
  if moe.impl != "auto":
    return f"impl {moe.impl} ({dispatch.KERNELS[moe.impl].description})"
  per = ", ".join(
    f"{p} {dispatch.resolve_impl('auto', moe.dispatch, p)}" for p in dispatch.AUTO[moe.dispatch]
  )
  return f"impl auto: {per}"


def describe_dispatch(rc: RunConfig, moe) -> str:
  if moe.dispatch == "dropless":
    return f"dropless: every assignment computed, none dropped; {describe_kernel(moe)}"
  G = moe.group_size or rc.data.batch_size * rc.data.seq_len // rc.train.grad_accum
  cap = plans.capacity(moe.capacity_factor, moe.top_k, G, moe.n_experts, moe.min_capacity)
  where = f"{moe.group_size} tokens" if moe.group_size else f"the local batch ({G} on 1 device)"
  return (
    f"capacity C = max({moe.min_capacity}, ceil({moe.capacity_factor:g} k G / E)) per group G "
    f"= {where}: C = {cap}; eval factor {moe.eval_capacity_factor:g}; overflow: assignments "
    f"past C are dropped (the token keeps its residual), priority {moe.drop_policy}; second "
    f"expert {moe.second_expert}; {describe_kernel(moe)}"
  )


def describe_losses(lo: LossConfig) -> str:
  convention = lo.balance_convention
  balance = "off"
  if lo.balance_weight > 0:
    balance = f"{lo.balance_weight:g} E sum_i f_i P_i per {lo.balance_granularity}, "
    balance += f"{_BALANCE[convention]}, {lo.balance_choices} choices, "
    balance += "P_i = mean router probability"
  z = f"{lo.z_loss_weight:g} mean(logsumexp(z)^2)" if lo.z_loss_weight > 0 else "off"
  bias = "off"
  if lo.bias_update_rate > 0:
    bias = f"b_i += {lo.bias_update_rate:g} sign(mean load - load_i) per step"
  return f"balance: {balance}; z-loss: {z}; bias update: {bias}"


def describe_mesh(m: MeshConfig) -> str:
  sizes = ", ".join(f"{a}={getattr(m, a)}" for a in sharding.AXES)
  return (
    f"{sizes} (data=-1: the devices left); batch over data x fsdp, routed expert "
    f"weights' E axis over expert, other matrices' first axis over fsdp"
  )


def worksheet(rc: RunConfig) -> Worksheet:
  """The worksheet of a RunConfig whose vocabulary is resolved (`with_vocab`)."""
  mc = rc.model
  groups = count_groups(mc)
  moe_layers, placement = describe_placement(mc)
  moe = mc.moe
  rule = moe.merge_rule if moe is not None else None
  return Worksheet(
    architecture=ARCHITECTURE,
    vocab_size=mc.vocab_size,
    padded_vocab=mc.padded_vocab,
    n_layers=mc.n_layers,
    d_model=mc.d_model,
    attention=describe_attention(mc),
    groups=groups,
    conventions=conventions(groups),
    moe_layers=moe_layers,
    placement=placement,
    experts=f"{moe.n_experts} routed, top-{moe.top_k}, width {moe.d_expert}" if moe else "none",
    shared=describe_shared(moe, rule) if moe else "none",
    router=describe_router(rule, moe.top_k) if moe else "none",
    rule=dataclasses.asdict(rule) if moe else {},
    dispatch=describe_dispatch(rc, moe) if moe else "none",
    losses=describe_losses(rc.loss),
    mesh=describe_mesh(rc.mesh),
    not_modelled=mc.not_modelled or "nothing noted",
  )


def _billions(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _row(label: str, text: str) -> str:
  return textwrap.fill(text, width=100, initial_indent=f"  {label:<16}", subsequent_indent=" " * 18)


def format_worksheet(ws: Worksheet, title: str = "") -> str:
  """The worksheet as aligned text, at most 100 columns."""
  tied = "tied LM head" if ws.group("lm_head").total == 0 else "untied LM head"
  arch = f"{ws.architecture}; {ws.n_layers} layers, d_model {ws.d_model}, vocab "
  padded = f" (embedding padded to {ws.padded_vocab})" if ws.padded_vocab > ws.vocab_size else ""
  arch += f"{ws.vocab_size}{padded}, {tied}"
  counted = "from jax.eval_shape of moejax.nn.model.Transformer (nothing allocated); active ="
  counted += " what one token reads at k1 = K"
  lines = [f"worksheet{': ' + title if title else ''}", _row("architecture", arch)]
  lines += [_row("attention", ws.attention), _row("parameters", counted)]
  lines.append(f"    {'group':<18}{'total':>17}{'active':>17}  counted as")
  for g in ws.groups:
    lines.append(f"    {g.name:<18}{g.total:>17,}{g.active:>17,}  {GROUPS[g.name]}")
  for name, (total, active) in ws.conventions.items():
    label = "total" if name == "all" else name
    lines.append(f"    {label:<18}{total:>17,}{active:>17,}  {CONVENTIONS[name][1]}")
  lines.append(f"    {'':<18}{_billions(ws.total):>17}{_billions(ws.active):>17}")
  rows = [
    ("sparse layers", ws.placement),
    ("routed experts", ws.experts),
    ("shared experts", ws.shared),
    ("router", ws.router),
    ("dispatch", ws.dispatch),
    ("losses", ws.losses),
    ("mesh", ws.mesh),
    ("not modelled", ws.not_modelled),
  ]
  return "\n".join(lines + [_row(k, v) for k, v in rows])


def nominal_vocab(rc: RunConfig) -> tuple[int, str]:
  """The vocabulary without building the data: model.vocab_size, else the tokenizer's."""
  if rc.model.vocab_size:
    return rc.model.vocab_size, ""
  if rc.data.tokenizer == "byte":
    return 257, ""
  return rc.data.bpe_vocab_size, "vocab: data.bpe_vocab_size, an upper bound for a trained BPE"
