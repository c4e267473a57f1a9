"""benchmarks/accelerator.py: its arm plan per platform, and one tiny `--backend cpu` run
end to end (each arm in its own process, as on a device). No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import quick_gpu
from tiers import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "accelerator.py")
TINY = [
  "--backend=cpu",
  "--d-model=32",
  "--n-layers=1",
  "--n-heads=2",
  "--n-kv-heads=1",
  "--seq-len=16",
  "--batch=4",
  "--vocab=0",
  "--coarse=8/2/16",
  "--fine=16/4/8",
  "--dtype=float32",
  "--repeats=1",
  "--budget-s=3000",  # a loaded CPU runner is slow; the default 540 s is for a device host
  "--no-result",  # a test run's figures stay out of benchmarks/results/ (docs/performance.md)
]
CPU_ARMS = [  # the CPU kernels in moejax.kernels.dispatch.KERNELS' order, then ragged
  "dense",
  "coarse-fused",
  "coarse-native",
  "coarse-blocked",
  "coarse-ragged",
  "fine-fused",
  "fine-native",
  "fine-blocked",
  "fine-ragged",
]


def load_script():
  spec = importlib.util.spec_from_file_location("accelerator_bench", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def bench():
  return load_script()


# Kernels as the table describes them: the platforms each is meant for.
KERNELS = {
  "fused": SimpleNamespace(backends=("cpu", "cuda", "rocm", "tpu")),
  "blocked": SimpleNamespace(backends=("cpu", "cuda", "rocm", "tpu")),
  "ragged": SimpleNamespace(backends=("tpu",)),
  "megablox": SimpleNamespace(backends=("tpu",)),
}


@pytest.mark.parametrize(
  "platform, impls",
  [
    ("cpu", ["fused", "blocked", "ragged"]),
    ("cuda", ["fused", "blocked", "ragged"]),
    ("tpu", ["fused", "blocked", "ragged", "megablox"]),
  ],
)
def test_impls_per_platform(bench, platform, impls):
  """Kernels meant for the platform, plus ragged_dot off TPU (the densified comparison)."""
  assert bench.impls_for(platform, KERNELS) == impls


def test_gpu_plan_adds_the_cudnn_ragged_arm(bench):
  coarse, fine = bench.Shape(8, 2, 1024), bench.Shape(64, 8, 256)
  arms = bench.plan_arms("cuda", ["fused", "ragged"], coarse, fine)
  assert [a.name for a in arms] == [
    "dense",
    "coarse-fused",
    "coarse-ragged",
    "coarse-ragged-cudnn",
    "fine-fused",
    "fine-ragged",
    "fine-ragged-cudnn",
  ]
  flagged = [a for a in arms if a.xla_flags]
  assert all(a.xla_flags == "--xla_gpu_experimental_use_ragged_dot_fusion=true" for a in flagged)
  assert not any(a.xla_flags for a in bench.plan_arms("tpu", ["ragged"], coarse, fine))


def test_gpu_arms_include_tokamax_and_capacity_arms_with_batched(bench):
  """With the real kernel table: tokamax among the GPU's dropless arms, batched only in
  capacity mode (beside fused), and no capacity arms on CPU."""
  from moejax.kernels.dispatch import KERNELS

  impls = bench.impls_for("cuda", KERNELS)
  dropless, capacity = bench.split_modes("cuda", impls, KERNELS)
  assert "tokamax" in dropless and "batched" not in dropless
  assert capacity == ["fused", "batched"]
  assert bench.split_modes("cpu", bench.impls_for("cpu", KERNELS), KERNELS)[1] == []
  arms = bench.plan_arms(
    "cuda", ["fused"], bench.Shape(8, 2, 1024), bench.Shape(64, 8, 256), capacity
  )
  cap = [(a.name, a.mode, a.impl) for a in arms if a.mode == "capacity"]
  assert cap == [
    ("coarse-capacity-fused", "capacity", "fused"),
    ("coarse-capacity-batched", "capacity", "batched"),
    ("fine-capacity-fused", "capacity", "fused"),
    ("fine-capacity-batched", "capacity", "batched"),
  ]
  assert bench.default_attention("cuda") == "tokamax" and bench.default_attention("cpu") == "xla"


def test_one_dense_twin_per_active_width(bench):
  """K·d_expert 2048 for both shapes: one dense arm; different widths: one each."""
  same = bench.plan_arms("cpu", ["fused"], bench.Shape(8, 2, 1024), bench.Shape(64, 8, 256))
  assert [a.name for a in same if a.model == "dense"] == ["dense"]
  other = bench.plan_arms("cpu", ["fused"], bench.Shape(8, 2, 1024), bench.Shape(64, 8, 128))
  assert [a.name for a in other if a.model == "dense"] == ["dense", "dense-1024"]


def run_bench(argv: list[str], out: str, env: dict, timeout: int):
  """The benchmark run to completion with `argv`: (its JSON report, its stdout)."""
  proc = subprocess.run(
    [sys.executable, SCRIPT, *argv, f"--out={out}"],
    cwd=ROOT,
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  with open(f"{out}.json") as f:
    return json.load(f), proc.stdout


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("bench") / "accelerator")
  env = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "WANDB_MODE": "disabled"}
  report, stdout = run_bench(TINY, out, env, timeout=1200)
  with open(f"{out}.md") as f:
    md = f.read()
  return report, md, stdout


@FULL
def test_cpu_run_writes_every_arm(cpu_run):
  report, md, stdout = cpu_run
  assert set(report) == {"probe", "shape", "command", "seconds", "arms"}
  assert report["probe"]["platform"] == "cpu"
  assert report["probe"]["peak_bf16_tflops"] is None
  assert report["shape"]["d_model"] == 32 and report["shape"]["repeats"] == 1
  assert [a["name"] for a in report["arms"]] == CPU_ARMS
  for arm in report["arms"]:
    assert arm["error"] is None, arm
    assert arm["tokens_per_s"] > 0 and arm["step_s"] > 0, arm["name"]
    assert arm["tflops_per_device"] > 0 and arm["flops_per_token"] > 0, arm["name"]
    assert arm["mfu"] is None, arm["name"]  # no CPU peak
    assert arm["peak_bytes"] > 0 and arm["peak_source"] == "memory_analysis", arm["name"]
    assert f"| {arm['name']} |" in md and f"| {arm['name']} |" in stdout


@FULL
def test_cpu_run_arms_have_their_shapes(cpu_run):
  arms = {a["name"]: a for a in cpu_run[0]["arms"]}
  assert arms["dense"]["d_ff"] == 2 * 16  # the twin: K·d_expert
  assert arms["dense"]["n_params"] == arms["dense"]["n_active_params"]
  for name in ("coarse-fused", "fine-ragged"):
    shape = arms[name]["shape"]
    assert arms[name]["n_params"] > arms[name]["n_active_params"], name
    assert (shape["n_experts"], shape["top_k"]) in ((8, 2), (16, 4))
  # Same active width: the same model FLOPs per token, up to the router (d·E per layer).
  router = 6 * 32 * (16 - 8)
  assert arms["fine-fused"]["flops_per_token"] - arms["coarse-fused"]["flops_per_token"] == router


def test_a_result_row_is_flat_and_the_dense_twin_has_no_mode(bench):
  gib = 2**30
  r = {"name": "dense", "model": "dense", "mode": "dropless", "impl": "", "d_ff": 64,
       "shape": {"n_experts": 8, "top_k": 2, "d_expert": 32}, "xla_flags": "", "error": None,
       "peak_bytes": 3 * gib, "argument_bytes": gib, "output_bytes": gib,
       "temp_bytes": 2 * gib, "alias_bytes": gib}  # fmt: skip
  row = bench.result_row(r)
  assert row["mode"] is None and row["E/K/f"] == "dense d_ff 64"
  assert row["peak_GiB"] == 3.0
  assert row["analysis_GiB"] == 1.0 + 1.0 + 2.0 - 1.0  # arguments + outputs + temps - aliased
  moe = bench.result_row({**r, "name": "coarse-fused", "model": "coarse", "d_ff": 0})
  assert moe["mode"] == "dropless" and moe["E/K/f"] == "8/2/32"


@FULL
def test_an_arms_xla_flags_reach_its_process(bench):
  """The cuDNN ragged arm's flag is set in the worker's environment, after the caller's."""
  args = SimpleNamespace(backend="cpu", arm_timeout=600)
  proc = bench._child(args, ["--probe"], bench.RAGGED_FUSION_FLAG)
  probe = bench._result(proc)
  assert probe["env_xla_flags"].endswith(bench.RAGGED_FUSION_FLAG), probe
  assert probe["platform"] == "cpu"


def test_arms_past_the_budget_are_skipped_not_run(bench):
  args = SimpleNamespace(budget_s=280)
  arm = bench.Arm("fine-fused", "fine", "fused", bench.Shape(64, 8, 256), "")
  out = bench.measure(args, [], arm, seconds_left=0.5)
  assert out["name"] == "fine-fused" and out["error"] == "skipped: --budget-s 280 spent"


@FULL
def test_bad_shape_is_a_one_line_error():
  proc = subprocess.run(
    [sys.executable, SCRIPT, "--coarse=8/9/16"], capture_output=True, text=True, check=False
  )
  assert proc.returncode == 2 and "need 1 <= K <= E" in proc.stderr


@FULL
def test_compile_only_dry_run_compiles_the_gpu_plan_for_an_h100(tmp_path):
  """The device benchmark's dry run (`--compile-only h100:1`, jax's CUDA plugin): the CUDA
  plan's arms compiled by XLA:GPU for a compile-only H100, each row with its per-device bytes
  and kernels and no timing; tokamax's bf16 grouped matmuls are Mosaic GPU kernels there."""
  from moejax import aot  # pylint: disable=import-outside-toplevel

  if not aot.cuda_available() and not os.environ.get("MOEJAX_REQUIRE_GPU"):
    pytest.skip('no GPU compiler (pip install -e ".[cuda]"); CI sets MOEJAX_REQUIRE_GPU')
  out = str(tmp_path / "dry")
  shape = ["--d-model=128", "--coarse=8/2/128", "--fine=16/4/64", "--seq-len=128"]
  argv = [*TINY, *shape, "--dtype=bfloat16", "--impls=tokamax,batched", "--arm-timeout=900"]
  env = {"WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": quick_gpu.XLA_FLAGS}
  report, _ = run_bench([*argv, "--compile-only=h100:1"], out, env, timeout=2400)
  assert report["probe"]["platform"] == "cuda" and report["probe"]["compile_only"] == "h100:1"
  arms = {a["name"]: a for a in report["arms"]}
  assert set(arms) == {"dense", "coarse-tokamax", "fine-tokamax",
                       "coarse-capacity-batched", "fine-capacity-batched"}  # fmt: skip
  for arm in arms.values():
    assert arm["error"] is None and arm["step_s"] is None, arm
    assert arm["peak_bytes"] > 0 and arm["fits"] and "tpu" not in arm["kernels"], arm
  for name in ("coarse-tokamax", "fine-tokamax"):
    assert arms[name]["kernels"].get("mosaic_gpu", 0) > 0, arms[name]
