"""`describe --topology / --gpu`: per-device bytes of the compiled train step (moejax.aot),
checked against hand counts of the state, and the fit verdict on both sides of the memory.
The GPU tests need jax's CUDA plugin (the `cuda` extra): they skip without it unless
MOEJAX_REQUIRE_GPU is set (CI sets it), as the TPU ones do for libtpu and MOEJAX_REQUIRE_TPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import quick_gpu

from moejax import aot, describe
from moejax import config as config_lib
from moejax.errors import UserError
from runconfig import as_run

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


# By hand: embedding V_ROWS·D (tied: no head); q D·H·hd, k and v D·hd, o H·hd·D; two RMSNorm
# scales per block and the final one; router D·E; experts 3·E·D·F_e.
EXPERTS = 3 * E * D * DE
V_ROWS = 384  # the byte vocab's 257 ids padded to a multiple of 128 rows
OTHERS = V_ROWS * D + (D * H * HD + 2 * D * HD + H * HD * D) + 3 * D + D * E


def abstract_gpus(n: int = 8) -> aot.Target:
  """N GPUs without devices: the state's shardings on an AbstractMesh, nothing compiled."""
  return aot.Target(f"{n} x cuda", "cuda", (), n, 0, "")


def state_bytes(c) -> dict:
  state = aot.abstract_run(as_run(c), abstract_gpus()).run.state
  return {k: aot.device_bytes(state[k]) for k in ("params", "opt_state", "router")}


def test_state_bytes_replicated_match_a_hand_count():
  b = state_bytes(as_run(small()))  # data 8: every leaf whole on a device
  assert b["params"] == 4 * (OTHERS + EXPERTS)
  # AdamW's two moments per parameter, plus int32 step counters
  extra = b["opt_state"] - 2 * b["params"]
  assert 0 <= extra <= 64 and extra % 4 == 0
  assert b["router"] == 4 * E  # one float32 selection bias per expert of the one MoE layer


def test_state_bytes_with_experts_split_over_the_expert_axis():
  b = state_bytes(as_run(small(data=1, expert=8)))
  assert b["params"] == 4 * (OTHERS + EXPERTS // 8)  # E = 8 over expert = 8; the rest whole


@pytest.fixture(scope="module")
def h100():
  if not aot.cuda_available() and not os.environ.get("MOEJAX_REQUIRE_GPU"):
    pytest.skip('no GPU compiler (pip install -e ".[cuda]"); CI sets MOEJAX_REQUIRE_GPU')
  return aot.gpu_target("h100:8")


@pytest.mark.full  # needs the cuda extra (the full tier installs it)
def test_gpu_target_memory_is_the_protos_times_jax_pool(h100):
  assert h100.n_devices == 8 and h100.devices[0].device_kind == "NVIDIA H100 80GB HBM3"
  assert h100.hbm_bytes == int(84942979072 * 0.75)  # device_memory_size x JAX's default pool
  two = aot.gpu_target("h100:2x8")
  assert two.n_devices == 16 and {d.process_index for d in two.devices} == {0, 1}


@pytest.mark.full  # needs the cuda extra (the full tier installs it)
def test_gpu_fit_is_the_compilers_and_fails_a_tiny_memory(h100):
  c = small()
  c.model.moe.impl = "fused"  # the block loop: the loop report has one to show
  fp = aot.footprint(as_run(c), h100)
  assert fp.params == 4 * (OTHERS + EXPERTS) and fp.batch == 4 * (8 // 8) * (16 + 1)
  assert fp.arguments >= fp.params + fp.opt_state + fp.router and fp.temporaries > 0
  assert fp.fits and not fp.refused and any(lp.grows for lp in fp.loops), fp.loops
  text = describe.format_fit(fp, as_run(c))
  assert "GPU compiler (XLA:GPU): memory_analysis()" in text and "\n  fits: " in text
  assert "while loops:" in text and "step time: not estimated" in text
  assert all(len(line) <= 100 for line in text.splitlines()), text
  tiny = fp._replace(target=h100._replace(hbm_bytes=fp.params))  # below the whole step
  assert not tiny.fits and "DOES NOT FIT" in describe.format_fit(tiny, as_run(c))


def test_oom_message_and_accelerator_names_parse_by_hand():
  msg = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (205.12G) exceeds available HBM (15.75G)."
  )
  assert aot.parse_oom(msg) == (int(205.12 * 2**30), int(15.75 * 2**30))
  assert aot.parse_oom("INVALID_ARGUMENT: something else") is None
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
  gpus = {("H100:8", 1): "h100:8", ("H100:8", 2): "h100:2x8", ("A100-80GB:8", 1): "a100:8",
          ("H200:8", 4): "h200:4x8", ("B200", 1): "b200:1", ("A100:8", 1): None,
          ("L4:1", 1): None}  # fmt: skip
  assert {k: aot.gpu_of_accelerator(*k) for k in gpus} == gpus
  assert aot.parse_gpu("h100:2x8") == ("h100", 2, 8) and aot.parse_gpu("B200:8") == ("b200", 1, 8)
  for bad in ("h900:8", "h100", "h100:0", "h100:2x", "h100:0x8"):
    with pytest.raises(UserError, match=f"--gpu {bad} is not allowed"):
      aot.parse_gpu(bad)


def _describe(*args, env=ENV):
  argv = [sys.executable, "-m", "moejax.describe", "--config", "configs/quickstart.py", *args]
  return subprocess.run(
    argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
  )


def _gpu_compiler() -> bool:
  return aot.cuda_available() or bool(os.environ.get("MOEJAX_REQUIRE_GPU"))


def _describe_h100() -> subprocess.CompletedProcess:
  quick = {**ENV, "XLA_FLAGS": quick_gpu.XLA_FLAGS}  # the same text, half the compile time
  return _describe("--config.model.n_layers=1", "--gpu", "h100:8", env=quick)


@pytest.mark.full  # needs the cuda extra (the full tier's line installs it)
def test_cli_gpu_target_fits_8_h100():
  if not _gpu_compiler():
    pytest.skip('no GPU compiler (pip install -e ".[cuda]"); CI sets MOEJAX_REQUIRE_GPU')
  out = _describe_h100()
  assert out.returncode == 0, out.stderr
  assert "fit: h100:8 (8 devices, 59.33 GiB usable each:" in out.stdout
  assert "GPU compiler (XLA:GPU): memory_analysis()" in out.stdout


def test_cli_gpu_target_without_the_compiler_and_bad_flags_are_one_line():
  if not _gpu_compiler():  # refused before the worksheet: exactly how to install the compiler
    out = _describe_h100()
    assert out.returncode == 2 and out.stdout == "", out.stdout
    want = 'error: --gpu h100:8 needs the cuda extra (jax\'s CUDA plugin, the GPU compiler): pip install -e ".[cuda]"'
    assert out.stderr.strip() == want
  for args, text in (
    (("--gpu", "h100"), "--gpu h100 is not allowed"),
    (("--topology", "v9:1x1"), "--topology v9:1x1 is not allowed"),
    (("--topology", "v5e:2x2", "--gpu", "h100:8"), "exclude each other"),
  ):
    bad = _describe(*args)
    assert bad.returncode == 2 and bad.stderr.startswith("error: "), (args, bad.stderr)
    assert text in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_deviceless_targets_put_the_host_backend_on_cpu():
  """Without JAX_PLATFORMS, `describe --gpu` compiled on a host without a GPU driver failed:
  the CUDA plugin's backend called cuInit (error 303) and was left unregistered, so the
  target was refused. describe now puts the host backend on the CPU, as launch.sweep does;
  an explicit JAX_PLATFORMS is kept."""
  code = "from moejax import describe; describe.host_backend_cpu(); import jax; "
  code += "print(jax.config.jax_platforms)"
  bare = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}
  for env, want in ((bare, "cpu"), ({**bare, "JAX_PLATFORMS": "tpu,cpu"}, "tpu,cpu")):
    out = subprocess.run(
      [sys.executable, "-c", code],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == want, out.stderr[-2000:]


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
  fp = aot.footprint(as_run(c), v5e)
  assert fp.params == 4 * (OTHERS + EXPERTS) and fp.router == 4 * E  # replicated, data 4
  assert fp.fits and not fp.refused and fp.arguments >= fp.params + fp.opt_state + fp.router
  text = describe.format_fit(fp, as_run(c))
  assert "TPU compiler: memory_analysis()" in text and "\n  fits: " in text
  # 1 sequence of 32768 tokens per chip: attention keeps 2 heads × 32768² float32
  # probabilities (8 GiB) and more for the backward pass, past 15.75 GiB
  c.data.update(batch_size=4, seq_len=32768)
  big = aot.footprint(as_run(c), v5e)
  assert big.refused and not big.fits and big.temporaries > v5e.hbm_bytes
  assert "DOES NOT FIT" in describe.format_fit(big, as_run(c)) and "RESOURCE_EXHAUSTED" in (
    describe.format_fit(big, as_run(c))
  )


# Two loops as XLA:GPU writes them: a fixed one (known_trip_count) whose body runs a GEMM
# fusion, and one from a dispatch kernel (StackFrames -> moejax/kernels/fused.py) without a
# count, nested in it, running a custom call.
HLO = """HloModule m

FileNames
1 "/x/moejax/kernels/fused.py"
FunctionNames
1 "run"
FileLocations
1 {file_name_id=1 function_name_id=1 line=71 end_line=71 column=1 end_column=1}
StackFrames
1 {file_location_id=1 parent_frame_id=1}

%inner_body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %cc = f32[8]{0} custom-call(), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %t = (s32[]) tuple(%x)
}

%gemm (a: f32[8,8]) -> f32[8,8] {
  ROOT %d = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer_body (p: (s32[])) -> (s32[]) {
  %f = f32[8,8]{1,0} fusion(%a), kind=kCustom, calls=%gemm
  %w = (s32[]) while(%p), condition=%c, body=%inner_body, metadata={op_name="a/while" stack_frame_id=1}
  ROOT %t = (s32[]) tuple(%x)
}

%tpu_cond (p: (u32[])) -> pred[] {
  %n = u32[]{:T(128)} constant(8)
  %p = (u32[]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%wide.windowed_dot_general_body_ag (p: (u32[])) -> (u32[]) {
  %d = f32[8,8]{1,0} convolution(%a, %a)
  %cp = f32[8,8]{1,0} collective-permute(%d), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (u32[]) tuple(%x)
}

ENTRY %main (a: s32[]) -> (s32[]) {
  %w0 = (s32[]) while(%t), condition=%c0, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
  %mosaic = f32[8] custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "a kernel",
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="a/pallas_call"}
  %w1 = (u32[]) while(%t), condition=%tpu_cond, body=%wide.windowed_dot_general_body_ag
}
"""


def test_loop_report_reads_trip_counts_sources_and_bodies():
  """Including a loop after a custom call whose config spans lines (one starts with `}}`, as
  a Mosaic kernel's does), with its count from its condition, as XLA:TPU writes it."""
  outer, windowed, inner = aot.loops.report_text(HLO)
  assert (windowed.trip, windowed.bound, windowed.trips, windowed.grows) == (None, 8, 8, False)
  assert (windowed.body.matmuls, windowed.body.collectives) == (1, 1)
  assert "windowed einsum" in windowed.what
  assert (outer.trip, outer.depth, outer.grows) == (4, 0, False)
  assert (outer.body.matmuls, outer.body.kernels) == (1, 1)  # the nested loop is its own
  assert (inner.trip, inner.depth, inner.grows) == (None, 1, True)
  assert inner.source == "fwd kernels/fused.py:71 run"
  assert inner.body.custom == (("__gpu$xla.gpu.triton", 1),) and inner.body.matmuls == 0
  text = "\n".join(aot.format_loops((outer, windowed, inner)))
  assert "3; 1 dispatch block loops (trips grow with rows), 2 fixed, 0 unannotated" in text
  assert "[trips: 8 (cond)]" in text and "[trips: 4, nested" not in text
