"""Every configs/*.py preset compiles for TPU and lowers for GPU, without a device.

TPU: the train step moejax.train runs (moejax.aot: the trainer's jitted, guarded step, with
its shardings on a data × fsdp × expert mesh) is compiled ahead of time for the compile-only
devices of a small TPU topology, and so is the k-grid's forward. GPU: the same train steps
and grid forwards are exported for ("cuda",) on an abstract 8-device mesh. A failure names
the preset, the mode, the impl and the target.

The matrix (`cases`): every preset in its own dispatch mode with impl `auto` (the TPU default
kernel); then, once per distinct expert shape among the presets (`expert_shape`: d_model,
E, K, d_expert, dtype, group size), every other TPU kernel and the other dispatch mode. A
kernel only sees those shapes, and the rest of each preset is compiled in its first case,
so this covers the full cross product (every preset × every kernel × both modes) in 33
train-step compiles instead of 45; `MOEJAX_AOT_FULL=1` runs the full product. Measured
here (2 cores shared with other jobs): 73 tests in 480 s wall, 419 s of CPU.

Each preset runs at its own widths, cut to its first MoE layer (its dense layers before it
kept) and 8-token sequences (128 for splash attention): compile time grows with layers and
tokens, the checks do not.
libtpu (the `tpu` extra) is loaded in this process with JAX_PLATFORMS=cpu left set, so the
host backend stays the CPU's. Without libtpu the TPU tests skip, unless MOEJAX_REQUIRE_TPU
is set (CI sets it).
"""

import glob
import os
import re

import pytest

from moejax import aot, cli
from moejax.kernels import dispatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY = "v5e:2x4"  # 8 chips: mesh (data, fsdp, expert) = (2, 2, 2) shards every axis
MESH = {"data": 2, "fsdp": 2, "expert": 2}
ROWS = 4  # data × fsdp: one sequence per batch shard
GPUS = 8
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
  """The preset at its first MoE layer on the (2, 2, 2) mesh, 8-token sequences (longer
  where its `group_size` needs more tokens)."""
  c = load(preset)
  c.model.n_layers = c.model.first_dense + 1
  c.model.moe.update(dispatch=mode, impl=impl)
  c.mesh.update(**MESH)
  # splash attention needs sequences of a multiple of 128 tokens
  seq_len, group = (128 if c.model.attention == "splash" else 8), c.model.moe.group_size
  while group and (ROWS * seq_len) % group:
    seq_len *= 2
  c.data.update(batch_size=ROWS * c.train.grad_accum, seq_len=seq_len)
  c.eval.batch_size = ROWS
  return c


def expert_shape(c) -> tuple:
  """What a dispatch kernel sees of a preset."""
  m = c.model.moe
  return (c.model.d_model, m.n_experts, m.top_k, m.d_expert, c.model.dtype, m.group_size)


def cases(full: bool = FULL) -> list[tuple[str, str, str]]:
  """(preset, mode, impl): each preset in its own mode with `auto`; per distinct expert
  shape (or, `full`, per preset) each TPU kernel and the other mode."""
  out, seen = [], set()
  for p in presets():
    c = load(p)
    native = c.model.moe.dispatch
    out.append((p, native, "auto"))
    shape = expert_shape(c)
    if c.model.moe_every == 0 or (shape in seen and not full):
      continue
    seen.add(shape)
    out += [(p, "dropless", k) for k in tpu_kernels() if k != tpu_auto()]
    out += [(p, mode, "auto") for mode in MODES if mode != native]
  return out


def gpu_cases() -> list[tuple[str, str]]:
  """(preset, mode): every preset's own mode, and the other mode per expert shape."""
  return list(dict.fromkeys((p, mode) for p, mode, _ in cases()))


def _id(case) -> str:
  parts = (case,) if isinstance(case, str) else case
  return "-".join(s.replace("configs/", "").replace(".py", "") for s in parts)


@pytest.fixture(scope="module")
def tpu() -> aot.Target:
  if not aot.libtpu_available() and not os.environ.get("MOEJAX_REQUIRE_TPU"):
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]'); CI sets MOEJAX_REQUIRE_TPU")
  return aot.tpu_target(TOPOLOGY)


def test_the_matrix_covers_every_preset_kernel_and_mode():
  names = presets()
  assert "configs/quickstart.py" in names
  assert {"configs/study_calibration.py:cpu", "configs/study_calibration.py:tpu"} <= set(names)
  assert "configs/study_calibration.py" not in names
  assert tpu_kernels() and all(k in dispatch.IMPLS for k in tpu_kernels())
  run = cases(full=False)
  assert {p for p, _, _ in run} == set(names)
  for p in names:  # every (shape, kernel, mode) of the full product has a case here
    shape = expert_shape(load(p))
    same = {q for q in names if expert_shape(load(q)) == shape}
    have = {
      (m, tpu_auto() if i == "auto" and m == "dropless" else i) for q, m, i in run if q in same
    }
    assert {("dropless", k) for k in tpu_kernels()} <= have, p
    assert ("capacity", "auto") in have, p


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_train_step_compiles_for_tpu(tpu, case):
  preset, mode, impl = case
  try:
    fp = aot.footprint(tiny(preset, mode, impl), tpu, preset)
  except Exception as e:  # noqa: BLE001  (any error fails, naming the case)
    pytest.fail(f"{preset} {mode} impl={impl} on {TOPOLOGY}: {e}")
  assert fp.fits and fp.params > 0 and fp.temporaries >= 0, (preset, mode, impl, fp)


@pytest.mark.parametrize("preset", presets(), ids=_id)
def test_grid_forward_compiles_for_tpu(tpu, preset):
  mode = load(preset).model.moe.dispatch
  try:
    compiled = aot.grid_forward(tiny(preset, mode, "auto"), tpu)
  except Exception as e:  # noqa: BLE001  (any error fails, naming the case)
    pytest.fail(f"{preset} grid forward ({mode}, impl auto) on {TOPOLOGY}: {e}")
  assert compiled.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.parametrize("case", gpu_cases(), ids=_id)
def test_train_step_and_grid_export_for_cuda(case):
  preset, mode = case
  c = tiny(preset, mode, "auto")
  try:
    exported = aot.export_gpu(c, GPUS)
    grid = aot.grid_forward(c, aot.gpu_target(GPUS, 80))
  except Exception as e:  # noqa: BLE001  (any error fails, naming the case)
    pytest.fail(f"{preset} {mode} impl=auto for cuda on {GPUS} devices: {e}")
  assert exported.platforms == ("cuda",) and exported.nr_devices == GPUS
  assert grid.platforms == ("cuda",)
