"""The trainer's step and the k-grid's forward, built from a config alone and compiled for a
target's compile-only devices.

No data is read (the Run has no `data`): the vocabulary is the config's nominal one
(`worksheet.nominal_vocab`), and
params, optimizer state, router state and the batch are `jax.ShapeDtypeStruct`s carrying the
trainer's shardings on a data × fsdp × expert mesh of the target's devices. The function
compiled is the one `moejax.train` runs (`trainer.compile_steps`: the guarded
`step.make_train_step`, jitted with donation and the state's out-shardings), and the
k-grid's forward is `kgrid.forward.CellForward`'s. MaxText's `train_compile.py` is the
anchor for this path.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import build, sharding
from moejax.backend import compat
from moejax.aot import cache, custom_calls, loops, memory
from moejax.aot.targets import Target
from moejax.config import sections
from moejax.config.run import RunConfig
from moejax.errors import UserError
from moejax.kernels import dispatch
from moejax.kgrid.forward import CellForward
from moejax.sizing import worksheet
from moejax.training import optim, trainer
from moejax.training import step as step_lib


class Abstract(NamedTuple):
  """A `trainer.Run` whose state is abstract, plus the train step's other arguments."""

  run: trainer.Run
  tokens: jax.ShapeDtypeStruct  # int32 [batch, seq_len + 1], batch-sharded
  rng: jax.ShapeDtypeStruct  # replicated key


def target_mesh(rc: RunConfig, target: Target):
  """The trainer's data × fsdp × expert mesh over the target's devices (an AbstractMesh
  for a target without devices, `export_gpu`: it names the GPU that Triton kernels traced
  under it are lowered for, `compat.gpu_target`)."""
  if target.devices:
    return sharding.make_mesh(rc.mesh, target.devices)
  shape = sharding.mesh_shape(rc.mesh, target.n_devices)
  gpu = compat.DEFAULT_GPU_KIND if target.platform == "cuda" else None
  return compat.abstract_mesh(shape, sharding.AXES, gpu)


def tracing_on(target: Target):
  """The context the target's programs are traced in: its first compile-only device as JAX's
  default device, as on a host of that accelerator, where tokamax picks its kernels from the
  default device (Mosaic GPU on an sm90 GPU; traced from a CPU default it would be Triton,
  a program the GPU host never runs). A target without devices (`export_gpu`) names the
  GPU its Triton kernels lower for instead (`compat.gpu_target`)."""
  if target.devices:
    return jax.default_device(target.devices[0])
  return compat.lowering_for((target.platform,))


def _with_shardings(tree, shardings):
  return jax.tree.map(
    lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings
  )


def abstract_run(rc: RunConfig, target: Target) -> Abstract:
  """The trainer's Run on `target`, built from the config alone (trainer.build's state)."""
  mesh = trainer.check_config(rc, target_mesh(rc, target))
  rc = rc.with_vocab(worksheet.nominal_vocab(rc)[0]).with_shards(sharding.data_shards(mesh))
  graphdef, params, router = step_lib.split_model(build.abstract_transformer(rc.model))
  tx, schedule = optim.optimizer(rc.optim, rc.train.steps)
  state = {
    "step": jax.ShapeDtypeStruct((), jnp.int32),
    "params": params,
    "router": router,
    "opt_state": jax.eval_shape(tx.init, params),
  }
  state = _with_shardings(state, sharding.state_sharding(state, mesh))
  n_params, n_active = build.count_params(params, rc.moe)
  run = trainer.Run(rc, None, graphdef, state, mesh, n_params, n_active, tx, schedule)
  tokens = jax.ShapeDtypeStruct(
    (rc.data.batch_size, rc.data.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
  return Abstract(run, tokens, rng)


def impl_on(rc: RunConfig, platform: str) -> str:
  """The dispatch kernel the config runs on `platform` (`dense` without MoE layers)."""
  moe = rc.moe
  if moe is None:
    return "dense"
  return dispatch.resolve_impl(moe.impl, moe.dispatch, platform)


def train_step(abstract: Abstract):
  """The jitted, guarded train step moejax.train runs (trainer.compile_steps)."""
  return trainer.compile_steps(abstract.run)[0]


def lower_train_step(abstract: Abstract, target: Target):
  """`train_step` lowered for `target`, traced in `tracing_on(target)` (so its kernels are
  the ones a host of that accelerator picks)."""
  with tracing_on(target):
    return train_step(abstract).lower(abstract.run.state, abstract.tokens, abstract.rng)


def _footprint(rc: RunConfig, target: Target, abstract: Abstract, **fields) -> memory.Footprint:
  state = abstract.run.state
  return memory.Footprint(
    target=target,
    impl=impl_on(rc, target.platform),
    params=memory.device_bytes(state["params"]),
    opt_state=memory.device_bytes(state["opt_state"]),
    router=memory.device_bytes(state["router"]),
    batch=memory.device_bytes(abstract.tokens),
    **fields,
  )


def _compiled(lowered, abstract: Abstract, target: Target) -> dict:
  """The compiler's answer (`cache.FIELDS`, `loops`, `kernels`): its memory analysis, while
  loops and kernel families, or the TPU compiler's refusal for HBM (temporaries from its message)."""
  try:
    compiled = target.compile(lowered)
  except Exception as e:
    parsed = memory.parse_oom(str(e))
    if parsed is None:
      raise
    args = memory.device_bytes((abstract.run.state, abstract.tokens, abstract.rng))
    zero = dict.fromkeys(("outputs", "aliased", "code"), 0)
    refused = {"arguments": args, "temporaries": parsed[0], "refused": True}
    return {**zero, **refused, "loops": (), "kernels": ()}
  ma = memory.analysis(compiled.memory_analysis())
  kernels = custom_calls.count(compiled.as_text())
  return {**ma, "refused": False, "loops": loops.report(compiled), "kernels": kernels}


def footprint(
  rc: RunConfig,
  target: Target,
  label: str = "",
  store: cache.Store | None = None,
) -> memory.Footprint:
  """Compiles the train step for `target` and sizes it per device. A TPU refusal for HBM is
  a Footprint that does not fit; any other compile error is a UserError naming the target.
  With a `store`, a program compiled before (the same lowered text, target and compilers)
  is read from it instead (`Footprint.cached`), and a new answer is written to it."""
  abstract = abstract_run(rc, target)
  try:
    lowered = lower_train_step(abstract, target)
    k = cache.key(lowered.as_text(), target) if store else ""
    hit = store.load(k) if store else None
    answer = hit or _compiled(lowered, abstract, target)
  except Exception as e:
    raise UserError(f"{label or 'config'}: the train step does not compile for "
                    f"{target.name}: {type(e).__name__}: {memory.first_line(e)}") from e  # fmt: skip
  if store and hit is None:
    store.save(k, answer)
  return _footprint(rc, target, abstract, **answer, cached=hit is not None)


def export_gpu(rc: RunConfig, n_devices: int) -> jax.export.Exported:
  """The train step exported for ("cuda",) on an abstract `n_devices` mesh: a lowering
  check that needs no GPU compiler (no memory)."""
  if n_devices < 1:
    raise UserError(f"{n_devices} GPUs is not allowed; use an int >= 1")
  abstract = abstract_run(rc, Target(f"{n_devices} x cuda", "cuda", (), n_devices, 0, ""))
  export = jax.export.export(
    train_step(abstract), platforms=("cuda",), disabled_checks=dispatch.export_disabled_checks()
  )
  return export(abstract.run.state, abstract.tokens, abstract.rng)


def grid_forward(rc: RunConfig, target: Target, k1: int | None = None):
  """The k-grid's forward (one k1: every cell at it) compiled for one device of `target`, as
  `moejax.evaluate` runs it: unsharded, eval.batch_size rows."""
  one = target._replace(devices=target.devices[:1], n_devices=1, hbm_source="")
  solo = dataclasses.replace(
    rc,
    mesh=sections.MeshConfig(data=1, fsdp=1, expert=1),
    data=dataclasses.replace(rc.data, batch_size=rc.eval.batch_size),
    train=dataclasses.replace(rc.train, grad_accum=1),
    loss=dataclasses.replace(rc.loss, grad_accum=1),
  )
  abstract = abstract_run(solo, one)
  state = abstract.run.state
  n_moe = len(trainer.moe_layers(abstract.run))
  fwd = CellForward(abstract.run.graphdef, state["params"], state["router"], n_moe)
  k1 = k1 or (rc.moe.top_k if n_moe else 1)
  rep = NamedSharding(abstract.run.mesh, P())
  args = (
    state["params"],
    state["router"],
    abstract.tokens,
    jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
    jax.ShapeDtypeStruct((n_moe,), jnp.float32, sharding=rep),
  )
  with tracing_on(one):
    return one.compile(fwd.compiled(k1).lower(*args))
