"""Model FLOPs per token (moejax.sizing.flops) against hand counts, the peak table's matcher, and the
perf/ metrics of a short training run on CPU."""

from __future__ import annotations

import dataclasses
import math
import json

import jax
import pytest
from failure_helpers import TINY_RUN, fast_compiles, metric_rows, tiny  # noqa: F401
from flax import nnx
from tiers import FULL

from moejax.nn.model import ModelConfig, Transformer
from moejax.nn.moe import MoEConfig
from moejax.sizing import flops
from moejax.training import trainer
from runconfig import as_run

SEQ_LEN = 7


# 3 layers (layer 0 dense, 1-2 MoE), d 8, 2 query heads and 1 kv head of width 4, d_ff 12,
# V 11, untied head; E 4, K 2, d_expert 6, a sigmoid-gated shared expert of width 5.
HAND = ModelConfig(
  vocab_size=11,
  d_model=8,
  n_layers=3,
  n_heads=2,
  n_kv_heads=1,
  d_ff=12,
  tie_embeddings=False,
  moe=MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=6, d_shared=5, rule="qwen2_moe"),
  first_dense=1,
)


def hand_config(**changes) -> ModelConfig:
  return dataclasses.replace(HAND, **changes)


def test_training_flops_match_a_hand_count():
  q, k, v, o = 8 * 8, 8 * 4, 8 * 4, 8 * 8  # per layer: d×H·hd, d×G·hd (twice), H·hd×d
  attention = 3 * (q + k + v + o)
  dense_ffn = 8 * 12 + 8 * 12 + 12 * 8  # layer 0: gate, up, down
  router = 2 * (8 * 4)  # layers 1, 2
  shared = 2 * (8 * 5 + 8 * 5 + 5 * 8 + 8 * 1)  # gate, up, down, sigmoid gate
  one_expert = 2 * (8 * 6 + 8 * 6 + 6 * 8)  # one routed expert in each MoE layer
  head = 8 * 11
  scores = 3 * 2 * (2 * SEQ_LEN * 4 + 2 * SEQ_LEN * 4) * 3  # layers·H·(QKᵀ + PV)·(fwd+bwd)
  fixed = attention + dense_ffn + router + shared + head
  tf = flops.training_flops_per_token(hand_config(), SEQ_LEN)
  assert tf.at() == 6 * (fixed + 2 * one_expert) + scores == 13104
  assert tf.at(1.5) == 6 * (fixed + 1.5 * one_expert) + scores  # elastic training's mean k


def test_dense_model_flops_match_a_hand_count():
  cfg = hand_config(moe=None, moe_every=0, tie_embeddings=True)
  per_layer = (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8) + (8 * 12 + 8 * 12 + 12 * 8)
  scores = 3 * 2 * 4 * SEQ_LEN * 12
  assert flops.training_flops_per_token(cfg, SEQ_LEN).at() == 6 * (3 * per_layer + 8 * 11) + scores


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("tie", [True, False])
def test_matmul_params_are_the_models_matrices_at_k_of_e(tie, scan):
  """N from the built model: every weight matrix (rank >= 2 per layer; norms and biases are
  vectors), experts' [E, ...] stacks at K/E, the tied embedding as the head, an untied one
  not at all. A scanned stack's leading layer axis counts every layer of its segment."""
  cfg = hand_config(tie_embeddings=tie, scan_layers=scan)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  n, layer_axes = 0.0, set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    names = [str(getattr(p, "key", p)) for p in path]
    ndim = leaf.ndim - ("stacks" in names)  # one layer's rank
    layer_axes.add(leaf.ndim - ndim)
    if ndim < 2 or ("embed" in names and not tie):
      continue
    n += leaf.size * (2 / 4 if ndim == 3 else 1)
  assert layer_axes == ({0, 1} if scan else {0})
  assert flops.matmul_params(cfg).active(2) == n


@pytest.mark.parametrize(
  "kind, chip",
  [
    ("TPU v4", "TPU v4"),
    ("TPU v5 lite", "TPU v5e"),
    ("TPU v5e", "TPU v5e"),
    ("TPU v5", "TPU v5p"),
    ("TPU v5p", "TPU v5p"),
    ("TPU v6 lite", "TPU v6e"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("TPU v4 lite", None),  # v4i, an inference chip
    ("NVIDIA GH200 480GB", None),
    ("cpu", None),
  ],
)
def test_device_kind_matcher(kind, chip):
  assert flops.chip_of(kind) == chip
  expected = {"TPU v5e": 197.0, "H100 SXM": 989.5, "A100": 312.0}.get(chip)
  if expected is not None:
    assert flops.peak_bf16_tflops(kind) == expected


def test_perf_metrics_arithmetic():
  tf = flops.TokenFlops(fixed=4e9, per_k=1e9, top_k=2)  # 6e9 FLOPs/token at k = 2
  perf = flops.Perf(tf, n_devices=4, peak_tflops=200.0)
  m = flops.perf_metrics(perf, tokens_per_sec=1e5)
  assert m[flops.TFLOPS_METRIC] == pytest.approx(6e9 * 1e5 / 4 / 1e12)  # 150
  assert m[flops.MFU_METRIC] == pytest.approx(150 / 200)
  assert flops.perf_metrics(perf, 1e5, mean_k=1.0)[flops.TFLOPS_METRIC] == pytest.approx(125)
  assert flops.MFU_METRIC not in flops.perf_metrics(perf._replace(peak_tflops=None), 1e5)


@FULL
def test_training_rows_have_tflops_and_no_mfu_on_cpu(tmp_path):
  c = tiny(TINY_RUN, data__seq_len=32, train__progress=False, train__steps=3)
  trainer.train(as_run(c), str(tmp_path), log=lambda *a: None)
  rows = metric_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3]
  resolved = json.loads((tmp_path / "config.json").read_text())["resolved"]
  mc = as_run(c).with_vocab(resolved["vocab_size"]).model
  per_token = flops.training_flops_per_token(mc, 32).at()
  for r in rows:
    assert flops.MFU_METRIC not in r
    expected = per_token * r["tokens_per_sec"] / jax.device_count() / 1e12
    assert r[flops.TFLOPS_METRIC] == pytest.approx(expected, rel=1e-9)
    assert r[flops.TFLOPS_METRIC] > 0


@pytest.mark.parametrize("mixers", ["mla", "gated_deltanet,gated_attention"])
def test_mixers_matmul_weights_are_the_models_attention_matrices(mixers):
  """The attention part of N for MLA, Gated DeltaNet and gated attention: every matrix a token
  meets in a mixer (the Linear kernels under `attn`, counted from the built model)."""
  from moejax import build
  from moejax.nn.gated_deltanet import GatedDeltaNetConfig
  from moejax.nn.mla import MLAConfig
  from moejax.nn.model import ModelConfig
  from moejax.sizing import flops

  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    moe=None, moe_every=0, mixers=mixers, partial_rotary_factor=0.25,
                    mla=MLAConfig(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=6),
                    gated_deltanet=GatedDeltaNetConfig(2, 4, 8, 6, 4))  # fmt: skip
  params = build.abstract_params(cfg)
  kernels = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = build.param_names(path)
    if "attn" in names and names[-1] == "kernel":
      kernels += math.prod(leaf.shape)
  assert flops.matmul_params(cfg).attention == kernels
