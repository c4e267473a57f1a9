"""Ahead-of-time: the train step compiled for devices this machine does not have, and sized.

No data is read: the vocabulary is the config's nominal one (`worksheet.nominal_vocab`) and
params, optimizer state, router state and the batch are `jax.ShapeDtypeStruct`s carrying
the trainer's shardings on a data × fsdp × expert mesh of the target's devices. The
function compiled is the one `moejax.train` runs (`trainer.compile_steps`: the guarded
`step.make_train_step`, jitted with donation and the state's out-shardings), and the
k-grid's forward is `kgrid.forward.CellForward`'s. MaxText's `train_compile.py` is the
anchor for this path.

* TPU: `jax.experimental.topologies.get_topology_desc` builds compile-only TPU devices
  from libtpu (the `tpu` extra) on a CPU host. It works with `JAX_PLATFORMS=cpu` set, so
  the host backend and everything else stays on the CPU. `compiled.memory_analysis()`
  gives the per-device bytes. A program whose temporaries exceed the HBM is refused by the
  TPU compiler with RESOURCE_EXHAUSTED, whose message names both sizes (in GiB, two
  decimals): `hbm` reads the usable HBM per device the same way, from a probe that cannot
  fit, and a refused train step reports its temporaries from that message.
* GPU: there are no compile-only CUDA devices. `jax.export` for `("cuda",)` on an
  `AbstractMesh` lowers the same step (a lowering error fails), state sizes are exact from
  the shardings, and the temporaries are estimated from a CPU compile of one device's
  share of the batch (params replicated, memory-optimized scheduling), labelled as an
  estimate. XLA:CPU has no flash attention: `model.attention=dot_product`, cuDNN's fused
  attention on a GPU, is estimated with its L×L probabilities materialized.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import build, sharding
from moejax import config as config_lib
from moejax.errors import UserError
from moejax.kernels import dispatch
from moejax.kgrid.forward import CellForward
from moejax.sizing import worksheet
from moejax.training import optim, trainer
from moejax.training import step as step_lib

GIB = 1 << 30
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e")
# One JAX device per chip on v4 and v5p (megacore), as on a real slice; v2/v3 have one per
# core and v5e/v6e one core per chip.
_MEGACORE = ("v4", "v5p")
_SKY_NAMES = {"v5litepod": "v5e", "v6e": "v6e"}  # GCP accelerator-type names
_CORES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_OOM = re.compile(
  r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# The GPU estimate's CPU compile orders for memory, as the GPU scheduler does; XLA:CPU's
# default orders for concurrency (the TPU preset's 8-GPU share: 39.7 GiB of temporaries by
# default, 23.0 GiB memory-optimized; tests/test_memory.py uses the same option).
CPU_MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


class Target(NamedTuple):
  """Where a program is compiled for: a TPU topology's devices, or N abstract GPUs."""

  name: str  # "v5e:4x4", "8 x cuda"
  platform: str  # "tpu" | "cuda"
  devices: tuple  # compile-only TPU devices; () for an abstract mesh
  n_devices: int
  hbm_bytes: int  # usable per device
  hbm_source: str


class Footprint(NamedTuple):
  """Per-device bytes of one compiled train step."""

  target: Target
  impl: str  # the dispatch kernel on the target's platform
  params: int  # exact, from the shardings
  opt_state: int
  router: int
  batch: int
  arguments: int  # compiler's (TPU) or the state + batch (GPU)
  outputs: int
  aliased: int  # outputs written into donated arguments
  temporaries: int
  code: int
  estimate: bool  # temporaries from a CPU compile of one device's share (GPU)
  refused: bool  # the TPU compiler ran out of HBM; temporaries from its message

  @property
  def total(self) -> int:
    """Live at the peak: arguments, outputs not aliased to them, temporaries, code."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  @property
  def fits(self) -> bool:
    return not self.refused and self.total <= self.target.hbm_bytes


class Abstract(NamedTuple):
  """A `trainer.Run` whose state is abstract, plus the train step's other arguments."""

  run: trainer.Run
  tokens: jax.ShapeDtypeStruct  # int32 [batch, seq_len + 1], batch-sharded
  rng: jax.ShapeDtypeStruct  # replicated key


class _Tokenizer(NamedTuple):
  vocab_size: int


class NominalData(NamedTuple):
  """Stands in for `data.Data` in an abstract Run: only the vocabulary is read."""

  tokenizer: _Tokenizer


# ------------------------------------------------------------------------------ targets


def _quiet_libtpu() -> None:
  """Environment for a compile-only libtpu on a host without TPUs: no lockfile (another
  process, e.g. a JAX without JAX_PLATFORMS=cpu, may hold /tmp/libtpu_lockfile) and no
  'could not determine TPU accelerator type / worker hostnames' warnings."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if not (glob.glob("/dev/accel*") or os.path.exists("/dev/vfio")):
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def libtpu_available() -> bool:
  """Whether the TPU compiler (libtpu, the `tpu` extra) is importable."""
  try:
    import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def topology_of_accelerator(accelerators: str) -> str | None:
  """'tpu-v5e-16' / 'tpu-v5litepod-16' -> 'v5e:4x4', 'tpu-v4-8' -> 'v4:2x2x1'; None for a
  non-TPU accelerator. The GCP number counts TensorCores on v2-v4 and v5p (2 per chip)
  and chips on v5e/v6e; slices grow by doubling the last of their smallest dimensions."""
  m = re.fullmatch(r"tpu-(v\d+[a-z]*)-(\d+)", accelerators.strip().lower())
  if not m:
    return None
  gen = _SKY_NAMES.get(m.group(1), m.group(1))
  if gen not in _CORES_PER_CHIP:
    raise UserError(f"accelerator {accelerators}: unknown TPU generation; known: {TPU_GENERATIONS}")
  chips = max(int(m.group(2)) // _CORES_PER_CHIP[gen], 1)
  if chips & (chips - 1):
    raise UserError(f"accelerator {accelerators}: {chips} chips is not a power of two")
  dims = [1, 1] if gen in ("v5e", "v6e") else [2, 2, 1] if chips >= 4 else [1, 1, 1]
  while math.prod(dims) < chips:
    smallest = min(dims)
    dims[max(i for i, d in enumerate(dims) if d == smallest)] *= 2
  return f"{gen}:{'x'.join(map(str, dims))}"


@functools.cache
def tpu_devices(topology: str) -> tuple:
  """Compile-only devices of a TPU topology such as 'v5e:4x4' or 'v4:2x2x1'."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  gen, _, shape = topology.partition(":")
  try:
    dims = [int(d) for d in shape.split("x")]
  except ValueError:
    dims = []
  if gen not in TPU_GENERATIONS or len(dims) not in (2, 3) or min(dims) < 1:
    raise UserError(
      f"--topology {topology} is not allowed; use GENERATION:AxB[xC] with GENERATION one of "
      f"{', '.join(TPU_GENERATIONS)}, e.g. v5e:4x4 or v4:2x2x1"
    )
  if not libtpu_available():
    raise UserError(f"--topology {topology} needs libtpu: pip install -e '.[tpu]'")
  _quiet_libtpu()
  bounds = (min(dims[0], 2), min(dims[1], 2), 1)
  chip = {"chip_config_name": "megacore"} if gen in _MEGACORE else {}
  try:
    topo = topologies.get_topology_desc(
      platform="tpu", topology_name=topology, chips_per_host_bounds=bounds, **chip
    )
  except jax.errors.JaxRuntimeError as e:
    raise UserError(f"--topology {topology}: libtpu refused it ({_first_line(e)})") from None
  return tuple(topo.devices)


@functools.cache
def hbm(device_kind: str, device) -> int:
  """Usable HBM bytes of one device, read from the TPU compiler: a 512 GiB temporary is
  refused with 'exceeds available HBM (15.75G)' on v5e (16 GiB chips, Cloud TPU docs)."""
  mesh = Mesh(np.asarray([device]), ("x",))

  def probe(x):
    big = x * jax.lax.broadcasted_iota(jnp.float32, (1 << 18, 1 << 18), 1)
    return jnp.sort(big, axis=1)[:, 0]

  arg = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
  try:
    jax.jit(probe).lower(arg).compile()
  except jax.errors.JaxRuntimeError as e:
    parsed = _parse_oom(str(e))
    if parsed:
      return parsed[1]
    raise
  raise RuntimeError(f"{device_kind}: a 512 GiB temporary compiled; cannot read its HBM")


def tpu_target(topology: str) -> Target:
  devices = tpu_devices(topology)
  kind = devices[0].device_kind
  size = hbm(kind, devices[0])
  return Target(topology, "tpu", devices, len(devices), size, f"{kind}: TPU compiler")


def gpu_target(n_devices: int, hbm_gib: float) -> Target:
  if n_devices < 1 or not hbm_gib > 0:
    raise UserError(f"--devices {n_devices} --hbm {hbm_gib}: use an int >= 1 and a size > 0")
  return Target(f"{n_devices} x cuda", "cuda", (), n_devices, int(hbm_gib * GIB), "--hbm (GiB)")


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _parse_oom(message: str) -> tuple[int, int] | None:
  """(temporaries, available HBM) bytes from the TPU compiler's RESOURCE_EXHAUSTED."""
  m = _OOM.search(message)
  if not m:
    return None
  return (
    int(float(m.group(1)) * _UNITS[m.group(2)]),
    int(float(m.group(3)) * _UNITS[m.group(4)]),
  )


# ------------------------------------------------------------------------ abstract state


def target_mesh(c: ml_collections.ConfigDict, target: Target):
  """The trainer's data × fsdp × expert mesh over the target's devices."""
  if target.devices:
    return sharding.make_mesh(c.mesh, target.devices)
  return AbstractMesh(sharding.mesh_shape(c.mesh, target.n_devices), sharding.AXES)


def _with_shardings(tree, shardings):
  return jax.tree.map(
    lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings
  )


def abstract_run(c: ml_collections.ConfigDict, target: Target) -> Abstract:
  """The trainer's Run on `target`, built from the config alone (trainer.build's state)."""
  config_lib.validate(c)
  mesh = trainer.check_config(c, target_mesh(c, target))
  vocab, _ = worksheet.nominal_vocab(c)
  graphdef, params, router = step_lib.split_model(build.abstract_model(c, vocab))
  tx, schedule = optim.optimizer(c)
  state = {
    "step": jax.ShapeDtypeStruct((), jnp.int32),
    "params": params,
    "router": router,
    "opt_state": jax.eval_shape(tx.init, params),
  }
  state = _with_shardings(state, sharding.state_sharding(state, mesh))
  n_params, n_active = build.count_params(params, build.model_config(c, vocab).moe)
  data = NominalData(_Tokenizer(vocab))
  run = trainer.Run(c, data, graphdef, state, mesh, n_params, n_active, tx, schedule)
  tokens = jax.ShapeDtypeStruct(
    (c.data.batch_size, c.data.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
  return Abstract(run, tokens, rng)


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def _impl(c: ml_collections.ConfigDict, platform: str) -> str:
  moe = c.model.moe
  if c.model.moe_every == 0:
    return "dense"
  return dispatch.resolve_impl(moe.impl, moe.dispatch, platform)


# ------------------------------------------------------------------------------ compiles


def train_step(abstract: Abstract):
  """The jitted, guarded train step moejax.train runs (trainer.compile_steps)."""
  return trainer.compile_steps(abstract.run)[0]


def _footprint(c, target: Target, abstract: Abstract, **memory) -> Footprint:
  state = abstract.run.state
  return Footprint(
    target=target,
    impl=_impl(c, target.platform),
    params=device_bytes(state["params"]),
    opt_state=device_bytes(state["opt_state"]),
    router=device_bytes(state["router"]),
    batch=device_bytes(abstract.tokens),
    **memory,
  )


def compile_tpu(c: ml_collections.ConfigDict, target: Target, label: str = "") -> Footprint:
  """Compiles the train step for a TPU target; a refusal for HBM is a Footprint that does
  not fit, any other compile error a UserError naming the target."""
  abstract = abstract_run(c, target)
  try:
    lowered = train_step(abstract).lower(abstract.run.state, abstract.tokens, abstract.rng)
    ma = lowered.compile().memory_analysis()
  except Exception as e:
    parsed = _parse_oom(str(e))
    if parsed is None:
      raise UserError(f"{label or 'config'}: the train step does not compile for "
                      f"{target.name}: {type(e).__name__}: {_first_line(e)}") from e  # fmt: skip
    args = device_bytes((abstract.run.state, abstract.tokens, abstract.rng))
    return _footprint(
      c, target, abstract, arguments=args, outputs=0, aliased=0, temporaries=parsed[0],
      code=0, estimate=False, refused=True,
    )  # fmt: skip
  return _footprint(c, target, abstract, **_memory(ma), estimate=False, refused=False)


def _memory(ma) -> dict:
  return {
    "arguments": ma.argument_size_in_bytes,
    "outputs": ma.output_size_in_bytes,
    "aliased": ma.alias_size_in_bytes,
    "temporaries": ma.temp_size_in_bytes,
    "code": ma.generated_code_size_in_bytes,
  }


def export_gpu(c: ml_collections.ConfigDict, n_devices: int) -> jax.export.Exported:
  """The train step exported for ("cuda",) on an abstract `n_devices` mesh."""
  abstract = abstract_run(c, gpu_target(n_devices, 1.0))
  fn = train_step(abstract)
  return jax.export.export(fn, platforms=("cuda",))(
    abstract.run.state, abstract.tokens, abstract.rng
  )


def one_device_share(c: ml_collections.ConfigDict, n_devices: int) -> ml_collections.ConfigDict:
  """The config one of `n_devices` data-parallel devices runs: its rows of the batch, on a
  1 × 1 × 1 mesh."""
  mesh = AbstractMesh(sharding.mesh_shape(c.mesh, n_devices), sharding.AXES)
  share = c.copy_and_resolve_references()
  share.data.batch_size = c.data.batch_size // sharding.data_shards(mesh)
  share.mesh.update(data=1, fsdp=1, expert=1)
  return share


def size_gpu(c: ml_collections.ConfigDict, target: Target) -> Footprint:
  """GPU: the export must lower; state bytes exact on the abstract mesh; temporaries
  estimated from a CPU compile of one device's share."""
  abstract = abstract_run(c, target)
  fn = train_step(abstract)
  args = (abstract.run.state, abstract.tokens, abstract.rng)
  try:
    jax.export.export(fn, platforms=("cuda",))(*args)
  except Exception as e:  # noqa: BLE001  any lowering error: the GPU program cannot be built
    raise UserError(f"the train step does not lower for cuda: {_first_line(e)}") from None
  cpu = Target("cpu share", "cpu", tuple(jax.devices("cpu")[:1]), 1, 0, "")
  share = abstract_run(one_device_share(c, target.n_devices), cpu)
  lowered = train_step(share).lower(share.run.state, share.tokens, share.rng)
  ma = lowered.compile(compiler_options=CPU_MEMORY_SCHEDULER).memory_analysis()
  out = _footprint(c, target, abstract, **_memory(ma), estimate=True, refused=False)
  exact_args = device_bytes(args)
  return out._replace(arguments=exact_args, outputs=exact_args, aliased=exact_args, code=0)


def footprint(c: ml_collections.ConfigDict, target: Target, label: str = "") -> Footprint:
  return compile_tpu(c, target, label) if target.platform == "tpu" else size_gpu(c, target)


def grid_forward(c: ml_collections.ConfigDict, target: Target, k1: int | None = None):
  """The k-grid's forward (one k1, integer k2) compiled for one device of a TPU target
  (or lowered for cuda), as `moejax.evaluate` runs it: unsharded, eval.batch_size rows.
  Returns the compiled (TPU) or exported (GPU) program."""
  one = Target(target.name, target.platform, target.devices[:1], 1, target.hbm_bytes, "")
  solo = c.copy_and_resolve_references()
  solo.mesh.update(data=1, fsdp=1, expert=1)
  solo.data.batch_size = solo.eval.batch_size
  solo.train.grad_accum = 1
  abstract = abstract_run(solo, one)
  state = abstract.run.state
  n_moe = len(trainer.moe_layers(abstract.run))
  fwd = CellForward(abstract.run.graphdef, state["params"], state["router"], n_moe)
  k1 = k1 or (c.model.moe.top_k if n_moe else 1)
  fn = fwd.compiled(k1, True)
  mesh = abstract.run.mesh
  rep = NamedSharding(mesh, P())
  args = (
    state["params"],
    state["router"],
    abstract.tokens,
    jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
    jax.ShapeDtypeStruct((n_moe,), jnp.float32, sharding=rep),
  )
  if target.platform == "tpu":
    return fn.lower(*args).compile()
  return jax.export.export(fn, platforms=("cuda",))(*args)
