"""Model FLOPs per token and per-device peak rates: `perf/tflops_per_device` and `perf/mfu`.

Training FLOPs per token follow PaLM (Chowdhery et al. 2022, arXiv:2204.02311, appendix B),
which nanoGPT's `estimate_mfu` and MaxText's `calculate_tflops_training_per_device`
(maxtext_utils.py) also use:

    flops/token = 6·N + 12·n_layers·H·d_head·L

* N: the matmul weights one token is multiplied by, in the forward pass. Per layer:
  - attention projections: d·H·d_head (q) + 2·d·G·d_head (k, v) + H·d_head·d (o), with H query
    heads and G key/value heads;
  - a dense layer's SwiGLU FFN: 3·d·d_ff;
  - an MoE layer: the router d·E, k routed SwiGLU experts k·3·d·d_expert, the shared expert
    3·d·d_shared and, for a sigmoid shared gate, d·1 (when the block uses them);
  plus the LM head d·V (tied or not: it is a matmul either way). The embedding lookup is a
  gather and is excluded, as are norms, RoPE, softmax and biases (not matmuls).
* k: the trained top-k (`model.moe.top_k`), or the mean k of the step when elastic training
  reports `moe/mean_k` (`TokenFlops.at`). Every MoE layer has the same d_expert, so the
  layers' mean k gives the exact sum.
* 6 = 2 FLOPs per multiply-add × 3 (the forward pass, and the backward pass's two matmuls:
  activation and weight gradients).
* the other token mixers (MLA, gated attention, Gated DeltaNet: `model.mixers`) count their
  own projections and sequence mixing (`moejax/sizing/mixer_flops.py`).
* 12·n_layers·H·d_head·L: the attention scores QKᵀ and the weighted values PV, 2·L·d_head
  FLOPs each per head and token forward, × 3 for training, with L = data.seq_len. PaLM's
  and nanoGPT's count: the full L×L, not halved for the causal mask (recent MaxText halves
  it, since flash kernels skip the masked half; moejax's attention computes it all).

These are *model* FLOPs (PaLM's MFU): rematerialization, dispatch padding (block rows,
capacity slots) and dropped assignments are not counted. MFU is against the chip's dense
bf16 peak whatever `model.dtype` is (a float32 run has a lower attainable MFU).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

from moejax.nn.model import ModelConfig, is_moe_layer
from moejax.sizing import mixer_flops

TFLOPS_METRIC = "perf/tflops_per_device"
MFU_METRIC = "perf/mfu"
MEAN_K_METRIC = "moe/mean_k"  # reported by elastic-k training; absent: k = model.moe.top_k


class MatmulParams(NamedTuple):
  """Forward matmul weights per token, by part, summed over layers (`matmul_params`)."""

  attention: int
  dense_ffn: int
  router: int
  shared: int  # shared experts and their sigmoid gates
  routed_per_k: int  # one routed expert in every MoE layer: 3·d·d_expert·n_moe_layers
  lm_head: int

  @property
  def fixed(self) -> int:
    """Every part but the routed experts."""
    return self.attention + self.dense_ffn + self.router + self.shared + self.lm_head

  def active(self, k: float) -> float:
    return self.fixed + self.routed_per_k * k


class TokenFlops(NamedTuple):
  """Training FLOPs per token: `fixed` plus `per_k` for each routed expert a token uses."""

  fixed: float
  per_k: float
  top_k: int  # the trained K (0 for a dense model)

  def at(self, k: float | None = None) -> float:
    """FLOPs per token at k routed experts (default the trained K)."""
    return self.fixed + self.per_k * (self.top_k if k is None else k)


def matmul_params(cfg: ModelConfig) -> MatmulParams:
  """The N of the module docstring, split by part."""
  d = cfg.d_model
  moe_layers = [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
  n_moe, n_dense = len(moe_layers), cfg.n_layers - len(moe_layers)
  router = shared = routed = 0
  if n_moe:
    m = cfg.moe
    router = n_moe * d * m.n_experts
    if m.d_shared > 0 and m.merge_rule.shared != "none":
      gate = d if m.merge_rule.shared == "sigmoid" else 0
      shared = n_moe * (3 * d * m.d_shared + gate)
    routed = n_moe * 3 * d * m.d_expert
  return MatmulParams(
    attention=sum(mixer_flops.matmul_params(cfg, m) for m in mixer_flops.per_layer(cfg)),
    dense_ffn=n_dense * 3 * d * cfg.d_ff,
    router=router,
    shared=shared,
    routed_per_k=routed,
    lm_head=d * cfg.padded_vocab,  # the head multiplies the padded rows too (as Megatron counts)
  )


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
  """Training FLOPs of the layers' sequence mixing per token: for GQA QKᵀ and PV,
  12·n_layers·H·d_head·L (PaLM appendix B); other mixers: `mixer_flops`."""
  return sum(mixer_flops.mixing_flops(cfg, m, seq_len) for m in mixer_flops.per_layer(cfg))


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> TokenFlops:
  """6·N + attention, with N's routed part per routed expert (module docstring)."""
  n = matmul_params(cfg)
  top_k = cfg.moe.top_k if n.routed_per_k else 0
  return TokenFlops(
    6.0 * n.fixed + attention_flops_per_token(cfg, seq_len), 6.0 * n.routed_per_k, top_k
  )


# Dense (no structured sparsity) bf16 peak per chip, in TFLOPS.
PEAK_BF16_TFLOPS: dict[str, float] = {
  # Cloud TPU system architecture pages, "Peak compute per chip (bf16)":
  "TPU v4": 275.0,  # https://cloud.google.com/tpu/docs/v4
  "TPU v5e": 197.0,  # https://cloud.google.com/tpu/docs/v5e
  "TPU v5p": 459.0,  # https://cloud.google.com/tpu/docs/v5p
  "TPU v6e": 918.0,  # https://cloud.google.com/tpu/docs/v6e (Trillium)
  # NVIDIA datasheets, "BFLOAT16 Tensor Core", the with-sparsity figure halved:
  "A100": 312.0,  # A100 datasheet: 312 | 624 with sparsity (SXM4 and PCIe alike)
  "H100 SXM": 989.5,  # H100 datasheet: SXM 1,979 with sparsity
  "H100 PCIe": 756.5,  # H100 datasheet: PCIe 1,513 with sparsity
  "H100 NVL": 835.5,  # H100 datasheet: NVL 1,671 with sparsity
  "H200": 989.5,  # H200 datasheet: SXM 1,979 with sparsity
  "H200 NVL": 835.5,  # H200 datasheet: NVL 1,671 with sparsity
}

# `jax.devices()[0].device_kind` of TPUs, lowercased (jax's Pallas TPU ChipVersion match:
# "TPU v5 lite" is v5e, "TPU v5" is v5p, "TPU v6 lite" is v6e; "TPU v4 lite" is v4i: unlisted).
_TPU_KINDS = {
  "tpu v4": "TPU v4",
  "tpu v5 lite": "TPU v5e",
  "tpu v5e": "TPU v5e",
  "tpu v5": "TPU v5p",
  "tpu v5p": "TPU v5p",
  "tpu v6 lite": "TPU v6e",
  "tpu v6e": "TPU v6e",
}


# NVIDIA kinds name the product ("NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-80GB"): (pattern on the lowercased kind, chip), the first match wins.
_NVIDIA_KINDS = (
  (r"\bh200\b.*\bnvl\b", "H200 NVL"),
  (r"\bh200\b", "H200"),
  (r"\bh100\b.*\bnvl\b", "H100 NVL"),
  (r"\bh100\b.*\bpcie\b", "H100 PCIe"),
  (r"\bh100\b", "H100 SXM"),
  (r"\ba100\b", "A100"),
)


def chip_of(device_kind: str) -> str | None:
  """The `PEAK_BF16_TFLOPS` key of a `device_kind` string, or None (CPU, unlisted chips)."""
  kind = " ".join(device_kind.lower().split())
  if kind in _TPU_KINDS:
    return _TPU_KINDS[kind]
  return next((chip for pattern, chip in _NVIDIA_KINDS if re.search(pattern, kind)), None)


def peak_bf16_tflops(device_kind: str) -> float | None:
  chip = chip_of(device_kind)
  return None if chip is None else PEAK_BF16_TFLOPS[chip]


class Perf(NamedTuple):
  """What a training log row needs for its perf/ metrics; built once per run."""

  flops: TokenFlops
  n_devices: int
  peak_tflops: float | None  # per device; None where the device kind is not listed

  @classmethod
  def for_run(cls, cfg: ModelConfig, seq_len: int) -> Perf:
    """This process's devices: all of jax.devices() (global tokens/s are split over them)."""
    kind = jax.devices()[0].device_kind
    return cls(training_flops_per_token(cfg, seq_len), jax.device_count(), peak_bf16_tflops(kind))


def perf_metrics(perf: Perf, tokens_per_sec: float, mean_k: float | None = None) -> dict:
  """perf/tflops_per_device = FLOPs/token × tokens/s / devices / 1e12, and perf/mfu (a
  fraction of the bf16 peak) where the peak is known."""
  tflops = perf.flops.at(mean_k) * tokens_per_sec / perf.n_devices / 1e12
  out = {TFLOPS_METRIC: tflops}
  if perf.peak_tflops:
    out[MFU_METRIC] = tflops / perf.peak_tflops
  return out
