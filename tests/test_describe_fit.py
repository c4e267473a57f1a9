"""`describe --topology / --devices`: per-device bytes of the compiled train step (moejax.aot),
checked against hand counts of the state, and the fit verdict on both sides of the HBM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moejax import aot, describe
from moejax import config as config_lib
from moejax.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled"}
D, H, HD, F, E, DE, V = 32, 2, 16, 64, 8, 32, 257  # byte vocab, tied embeddings


def small(**mesh):
  """1 layer, d 32, 2 query heads / 1 kv head of 16, E = 8 experts of width 32, top-2."""
  c = config_lib.base_config()
  c.model.update(d_model=D, n_layers=1, n_heads=H, n_kv_heads=1, head_dim=HD, d_ff=F)
  c.model.moe.update(n_experts=E, top_k=2, d_expert=DE)
  c.data.update(batch_size=8, seq_len=16)
  c.mesh.update(**{"data": -1, "fsdp": 1, "expert": 1, **mesh})
  return c


# By hand: embedding V·D (tied: no head); q D·H·hd, k and v D·hd, o H·hd·D; two RMSNorm
# scales per block and the final one; router D·E; experts 3·E·D·F_e.
EXPERTS = 3 * E * D * DE
OTHERS = V * D + (D * H * HD + 2 * D * HD + H * HD * D) + 3 * D + D * E


def test_state_bytes_replicated_match_a_hand_count():
  fp = aot.size_gpu(small(), aot.gpu_target(8, 80))  # data 8: every leaf whole on a device
  assert fp.params == 4 * (OTHERS + EXPERTS)
  # AdamW's two moments per parameter, plus int32 step counters
  assert 0 <= fp.opt_state - 2 * fp.params <= 64 and (fp.opt_state - 2 * fp.params) % 4 == 0
  assert fp.router == 4 * E  # one float32 selection bias per expert of the one MoE layer
  assert fp.batch == 4 * (8 // 8) * (16 + 1)  # int32 [B/8, L+1]
  assert fp.estimate and fp.fits and fp.impl == "fused"


def test_state_bytes_with_experts_split_over_the_expert_axis():
  fp = aot.size_gpu(small(data=1, expert=8), aot.gpu_target(8, 80))
  assert fp.params == 4 * (OTHERS + EXPERTS // 8)  # E = 8 over expert = 8; the rest whole
  assert fp.batch == 4 * 8 * 17  # data × fsdp = 1: the whole batch on every device


def test_gpu_fit_table_is_labelled_an_estimate_and_fails_a_tiny_hbm():
  c = small()
  text = describe.format_fit(aot.size_gpu(c, aot.gpu_target(8, 80)), c)
  assert "ESTIMATE: CPU compile of one device's 1 rows" in text
  assert "fits (estimate)" in text and "80.00 GiB usable HBM" in text
  assert all(len(line) <= 100 for line in text.splitlines())
  tiny_hbm = aot.size_gpu(c, aot.gpu_target(8, 1e-4))  # 107 KB: below the parameters alone
  assert not tiny_hbm.fits and "DOES NOT FIT" in describe.format_fit(tiny_hbm, c)


def test_oom_message_and_accelerator_names_parse_by_hand():
  msg = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (205.12G) exceeds available HBM (15.75G)."
  )
  assert aot._parse_oom(msg) == (int(205.12 * 2**30), int(15.75 * 2**30))
  assert aot._parse_oom("INVALID_ARGUMENT: something else") is None
  expected = {
    "tpu-v5e-16": "v5e:4x4",
    "tpu-v5litepod-8": "v5e:2x4",
    "tpu-v6e-256": "v6e:16x16",
    "tpu-v4-8": "v4:2x2x1",  # 8 TensorCores = 4 chips
    "tpu-v4-16": "v4:2x2x2",
    "tpu-v4-32": "v4:2x2x4",
    "tpu-v5p-128": "v5p:4x4x4",
    "H100:8": None,
  }
  assert {k: aot.topology_of_accelerator(k) for k in expected} == expected
  with pytest.raises(UserError, match="not allowed"):
    aot.tpu_devices("v9:2x2")


def _describe(*args):
  argv = [sys.executable, "-m", "moejax.describe", "--config", "configs/quickstart.py", *args]
  return subprocess.run(
    argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, check=False
  )


def test_cli_gpu_target_and_bad_flags_are_one_line():
  out = _describe("--config.model.n_layers=1", "--devices", "8", "--hbm", "80")
  assert out.returncode == 0, out.stderr
  assert "fit: 8 x cuda (8 devices, 80.00 GiB" in out.stdout and "ESTIMATE" in out.stdout
  for args, text in (
    (("--devices", "8"), "--devices needs --hbm"),
    (("--topology", "v9:1x1"), "--topology v9:1x1 is not allowed"),
    (("--topology", "v5e:2x2", "--devices", "8", "--hbm", "80"), "exclude each other"),
  ):
    bad = _describe(*args)
    assert bad.returncode == 2 and bad.stderr.startswith("error: "), (args, bad.stderr)
    assert text in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.fixture(scope="module")
def v5e():
  if not aot.libtpu_available() and not os.environ.get("MOEJAX_REQUIRE_TPU"):
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]'); CI sets MOEJAX_REQUIRE_TPU")
  return aot.tpu_target("v5e:2x2")


def test_tpu_target_reads_the_usable_hbm_from_the_compiler(v5e):
  assert v5e.n_devices == 4 and v5e.devices[0].device_kind == "TPU v5 lite"
  assert v5e.hbm_bytes == int(15.75 * 2**30)  # 16 GiB chips, 0.25 GiB kept by the runtime


def test_tpu_fit_both_sides_of_the_hbm(v5e):
  c = small(data=4)
  c.model.moe.impl = "ragged"
  fp = aot.compile_tpu(c, v5e)
  assert fp.params == 4 * (OTHERS + EXPERTS) and fp.router == 4 * E  # replicated, data 4
  assert fp.fits and not fp.refused and fp.arguments >= fp.params + fp.opt_state + fp.router
  text = describe.format_fit(fp, c)
  assert "TPU compiler: memory_analysis()" in text and "\n  fits: " in text
  # 1 sequence of 32768 tokens per chip: attention keeps 2 heads × 32768² float32
  # probabilities (8 GiB) and more for the backward pass, past 15.75 GiB
  c.data.update(batch_size=4, seq_len=32768)
  big = aot.compile_tpu(c, v5e)
  assert big.refused and not big.fits and big.temporaries > v5e.hbm_bytes
  assert "DOES NOT FIT" in describe.format_fit(big, c) and "RESOURCE_EXHAUSTED" in (
    describe.format_fit(big, c)
  )
