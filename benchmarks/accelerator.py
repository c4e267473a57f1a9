"""The prepared device benchmark: tokens/s, MFU and peak memory of the dense twin, a coarse
MoE (E 8, K 2) and a fine-grained one (E 64, K 8), with every dispatch impl side by side.

Run on one GPU or TPU host (under 10 minutes by its --budget-s; measured once on one H200):
  python benchmarks/accelerator.py [--backend auto|cpu|gpu|tpu] [--out runs/bench/accelerator]
Tiny shapes, on CPU (tests/test_benchmarks.py runs this with --n-layers 1 --seq-len 16):
  python benchmarks/accelerator.py --backend cpu --d-model 32 --n-layers 2 --n-heads 2 \
    --n-kv-heads 1 --seq-len 32 --batch 4 --vocab 0 --coarse 8/2/16 --fine 16/4/8 \
    --dtype float32 --out /tmp/bench/accelerator

Deviceless, from any host (its dry run: every arm of a GPU or TPU plan compiled by XLA:GPU or
XLA:TPU for compile-only devices, as `describe --gpu/--topology` does; memory and kernels,
no timing; the full tier runs it for one H100):
  JAX_PLATFORMS=cpu python benchmarks/accelerator.py --compile-only h100:1 [shape flags]

Measured on one H200 (benchmarks/results/accelerator_nvidia_h200.json and docs/performance.md);
no TPU figure yet.

Defaults: d_model 1024, 4 layers, 16 query / 4 kv heads (the TPU preset's attention,
configs/study_calibration.py:tpu), vocab 32,768, 16 × 1024 tokens per step, bfloat16;
coarse 8/2/1024 and fine 64/8/256 (E/K/d_expert, the TPU preset's experts), both with
K·d_expert = 2048, so one dense twin (d_ff 2048, train_step.dense_twin) serves both.

Arms: the dense twin, then each MoE shape with every dropless kernel in
`moejax.kernels.dispatch.KERNELS` meant for the platform (`Kernel.backends`; on NVIDIA GPUs
`tokamax`, tokamax's Mosaic GPU or Triton grouped matmuls), plus `ragged` where it is not
(CPU and GPU: the densified ragged_dot, for comparison) and, on NVIDIA GPUs, `ragged` again
with `--xla_gpu_experimental_use_ragged_dot_fusion` (cuDNN's grouped GEMM; bf16 only). On an
accelerator, each shape also runs in capacity mode (`model.moe.dispatch=capacity`, factor
1.25) with every kernel serving it: `fused` (the block loop) and `batched` (one einsum per
projection). Attention is `--attention` (default per platform: `tokamax` flash attention on
NVIDIA GPUs, `splash` on TPU, `xla` elsewhere).

Each arm runs in its own process (`--worker`): the train step is the one `moejax.train`
runs (`trainer.compile_steps`: guarded, state donated, the trainer's shardings over all
local devices), compiled once and timed as the min over `--repeats` steps after a warm-up
(`common.interleaved_min`), on one fixed batch of the synthetic corpus. Peak memory is the
device's `memory_stats()["peak_bytes_in_use"]` in that process (max over local devices)
where the backend reports it, else the compiled step's `memory_analysis()` (arguments +
outputs + temporaries − aliased). An arm that fails (e.g. out of memory) is reported with
its error, not fatal. Arms run within `--budget-s` (default 540 s, so the whole command
stays under 10 minutes: on one H200 with XLA's autotuning an arm took 15-40 s of
compile and about 32 s in all, so the CUDA plan's 15 arms need about 8 minutes), each within
`--arm-timeout`; arms past the budget are listed as
skipped. `--xla-cache DIR` keeps compiles for a rerun. MFU and TFLOPS/device use
`moejax.sizing.flops` (PaLM's model FLOPs). Writes OUT.json and OUT.md, prints the table, and
writes the figures to benchmarks/results/accelerator_<device kind>.json (`--compile-only T`:
accelerator_compile_<T>.json; `--result NAME` for another name, `--no-result` for none).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_min, write_result
from train_step import dense_twin

RAGGED_FUSION_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
# Measured off the platforms they are meant for, for comparison (the densified ragged_dot).
OFF_PLATFORM_ARMS = {"cpu": ("ragged",), "cuda": ("ragged",), "rocm": ("ragged",)}
JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
RESULT = "RESULT "  # the worker's output line


class Shape(NamedTuple):
  """One MoE shape: E experts, top-K, expert width f."""

  n_experts: int
  top_k: int
  d_expert: int

  def label(self) -> str:
    return f"{self.n_experts}/{self.top_k}/{self.d_expert}"


def parse_shape(text: str) -> Shape:
  try:
    E, K, f = (int(v) for v in text.split("/"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: use E/K/d_expert, e.g. 64/8/256") from None
  if not (1 <= K <= E and f >= 1):
    raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= K <= E and d_expert >= 1")
  return Shape(E, K, f)


def parse_set(text: str) -> tuple[str, object]:
  key, sep, raw = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"--set {text!r}: use KEY=VALUE, e.g. model.remat=full")
  try:
    return key, ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    return key, raw


class Arm(NamedTuple):
  """One measured configuration (what a worker process is given, as JSON)."""

  name: str
  model: str  # dense | coarse | fine
  impl: str  # "" for dense
  shape: Shape | None
  xla_flags: str
  mode: str = "dropless"  # model.moe.dispatch

  def to_json(self) -> dict:
    d = self._asdict()
    d["shape"] = None if self.shape is None else self.shape._asdict()
    return d


def impls_for(platform: str, kernels: dict) -> list[str]:
  """The impls to measure on `platform`: KERNELS meant for it, plus OFF_PLATFORM_ARMS."""
  extra = OFF_PLATFORM_ARMS.get(platform, ())
  return [n for n, k in kernels.items() if platform in k.backends or n in extra]


def split_modes(platform: str, impls: list[str], kernels: dict) -> tuple[list, list]:
  """(dropless impls, capacity impls) among `impls`. Capacity arms run on accelerators only,
  and not `blocked` (the fused loop, unfused)."""
  dropless = [n for n in impls if "dropless" in kernels[n].modes]
  capacity = [n for n in impls if "capacity" in kernels[n].modes and n != "blocked"]
  return dropless, capacity if platform != "cpu" else []


def default_attention(platform: str) -> str:
  """`--attention auto`: the flash kernel of the platform, else today's attention."""
  return {"cuda": "tokamax", "tpu": "splash"}.get(platform, "xla")


def plan_arms(
  platform: str, impls: list[str], coarse: Shape, fine: Shape, capacity: list[str] = ()
) -> list[Arm]:
  """Dense twin(s) first (one per distinct K·d_expert), then each shape × dropless impl, then
  each shape × capacity impl."""
  arms, widths = [], []
  for s in (coarse, fine):
    if s.top_k * s.d_expert not in widths:
      widths.append(s.top_k * s.d_expert)
      suffix = "" if not arms else f"-{s.top_k * s.d_expert}"
      arms.append(Arm(f"dense{suffix}", "dense", "", s, ""))
  for model, s in (("coarse", coarse), ("fine", fine)):
    for impl in impls:
      arms.append(Arm(f"{model}-{impl}", model, impl, s, ""))
      if impl == "ragged" and platform == "cuda":
        arms.append(Arm(f"{model}-ragged-cudnn", model, impl, s, RAGGED_FUSION_FLAG))
  for model, s in (("coarse", coarse), ("fine", fine)):
    for impl in capacity:
      arms.append(Arm(f"{model}-capacity-{impl}", model, impl, s, "", "capacity"))
  return arms


# ---------------------------------------------------------------- one arm (worker process)


def arm_config(args, arm: Arm):
  """base_config() at the benchmark's shape, then the arm's model and impl."""
  from moejax.config import base_config  # pylint: disable=import-outside-toplevel

  c = base_config()
  c.model.update(
    d_model=args.d_model,
    n_layers=args.n_layers,
    n_heads=args.n_heads,
    n_kv_heads=args.n_kv_heads,
    vocab_size=args.vocab,
    dtype=args.dtype,
  )
  if args.attention != "auto":
    c.model.attention = args.attention
  s = arm.shape
  c.model.moe.update(rule="qwen3_moe", n_experts=s.n_experts, top_k=s.top_k, d_expert=s.d_expert)
  c.model.moe.dispatch = arm.mode
  if arm.impl:
    c.model.moe.impl = arm.impl
  docs = max(200, args.batch * (args.seq_len + 1) // 100)  # ~350 byte tokens per document
  c.data.update(corpus="synthetic", tokenizer="byte", synthetic_docs=docs, batch_size=args.batch)
  c.data.seq_len = args.seq_len
  c.train.progress = False
  c.wandb.mode = "disabled"
  for key, value in args.set:
    *parents, leaf = key.split(".")
    node = c
    for part in parents:
      node = node[part]
    node[leaf] = value
  return dense_twin(c) if arm.model == "dense" else c


def _peak_bytes(compiled) -> tuple[int, str, dict]:
  """(peak bytes, where it came from, the compiled step's memory analysis)."""
  import jax  # pylint: disable=import-outside-toplevel

  m = compiled.memory_analysis()
  analysis = {}
  if m is not None:
    analysis = {
      "argument_bytes": int(m.argument_size_in_bytes),
      "output_bytes": int(m.output_size_in_bytes),
      "temp_bytes": int(m.temp_size_in_bytes),
      "alias_bytes": int(m.alias_size_in_bytes),
    }
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
  if peaks:
    return int(max(peaks)), "memory_stats", analysis
  if analysis:
    used = analysis["argument_bytes"] + analysis["output_bytes"] + analysis["temp_bytes"]
    return used - analysis["alias_bytes"], "memory_analysis", analysis
  return 0, "none", analysis


def run_arm(args, arm: Arm) -> dict:
  """Builds, compiles and times the arm's train step as moejax.train runs it."""
  import jax  # pylint: disable=import-outside-toplevel

  from moejax import distributed, sharding  # pylint: disable=import-outside-toplevel
  from moejax.config import resolve
  from moejax.sizing import flops
  from moejax.training import trainer

  c = arm_config(args, arm)
  run = trainer.build(resolve(c), workdir=None)
  step_fn, _ = trainer.compile_steps(run)
  batch_sharding = sharding.batch_sharding(run.mesh)
  it = run.data.train_iterator(distributed.process_shard(batch_sharding, c.data.batch_size))
  tokens = distributed.global_batch(next(it)["tokens"], batch_sharding, c.data.batch_size)
  rng = jax.random.key(0)
  t = time.perf_counter()
  compiled = step_fn.lower(run.state, tokens, rng).compile()
  compile_s = time.perf_counter() - t
  box = [run.state]

  def step():
    box[0], metrics = compiled(box[0], tokens, rng)
    return box[0], metrics

  step_s = interleaved_min({"step": step}, args.repeats)["step"]
  mc = resolve(c).with_vocab(run.data.tokenizer.vocab_size).model
  perf = flops.Perf.for_run(mc, c.data.seq_len)
  tokens_per_s = c.data.batch_size * c.data.seq_len / step_s
  metrics = flops.perf_metrics(perf, tokens_per_s)
  peak, source, analysis = _peak_bytes(compiled)
  return {
    **arm.to_json(),
    "d_ff": mc.d_ff if arm.model == "dense" else 0,
    "tokens_per_s": tokens_per_s,
    "step_s": step_s,
    "compile_s": compile_s,
    "flops_per_token": perf.flops.at(),
    "tflops_per_device": metrics[flops.TFLOPS_METRIC],
    "mfu": metrics.get(flops.MFU_METRIC),
    "peak_bytes": peak,
    "peak_source": source,
    **analysis,
    "n_params": run.n_params,
    "n_active_params": run.n_active,
    "env_xla_flags": os.environ.get("XLA_FLAGS", ""),
    "error": None,
  }


def compile_target(descriptor: str):
  """`--compile-only`'s compile-only devices: a GPU node (`h100:8`) or a TPU topology."""
  from moejax import aot  # pylint: disable=import-outside-toplevel

  kind = descriptor.partition(":")[0].lower()
  return aot.gpu_target(descriptor) if kind in aot.GPUS else aot.tpu_target(descriptor)


def compile_arm(args, arm: Arm) -> dict:
  """The arm's train step compiled for `--compile-only`'s devices (`aot.footprint`): its
  per-device bytes and the kernels it holds, nothing run."""
  from moejax import aot  # pylint: disable=import-outside-toplevel
  from moejax.config import resolve
  from moejax.sizing import flops, worksheet

  c = arm_config(args, arm)
  target = compile_target(args.compile_only)
  t = time.perf_counter()
  fp = aot.footprint(resolve(c), target, arm.name)
  compile_s = time.perf_counter() - t
  run = aot.abstract_run(resolve(c), target).run
  mc = resolve(c).with_vocab(worksheet.nominal_vocab(resolve(c))[0]).model
  return {
    **arm.to_json(),
    "d_ff": mc.d_ff if arm.model == "dense" else 0,
    "tokens_per_s": None,
    "step_s": None,
    "compile_s": compile_s,
    "flops_per_token": flops.Perf.for_run(mc, c.data.seq_len).flops.at(),
    "tflops_per_device": None,
    "mfu": None,
    "peak_bytes": fp.total,
    "peak_source": f"compiled for {target.name}",
    "fits": fp.fits,
    "kernels": dict(fp.kernels),
    "loops": len(fp.loops),
    "n_params": run.n_params,
    "n_active_params": run.n_active,
    "env_xla_flags": os.environ.get("XLA_FLAGS", ""),
    "error": None,
  }


def _device(args):
  """(platform, the first device) the arms run or compile on."""
  import jax  # pylint: disable=import-outside-toplevel

  if args.compile_only:
    target = compile_target(args.compile_only)
    return target.platform, target.devices[0], target.n_devices
  d = jax.devices()[0]
  platform = d.platform
  if platform == "gpu":
    platform = "rocm" if "rocm" in str(d.client.platform_version).lower() else "cuda"
  return platform, d, jax.device_count()


def probe(args) -> dict:
  """The backend as the workers will see it (its own process: a TPU opens in one only)."""
  import jax  # pylint: disable=import-outside-toplevel

  from moejax.kernels import dispatch  # pylint: disable=import-outside-toplevel
  from moejax.sizing import flops

  platform, d, n_devices = _device(args)
  kernels = dispatch.KERNELS
  impls = impls_for(platform, kernels)
  dropless, capacity = split_modes(platform, impls, kernels)
  try:
    auto = dispatch.resolve_impl("auto", "dropless", platform)
  except Exception as e:  # noqa: BLE001  (an older resolve_impl signature)
    auto = f"unknown ({e})"
  return {
    "platform": platform,
    "device_kind": d.device_kind,
    "n_devices": n_devices,
    "compile_only": args.compile_only or None,
    "peak_bf16_tflops": flops.peak_bf16_tflops(d.device_kind),
    "jax": jax.__version__,
    "impls": impls,
    "dropless_impls": dropless,
    "capacity_impls": capacity,
    "attention": default_attention(platform),
    "auto_impl": auto,
    "env_xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


# ---------------------------------------------------------------- the driver


def _child(
  args, argv: list[str], xla_flags: str = "", timeout: float | None = None
) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  if args.backend != "auto":
    env["JAX_PLATFORMS"] = JAX_PLATFORMS[args.backend]
  if xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  if getattr(args, "xla_cache", ""):  # reruns skip compiles (their compile_s is a cache load)
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(args.xla_cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  cmd = [sys.executable, os.path.abspath(__file__), *argv]
  return subprocess.run(
    cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout or args.arm_timeout
  )


def _result(proc: subprocess.CompletedProcess) -> dict:
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
  if proc.returncode == 0 and lines:
    return json.loads(lines[-1][len(RESULT) :])
  tail = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
  return {"error": f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}"[:300]}


def measure(args, forwarded: list[str], arm: Arm, seconds_left: float) -> dict:
  """One arm in its own process, within --arm-timeout and what is left of --budget-s."""
  if seconds_left < 1:
    return {**arm.to_json(), "error": f"skipped: --budget-s {args.budget_s} spent"}
  timeout = min(args.arm_timeout, seconds_left)
  argv = [*forwarded, "--worker", json.dumps(arm.to_json())]
  try:
    out = _result(_child(args, argv, arm.xla_flags, timeout))
  except subprocess.TimeoutExpired:
    out = {"error": f"timed out after {timeout:.0f} s (--arm-timeout, --budget-s)"}
  return {**arm.to_json(), **out}


def _fmt(v, spec: str, missing: str = "—") -> str:
  return missing if v is None else format(v, spec)


def _bytes(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


HEADER = (
  "| arm | E/K/f | dispatch | impl | tokens/s | TFLOPS/device | MFU | peak memory | compile s "
  "| note |"
)


def shape_text(r: dict) -> str:
  """An arm's E/K/f, or its d_ff for the dense twin."""
  shape = r["shape"]
  if r["model"] == "dense" and r.get("d_ff"):
    return f"dense d_ff {r['d_ff']}"
  return f"{shape['n_experts']}/{shape['top_k']}/{shape['d_expert']}" if shape else ""


def kernels_text(r: dict) -> str:
  """`--compile-only`: the kernels the arm's compiled step holds, with their counts."""
  return ", ".join(f"{k} {n}" for k, n in sorted(r.get("kernels", {}).items()))


def table_row(r: dict) -> str:
  ekf = shape_text(r)
  mode = r.get("mode", "dropless") if r["model"] != "dense" else "—"
  if r.get("error"):
    return (
      f"| {r['name']} | {ekf} | {mode} | {r['impl'] or '—'} | — | — | — | — | — | {r['error']} |"
    )
  note = "XLA_FLAGS " + r["xla_flags"] if r["xla_flags"] else ""
  if r.get("step_s") is None:  # --compile-only
    fit = "fits" if r.get("fits") else "DOES NOT FIT"
    note = "; ".join(s for s in (fit, kernels_text(r), f"{r.get('loops', 0)} loops", note) if s)
    return (
      f"| {r['name']} | {ekf} | {mode} | {r['impl'] or '—'} | — | — | — | "
      f"{_bytes(r['peak_bytes'])} ({r['peak_source']}) | {r['compile_s']:.1f} | {note} |"
    )
  return (
    f"| {r['name']} | {ekf} | {mode} | {r['impl'] or '—'} | {r['tokens_per_s']:,.0f} | "
    f"{r['tflops_per_device']:.3g} | {_fmt(r['mfu'], '.1%')} | "
    f"{_bytes(r['peak_bytes'])} ({r['peak_source']}) | {r['compile_s']:.1f} | {note} |"
  )


def markdown(report: dict) -> str:
  p, s = report["probe"], report["shape"]
  lines = [
    f"# Accelerator benchmark: {p['device_kind']} × {p['n_devices']} ({p['platform']})",
    "",
    (
      f"jax {p['jax']}; bf16 peak {_fmt(p['peak_bf16_tflops'], 'g', 'unknown')} TFLOPS per "
      f"device; `auto` dropless impl here: {p['auto_impl']}; {report['seconds']:.0f} s in all."
    ),
    (
      f"d_model {s['d_model']}, {s['n_layers']} layers, {s['n_heads']}/{s['n_kv_heads']} "
      f"heads, vocab {s['vocab'] or 'byte'}, {s['batch']} × {s['seq_len']} tokens per step, "
      f"{s['dtype']}, attention {s.get('attention', 'xla')}; min of {s['repeats']} steps."
    ),
    "",
    f"Command: `{report['command']}`",
    "",
    HEADER,
    "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    *(table_row(r) for r in report["arms"]),
  ]
  return "\n".join(lines) + "\n"


def write(report: dict, out: str) -> tuple[str, str]:
  stem = out.removesuffix(".json")
  os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
  with open(f"{stem}.json", "w") as f:
    json.dump(report, f, indent=1)
  with open(f"{stem}.md", "w") as f:
    f.write(markdown(report))
  return f"{stem}.json", f"{stem}.md"


ROW_FIGURES = ("name", "E/K/f", "mode", "impl", "tokens_per_s", "step_s", "tflops_per_device",
               "mfu", "peak_GiB", "peak_source", "analysis_GiB", "compile_s", "fits", "loops",
               "kernels", "xla_flags", "error")  # fmt: skip
PROBE_FIGURES = ("platform", "device_kind", "n_devices", "compile_only", "peak_bf16_tflops",
                 "auto_impl")  # fmt: skip


def result_row(r: dict) -> dict:
  """One arm's figures, flat: those of ROW_FIGURES it has (an arm that failed: its error)."""
  flat = {**r, "E/K/f": shape_text(r)}
  if r["model"] == "dense":
    flat["mode"] = None  # the dense twin has no dispatch (its Arm carries the default)
  if "peak_bytes" in r:
    flat["peak_GiB"] = r["peak_bytes"] / 2**30
  if "temp_bytes" in r:  # the compiled step's own memory analysis, beside the device's peak
    used = r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]
    flat["analysis_GiB"] = used / 2**30
  if "kernels" in r:
    flat["kernels"] = kernels_text(r)
  return {k: flat[k] for k in ROW_FIGURES if k in flat}


def result_figures(report: dict) -> dict:
  """The report as benchmarks/results/ figures: a row per arm, the probe's and shape's scalars."""
  probe = {k: report["probe"].get(k) for k in PROBE_FIGURES}
  rows = [result_row(r) for r in report["arms"]]
  return {"rows": rows, **probe, **report["shape"], "total_s": report["seconds"]}


def result_name(args, device_kind: str) -> str:
  """`--result`, else accelerator_<device kind> (--compile-only: accelerator_compile_<target>)."""
  kind = f"compile_{args.compile_only}" if args.compile_only else device_kind
  return args.result or "accelerator_" + re.sub(r"\W+", "_", kind).strip("_").lower()


SHAPE_FLAGS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab", "seq_len", "batch")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--backend", choices=("auto", *JAX_PLATFORMS), default="auto")
  p.add_argument("--out", default="runs/bench/accelerator", help="writes OUT.json and OUT.md")
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--n-layers", type=int, default=4)
  p.add_argument("--n-heads", type=int, default=16)
  p.add_argument("--n-kv-heads", type=int, default=4)
  p.add_argument("--vocab", type=int, default=32768, help="0: the byte tokenizer's")
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--batch", type=int, default=16, help="sequences per step, all devices")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  p.add_argument(
    "--attention", default="auto", help="model.attention; auto: tokamax on cuda, splash on tpu"
  )
  p.add_argument("--coarse", type=parse_shape, default=Shape(8, 2, 1024), help="E/K/d_expert")
  p.add_argument("--fine", type=parse_shape, default=Shape(64, 8, 256), help="E/K/d_expert")
  p.add_argument("--impls", default="", help="comma-separated subset (default: all that run)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--arm-timeout", type=int, default=150, help="seconds per arm at most")
  p.add_argument(
    "--budget-s", type=int, default=540, help="seconds for all arms; later ones are skipped"
  )
  p.add_argument("--xla-cache", default="", help="a persistent compilation cache dir for reruns")
  p.add_argument("--set", type=parse_set, action="append", default=[], help="KEY=VALUE")
  p.add_argument(
    "--compile-only",
    default="",
    help="compile every arm for compile-only devices (h100:1, v5e:2x2) from this host; no timing",
  )
  p.add_argument(
    "--result",
    default="",
    help="benchmarks/results/<NAME>.json (default: accelerator_<device kind>)",
  )
  p.add_argument("--no-result", action="store_true", help="write no benchmarks/results/ file")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
  return p


def forwarded_flags(args) -> list[str]:
  """The flags a worker needs to rebuild the same configs."""
  argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHAPE_FLAGS]
  argv += [f"--dtype={args.dtype}", f"--repeats={args.repeats}", f"--attention={args.attention}"]
  if args.compile_only:
    argv.append(f"--compile-only={args.compile_only}")
  for key, value in args.set:
    argv.append(f"--set={key}={value!r}")
  return argv


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def main() -> None:
  args = parser().parse_args()
  if args.worker:
    d = json.loads(args.worker)
    arm = Arm(**{**d, "shape": Shape(**d["shape"])})
    result = compile_arm(args, arm) if args.compile_only else run_arm(args, arm)
    print(RESULT + json.dumps(result), flush=True)
    return
  if args.probe:
    print(RESULT + json.dumps(probe(args)), flush=True)
    return
  t0 = time.time()
  only = [f"--compile-only={args.compile_only}"] if args.compile_only else []
  info = _result(_child(args, ["--probe", *only]))
  if info.get("error"):
    _fail(f"the backend probe failed ({info['error']})")
  impls = info["impls"]
  if args.impls:
    wanted = args.impls.split(",")
    unknown = sorted(set(wanted) - set(impls))
    if unknown:
      _fail(f"--impls {','.join(unknown)} is not runnable here; use {','.join(impls)}")
    impls = wanted
  capacity = [n for n in info.get("capacity_impls", []) if n in impls]
  impls = [n for n in info.get("dropless_impls", impls) if n in impls]
  if args.attention == "auto":
    args.attention = info.get("attention", "xla")
  print(f"{info['device_kind']} × {info['n_devices']} ({info['platform']}); impls {impls}")
  print(f"capacity impls {capacity}; attention {args.attention}")
  print(HEADER, flush=True)
  results = []
  for arm in plan_arms(info["platform"], impls, args.coarse, args.fine, capacity):
    left = args.budget_s - (time.time() - t0)
    results.append(measure(args, forwarded_flags(args), arm, left))
    print(table_row(results[-1]), flush=True)
  report = {
    "probe": info,
    "shape": {k: getattr(args, k) for k in (*SHAPE_FLAGS, "dtype", "repeats", "attention")},
    "command": " ".join(["python", "benchmarks/accelerator.py", *sys.argv[1:]]),
    "seconds": time.time() - t0,
    "arms": results,
  }
  for path in write(report, args.out):
    print(f"wrote {path}")
  if not args.no_result:
    write_result(result_name(args, info["device_kind"]), result_figures(report))


if __name__ == "__main__":
  main()
