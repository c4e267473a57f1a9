"""Every configs/*.py preset compiles for TPU and for 8 x H100, without a device.

The train step moejax.train runs (moejax.aot: the trainer's jitted, guarded step, with its
shardings on a data × fsdp × expert mesh) is compiled ahead of time for the compile-only
devices of a small TPU topology (libtpu, the `tpu` extra) and of one 8 x H100 node (jax's
CUDA plugin, the `cuda` extra; `aot.gpu_target("h100:8")`), and so is the k-grid's forward.
A failure names the preset, the mode, the impl and the target.

The matrix (`cases`, `gpu_cases`): every preset in its own dispatch mode with impl `auto`;
then, once per distinct `kernel_traits` of the presets' expert shapes (`expert_shape`:
d_model, E, K, d_expert, dtype, group size; the traits: the dtype, a group size or none,
top-1, and d_model and d_expert whole 128-wide tiles or not), every other kernel of the
platform and the other dispatch mode. A kernel only sees those shapes, and the rest of each
preset is compiled in its first case. Seven trait sets stand for the ten distinct shapes
(stop 64's CI ran out of time with one case per shape: 86 train-step compiles, 1,546
worker-seconds); `MOEJAX_AOT_FULL=1` runs the full product. The matrix is the full tier
(`pytest -m full`); the default tier compiles quickstart once for TPU and exports it for
("cuda",) (no GPU compiler needed).

The GPU default has no masked-dense expansion (`test_gpu_dropless_default_is_not_dense`):
its temporaries stay within EXPANSION x those of the `fused` block loop, and `ragged`
(jax.lax.ragged_dot, densified over every expert by XLA:GPU) exceeds that, so the check
can fail.

Each preset runs at its own widths, cut to its first MoE layer (its dense layers before it
kept) and 8-token sequences (128 for flash attention): compile time grows with layers and
tokens, the checks do not. Both compilers load in this process with JAX_PLATFORMS=cpu left
set, so the host backend stays the CPU's. Without libtpu the TPU tests skip, unless
MOEJAX_REQUIRE_TPU is set; without the CUDA plugin the GPU compiles skip, unless
MOEJAX_REQUIRE_GPU is set (CI sets both).
"""

import glob
import os
import re

import jax
import pytest
import quick_gpu

from moejax import aot, cli
from moejax.backend import compile_options
from moejax.aot import custom_calls, programs
from moejax.kernels import dispatch
from runconfig import as_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY = "v5e:2x4"  # 8 chips: mesh (data, fsdp, expert) = (2, 2, 2) shards every axis
MESH = {"data": 2, "fsdp": 2, "expert": 2}
ROWS = 4  # data × fsdp: one sequence per batch shard
GPU = "h100:8"  # one node; the (2, 2, 2) mesh as on TPU
MODES = ("dropless", "capacity")
FULL = bool(os.environ.get("MOEJAX_AOT_FULL"))


def presets() -> list[str]:
  """Every configs/*.py, and `file:variant` for each name in a module-level PRESETS."""
  out = []
  for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))):
    rel = os.path.relpath(path, REPO)
    with open(path) as f:
      m = re.search(r"^PRESETS = \(([^)]*)\)", f.read(), re.MULTILINE)
    variants = re.findall(r"\"(\w+)\"", m.group(1)) if m else []
    out += [f"{rel}:{v}" for v in variants] or [rel]
  return out


def tpu_kernels() -> tuple[str, ...]:
  """The dropless kernels meant for TPU only (`dispatch.KERNELS`), else ragged_dot."""
  kernels = getattr(dispatch, "KERNELS", None)
  if kernels is None:
    return ("ragged",)
  return tuple(n for n, k in kernels.items() if k.backends == ("tpu",) and "dropless" in k.modes)


def tpu_auto() -> str:
  """What `auto` runs on TPU for dropless (a case of its own would repeat `auto`'s)."""
  return dispatch.resolve_impl("auto", "dropless", "tpu")


def load(preset: str):
  return cli.load_file(os.path.join(REPO, preset))


def tiny(preset: str, mode: str, impl: str):
  """The preset at its first MoE layer on the (2, 2, 2) mesh, 8-token sequences (128 with
  flash attention, longer where its `group_size` needs more tokens)."""
  c = load(preset)
  c.model.n_layers = c.model.first_dense + 1
  c.model.moe.update(dispatch=mode, impl=impl)
  c.mesh.update(**MESH)
  # splash and tokamax's Mosaic TPU flash attention (traced on a TPU default device, as on a
  # TPU host) need sequences of a multiple of their 128-token blocks
  flash = c.model.attention in ("splash", "tokamax")
  seq_len, group = (128 if flash else 8), c.model.moe.group_size
  while group and (ROWS * seq_len) % group:
    seq_len *= 2
  c.data.update(batch_size=ROWS * c.train.grad_accum, seq_len=seq_len)
  c.eval.batch_size = ROWS
  return c


def expert_shape(c) -> tuple:
  """What a dispatch kernel sees of a preset."""
  m = c.model.moe
  return (c.model.d_model, m.n_experts, m.top_k, m.d_expert, c.model.dtype, m.group_size)


TILE = 128  # the lane width the kernels tile d_model and d_expert by (TPU lanes, GPU blocks)


def kernel_traits(shape: tuple) -> tuple:
  """What of an expert shape changes a kernel's lowering: the dtype, a capacity group size or
  none, top-1 or top-k, and whether d_model and d_expert are whole tiles (else padded or
  masked). Presets whose shapes share these are the same case to a kernel."""
  d_model, _, top_k, d_expert, dtype, group_size = shape
  return (dtype, bool(group_size), top_k == 1, d_model % TILE == 0, d_expert % TILE == 0)


def matrix(extra, full: bool = FULL) -> list[tuple[str, str, str]]:
  """(preset, mode, impl): each preset in its own mode with `auto`; then, for the first preset
  of each distinct `kernel_traits` (or, `full`, per preset), the cases `extra(preset, native
  mode)` adds."""
  out, seen = [], set()
  for p in presets():
    c = load(p)
    native = c.model.moe.dispatch
    out.append((p, native, "auto"))
    traits = kernel_traits(expert_shape(c))
    if c.model.moe_every == 0 or (traits in seen and not full):
      continue
    seen.add(traits)
    out += extra(p, native)
  return out


def cases(full: bool = FULL) -> list[tuple[str, str, str]]:
  """The TPU matrix: each other TPU kernel, then the other mode."""
  return matrix(
    lambda p, native: (
      [(p, "dropless", k) for k in tpu_kernels() if k != tpu_auto()]
      + [(p, mode, "auto") for mode in MODES if mode != native]
    ),
    full,
  )


def gpu_kernels(mode: str) -> tuple[str, ...]:
  """The kernels that serve `mode` on cuda, other than `auto`'s choice there and the TPU-only
  ones (`blocked` is `fused` unfused: the same loop)."""
  auto = dispatch.resolve_impl("auto", mode, "cuda")
  return tuple(
    n
    for n, k in dispatch.KERNELS.items()
    if mode in k.modes and "cuda" in k.backends and n not in (auto, "blocked")
  )


def gpu_cases(full: bool = FULL) -> list[tuple[str, str, str]]:
  """The GPU matrix: the other mode, then each other cuda kernel of each mode."""
  return matrix(
    lambda p, native: (
      [(p, mode, "auto") for mode in MODES if mode != native]
      + [(p, mode, k) for mode in MODES for k in gpu_kernels(mode)]
    ),
    full,
  )


def _id(case) -> str:
  parts = (case,) if isinstance(case, str) else case
  return "-".join(s.replace("configs/", "").replace(".py", "") for s in parts)


@pytest.fixture(scope="module")
def tpu() -> aot.Target:
  if not aot.libtpu_available() and not os.environ.get("MOEJAX_REQUIRE_TPU"):
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]'); CI sets MOEJAX_REQUIRE_TPU")
  return aot.tpu_target(TOPOLOGY)


@pytest.fixture(scope="module")
def gpu() -> aot.Target:
  if not aot.cuda_available() and not os.environ.get("MOEJAX_REQUIRE_GPU"):
    pytest.skip('no GPU compiler (pip install -e ".[cuda]"); CI sets MOEJAX_REQUIRE_GPU')
  target = aot.gpu_target(GPU)
  return target._replace(compiler_options=target.compiler_options + quick_gpu.OPTIONS)


@pytest.mark.full
def test_quick_gpu_compile_keeps_the_footprint(gpu):
  case = ("configs/qwen3_moe.py", "dropless", "auto")
  quick = _compile(gpu, case)
  tuned = _compile(aot.gpu_target(GPU), case)
  for field in ("temporaries", "arguments", "outputs", "kernels", "loops"):
    assert getattr(quick, field) == getattr(tuned, field), field


def test_the_matrix_covers_every_preset_kernel_and_mode():
  names = presets()
  assert "configs/quickstart.py" in names
  assert {"configs/study_calibration.py:cpu", "configs/study_calibration.py:tpu"} <= set(names)
  assert "configs/study_calibration.py" not in names
  assert tpu_kernels() and all(k in dispatch.IMPLS for k in tpu_kernels())
  run, on_gpu = cases(full=False), gpu_cases(full=False)
  assert {p for p, _, _ in run} == set(names) == {p for p, _, _ in on_gpu}
  for p in names:  # every (traits, kernel, mode) of the full product has a case here
    traits = kernel_traits(expert_shape(load(p)))
    same = {q for q in names if kernel_traits(expert_shape(load(q))) == traits}
    have = {
      (m, tpu_auto() if i == "auto" and m == "dropless" else i) for q, m, i in run if q in same
    }
    assert {("dropless", k) for k in tpu_kernels()} <= have, p
    assert ("capacity", "auto") in have, p
    if load(p).model.moe_every == 0:
      continue
    gpu_have = {(m, dispatch.resolve_impl(i, m, "cuda")) for q, m, i in on_gpu if q in same}
    for mode in MODES:
      want = {(mode, k) for k in (*gpu_kernels(mode), dispatch.resolve_impl("auto", mode, "cuda"))}
      assert want <= gpu_have, (p, mode, want - gpu_have)


def test_kernel_traits_tell_apart_what_a_kernel_lowers_differently():
  mixtral = (64, 8, 2, 128, "float32", 0)  # d_model, E, K, d_expert, dtype, group size
  for other in (
    (64, 8, 2, 128, "bfloat16", 0),  # the dtype
    (64, 8, 2, 128, "float32", 128),  # a capacity group size (gshard)
    (64, 8, 1, 128, "float32", 0),  # top-1 (switch)
    (128, 8, 2, 128, "float32", 0),  # d_model a whole tile (quickstart)
    (64, 8, 2, 112, "float32", 0),  # d_expert not a whole tile (dbrx)
  ):
    assert kernel_traits(other) != kernel_traits(mixtral), other
  # E, K > 1 and the widths within their tile class are alike: dbrx stands for deepseek_v2_lite
  dbrx, v2_lite = (64, 16, 4, 112, "float32", 0), (64, 16, 4, 32, "float32", 0)
  assert kernel_traits(dbrx) == kernel_traits(v2_lite)
  moe = [p for p in presets() if load(p).model.moe_every]
  shapes = {expert_shape(load(p)) for p in moe}
  assert (len(shapes), len({kernel_traits(s) for s in shapes})) == (10, 7)


def _compile(target: aot.Target, case, n_layers: int = 0) -> aot.Footprint:
  """The case's train step compiled for `target` (at `n_layers` when given); it fails naming
  the case when the program holds another platform's kernel (a TPU kernel in a GPU program,
  or the reverse)."""
  preset, mode, impl = case
  c = tiny(preset, mode, impl)
  c.model.n_layers = n_layers or c.model.n_layers
  try:
    fp = aot.footprint(as_run(c), target, preset)
  except Exception as e:  # noqa: BLE001  (any error fails, naming the case)
    pytest.fail(f"{preset} {mode} impl={impl} on {target.name}: {e}")
  foreign = custom_calls.foreign(fp.kernels, target.platform)
  assert not foreign, f"{preset} {mode} impl={impl} on {target.name} holds {foreign} kernels"
  return fp


QUICKSTART = ("configs/quickstart.py", load("configs/quickstart.py").model.moe.dispatch, "auto")


def test_quickstart_compiles_for_tpu(tpu):
  fp = _compile(tpu, QUICKSTART)
  assert fp.fits and fp.params > 0 and fp.temporaries >= 0, fp


@pytest.mark.full  # needs the cuda extra (the full tier installs it)
def test_quickstart_exports_and_compiles_for_h100(gpu):
  c = tiny(*QUICKSTART)
  exported = aot.export_gpu(as_run(c), gpu.n_devices)  # the lowering, as on a host without the plugin
  assert exported.platforms == ("cuda",) and exported.nr_devices == gpu.n_devices
  fp = _compile(gpu, QUICKSTART)
  assert fp.fits and fp.params > 0 and fp.temporaries > 0, fp


def test_quickstart_exports_for_cuda_without_a_gpu_compiler():
  exported = aot.export_gpu(as_run(tiny(*QUICKSTART)), 8)
  assert exported.platforms == ("cuda",) and exported.nr_devices == 8


@pytest.mark.full
@pytest.mark.parametrize("case", cases(), ids=_id)
def test_train_step_compiles_for_tpu(tpu, case):
  fp = _compile(tpu, case)
  assert fp.fits and fp.params > 0 and fp.temporaries >= 0, (case, fp)


@pytest.mark.full
@pytest.mark.parametrize("preset", presets(), ids=_id)
def test_grid_forward_compiles_for_tpu(tpu, preset):
  _grid(tpu, preset)


def _grid(target, preset):
  mode = load(preset).model.moe.dispatch
  try:
    compiled = aot.grid_forward(as_run(tiny(preset, mode, "auto")), target)
  except Exception as e:  # noqa: BLE001  (any error fails, naming the case)
    pytest.fail(f"{preset} grid forward ({mode}, impl auto) on {target.name}: {e}")
  assert compiled.memory_analysis().argument_size_in_bytes > 0
  foreign = custom_calls.foreign(custom_calls.count(compiled.as_text()), target.platform)
  assert not foreign, f"{preset} grid forward on {target.name} holds {foreign} kernels"


@pytest.mark.full
@pytest.mark.parametrize("case", gpu_cases(), ids=_id)
def test_train_step_compiles_for_h100(gpu, case):
  fp = _compile(gpu, case)
  assert fp.fits and fp.params > 0 and fp.temporaries > 0, (case, fp)


@pytest.mark.full
@pytest.mark.parametrize("preset", presets(), ids=_id)
def test_grid_forward_compiles_for_h100(gpu, preset):
  _grid(gpu, preset)


@pytest.mark.full
def test_gpu_preset_runs_mosaic_gpu_kernels_on_h100(gpu):
  """On sm90 the GPU preset's bf16 kernels (tokamax's grouped matmuls, forward, dx and dW,
  and its flash attention) are Mosaic GPU: the deprecated Pallas Triton backend is left
  only where tokamax has no Mosaic kernel (f32 inputs, sm80, dW on sm100). At 2 layers its
  only while loops are the layer scans (`model.scan_layers`), forward and backward, 2 trips
  each: no kernel loops over blocks."""
  fp = _compile(gpu, ("configs/study_calibration.py:gpu", "dropless", "auto"), n_layers=2)
  kernels = dict(fp.kernels)
  assert kernels.get("mosaic_gpu", 0) >= 7 and "triton" not in kernels, kernels
  scans = sorted((lp.kind, lp.trips, lp.depth, lp.source.split()[0]) for lp in fp.loops)
  assert scans == [("layers", 2, 0, "bwd"), ("layers", 2, 0, "fwd")], fp.loops


@pytest.mark.full
def test_gpu_target_leaves_the_layer_scans_stacked_outputs_unfilled(gpu):
  """The GPU target compiles with `compile_options`' XLA:GPU pass: the scanned layer loops'
  stacked outputs, which every trip overwrites, start as uninitialized buffers (an
  `AllocateBuffer` custom call) rather than zero fills. Without the option there is none."""
  c = tiny("configs/study_calibration.py:gpu", "dropless", "auto")
  c.model.n_layers = 2
  lowered = programs.lower_train_step(programs.abstract_run(as_run(c), gpu), gpu)
  alloc = 'custom_call_target="AllocateBuffer"'
  assert set(compile_options.options("cuda").items()) <= set(gpu.compiler_options)
  assert gpu.compile(lowered).as_text().count(alloc) >= 4  # residuals and gradients
  without = gpu._replace(compiler_options=quick_gpu.OPTIONS)
  assert alloc not in without.compile(lowered).as_text()


@pytest.mark.full  # needs the cuda extra (the full tier's line installs it)
def test_lowered_gpu_step_holds_the_h100_hosts_kernels(gpu):
  """`programs.lower_train_step` (describe, the precheck, benchmarks/aot_compile_time.py)
  traces on the target's device whatever JAX's default device is: from this CPU host the GPU
  preset's step lowers tokamax's Mosaic GPU kernels, as on an H100 host, not the Triton ones
  a CPU default device would pick (aot_compile_time.py measured those until a7c6b02)."""
  c = tiny("configs/study_calibration.py:gpu", "dropless", "auto")
  c.model.n_layers = 2
  assert jax.default_device.value is None and jax.default_backend() == "cpu"
  lowered = programs.lower_train_step(programs.abstract_run(as_run(c), gpu), gpu)
  kernels = dict(custom_calls.count(lowered.compiler_ir("hlo").as_hlo_text()))
  assert kernels.get("mosaic_gpu", 0) >= 7 and "triton" not in kernels, kernels


# The expansion check's program: one MoE layer of the study's CPU preset (E = 64, K = 8,
# d_expert 32) with 8 x 512 tokens on the (2, 2, 2) mesh, so 1024 tokens per device.
EXPANSION = 4  # the dropless default's temporaries stay within 4x fused's
EXPANSION_PRESET = "configs/study_calibration.py:cpu"


def _expansion_case(impl: str):
  c = tiny(EXPANSION_PRESET, "dropless", impl)
  c.model.n_layers = 1
  c.data.update(batch_size=8, seq_len=512)
  return c


@pytest.mark.full
def test_gpu_dropless_default_is_not_dense(gpu):
  temps = {}
  for impl in ("fused", "auto", "ragged"):
    temps[impl] = aot.footprint(as_run(_expansion_case(impl)), gpu, impl).temporaries
  assert temps["auto"] <= EXPANSION * temps["fused"], temps
  assert temps["ragged"] > EXPANSION * temps["fused"], temps  # the check can fail


def test_megablox_tiles_stay_within_the_vmem_budget():
  """Hand-worked: tgmm at (512, 1024, 1024) in bf16 is 2·(1024·512 + 512·1024)·2 B of inputs
  plus 3·1024·1024·4 B of f32 accumulator and output: 16 MiB (the TPU compiler refused it at
  17.02 of 16 MiB), so its n tile halves; the forward at the same tiles (12 MiB) and the
  TPU preset's shapes (gate+up N = 512) keep theirs."""
  from moejax.kernels import megablox  # pylint: disable=import-outside-toplevel

  assert megablox.vmem_bytes((512, 1024, 1024), 2, transposed=True) == 16 << 20
  assert megablox.vmem_bytes((512, 1024, 1024), 2) == 12 << 20
  assert megablox.tiling(512, 1024, 1024, 2, transposed=True) == (512, 1024, 512)
  assert megablox.tiling(512, 1024, 1024, 2) == (512, 1024, 1024)
  assert megablox.tiling(512, 1024, 512, 2, transposed=True) == (512, 1024, 512)


@pytest.mark.full
def test_megablox_compiles_at_the_tpu_sweeps_widest_experts(tpu):
  """Factor D of sweep_tpu.py per v5e chip: 16,384 tokens x K 4 = 65,536 rows over E = 32
  (m tile 512), d_model 1024, d_expert 512 (gate and up one gmm with N = 1024), forward and
  backward. Before the VMEM budget its tgmm needed 17.02 MiB of the 16 MiB scoped VMEM and
  did not compile (the same tiles fit at 16,384 rows: the kernel's scoped VMEM grows with
  its grid too, which `vmem_bytes` leaves to the budget's slack)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import SingleDeviceSharding  # pylint: disable=import-outside-toplevel

  from moejax.kernels import megablox, plans  # pylint: disable=import-outside-toplevel

  M, D, F, E = 65536, 1024, 512, 32
  s = SingleDeviceSharding(tpu.devices[0])
  sds = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=s)

  def loss(x, wgu, wd, counts):
    ex = plans.ExpertWeights(wgu, wd)
    y = megablox.swiglu(x, ex, counts, megablox.m_tile(M, E), False)
    return jnp.sum(y.astype(jnp.float32))

  args = (sds((M, D)), sds((E, D, 2 * F)), sds((E, F, D)), sds((E,), jnp.int32))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  assert compiled.as_text().count("tgmm") >= 2  # dW of gate+up and of down, in Mosaic
