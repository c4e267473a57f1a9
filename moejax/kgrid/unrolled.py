"""A scanned run in the unrolled layout, for programs that only run forward (evaluation, decode).

A layer's slice of a stacked weight (`stacks.{s}.blocks.{j}`, [repeats, ...]) handed to an
expert kernel's custom call is a copy in the compiled program: an evaluation forward or a
decode step of a scanned model copied every expert of every layer, each call (benchmarks:
the scoring forward of a 100M OLMoE spent most of a short call on those copies). Unrolled
(`layers.{i}`), each layer has its own arrays and a call reads only what its kernels read.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from moejax.build import abstract_transformer
from moejax.kgrid.loading import EvalRun
from moejax.nn.model import ModelConfig, layer_segments
from moejax.nn.moe import RouterBias


def unrolled_cfg(cfg: ModelConfig) -> ModelConfig:
  return dataclasses.replace(cfg, scan_layers=False)


def unrolled_graphdef(cfg: ModelConfig):
  """The graph of `cfg`'s model with its layers unrolled; `unrolled_state` fills it."""
  return nnx.split(abstract_transformer(unrolled_cfg(cfg)), nnx.Param, RouterBias)[0]


def unrolled_state(cfg: ModelConfig, state):
  """A scanned model's state (params or router) in the unrolled layout, each layer its own
  arrays (copies of the stacked rows); an unrolled model's state as it is."""
  if not cfg.scan_layers:
    return state
  segs = layer_segments(cfg)
  out = []
  for path, value in nnx.to_flat_state(state):
    if path[0] != "stacks":
      out.append((path, value))
      continue
    seg, j = segs[int(path[1])], int(path[3])
    for r in range(seg.repeats):
      out.append((("layers", seg.layer(r, j), *path[4:]), value.replace(value[...][r])))
  return nnx.from_flat_state(out)


def unrolled(run: EvalRun) -> EvalRun:
  """`run` in the unrolled layout; its stacked arrays are dropped with it."""
  cfg = nnx.merge(run.graphdef, run.params, run.router).cfg
  if not cfg.scan_layers:
    return run
  return run._replace(graphdef=unrolled_graphdef(cfg), params=unrolled_state(cfg, run.params),
                      router=unrolled_state(cfg, run.router))  # fmt: skip
