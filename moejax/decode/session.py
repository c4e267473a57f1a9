"""A run ready to generate from: its restored model behind a `Generator`, and the cell a
command's `--k1`/`--k2` name (`python -m moejax.generate`, decode speed)."""

from __future__ import annotations

from typing import NamedTuple

from flax import nnx

from moejax.config import grid_labels
from moejax.config.run import RunConfig
from moejax.decode.generator import Generator
from moejax.errors import UserError
from moejax.kgrid import cells as cells_lib
from moejax.kgrid.loading import EvalRun, load_run


class Session(NamedTuple):
  run: EvalRun
  generator: Generator


def cell(rc: RunConfig, k1: str, k2: str) -> tuple[int, int | None]:
  """(k1, k2) of `--k1 N --k2 LABEL` (a label `moejax.evaluate --k2` takes but the
  rescalings, or an integer k1 <= k2 <= E); k2 None: the rule's own normalization."""
  K, E = rc.moe.top_k, rc.moe.n_experts
  (k1_,) = grid_labels.parse_k1(k1 or str(K), K, E)
  (label,) = grid_labels.parse_k2(k2 or cells_lib.NATIVE, K, E, [k1_])
  if label in cells_lib.RESCALINGS:
    raise UserError(f"--k2={label} is not allowed here; use native, k1, K, 2K, 4K, E or an integer")
  resolved, _ = cells_lib.cells([k1_], [label], K, E, normalizes=rc.rule.norm != "none")
  k1_, k2_ = resolved[-1]
  return k1_, (k2_ if isinstance(k2_, int) else None)


def open_session(workdir: str, rc: RunConfig, *, step: int | None, max_length: int,
                 eos_ids=(), batch_size: int = 1, params_fn=None) -> Session:  # fmt: skip
  """The run's checkpoint `step` (None: the latest) behind a Generator that stops at
  `eos_ids` (none: always `n_new` tokens); `params_fn` maps the restored params (a cast)."""
  if rc.moe is None:
    raise UserError(f"{workdir} holds a dense model (model.moe_every=0); nothing to route")
  run = load_run(workdir, rc, step)
  params = run.params if params_fn is None else params_fn(run.params)
  cfg = nnx.merge(run.graphdef, run.params, run.router).cfg
  gen = Generator(cfg, params, run.router, max_length=max_length, batch_size=batch_size,
                  eos_ids=eos_ids)  # fmt: skip
  return Session(run, gen)
