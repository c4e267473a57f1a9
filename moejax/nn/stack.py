"""Where each layer's parameters live when the layer stack is scanned (`model.scan_layers`).

The stack is cut into *segments* of identical periods, and each segment runs as one
`lax.scan` whose body is the period:

* the `first_dense` prefix: a period of one dense block (of the mixer pattern's length when
  `model.mixers` is a pattern), repeated as often as it fits, then what is left once;
* then the `moe_every` period (an MoE block followed by `moe_every - 1` dense blocks; with a
  mixer pattern, the least common multiple of the two periods), repeated as often as it
  fits whole;
* then what is left of one period, once.

Why the period and not one stack per position in it: the layers of a period alternate, so
separate stacks would have to be interleaved inside one loop anyway; a scan over the period
is that loop, with a body the compiler sees once. Every preset has `moe_every` 1, so its
MoE stack is a scan over single MoE blocks (MaxText's `scan_layers` shape).

In the scanned layout, position j of segment s holds its parameters at
`("stacks", s, "blocks", j, ...)` with a leading axis of length `repeats` (unsharded); layer
`i = start + r * period + j` is row r. The unrolled layout keeps `("layers", i, ...)`.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Segment(NamedTuple):
  """`repeats` runs of a period of blocks; `moe[j]`: whether position j is an MoE block."""

  start: int  # index of the segment's first layer
  repeats: int
  moe: tuple[bool, ...]

  @property
  def period(self) -> int:
    return len(self.moe)

  def layer(self, r: int, j: int) -> int:
    """The layer index of position j in repeat r."""
    return self.start + r * self.period + j


class Place(NamedTuple):
  """Where layer `i` lives in the scanned layout: segment, row (repeat) and body position."""

  segment: int
  row: int
  position: int


def segments(n_layers: int, is_moe: tuple[bool, ...], first_dense: int, moe_every: int,
             mixer_period: int = 1):  # fmt: skip
  """The segments of a stack whose layer i is MoE iff `is_moe[i]` and whose mixers repeat
  every `mixer_period` layers (`model.mixers`; see the module doc): the prefix's period is
  the mixers', the rest's the least common multiple of the MoE period and the mixers'."""
  out: list[Segment] = []
  out += _runs(0, first_dense, mixer_period, is_moe)
  moe_period = moe_every if moe_every > 0 and any(is_moe) else 1
  out += _runs(first_dense, n_layers, math.lcm(moe_period, mixer_period), is_moe)
  return tuple(out)


def _runs(start: int, end: int, period: int, is_moe: tuple[bool, ...]) -> list[Segment]:
  """Layers start..end-1 as whole periods repeated, then what is left once."""
  whole, tail = divmod(end - start, period)
  out = []
  if whole:
    out.append(Segment(start, whole, tuple(is_moe[start : start + period])))
  if tail:
    first = start + whole * period
    out.append(Segment(first, 1, tuple(is_moe[first:end])))
  return out


def places(segs: tuple[Segment, ...]) -> tuple[Place, ...]:
  """`places(segs)[i]`: where layer i lives."""
  out = []
  for s, seg in enumerate(segs):
    out += [Place(s, r, j) for r in range(seg.repeats) for j in range(seg.period)]
  return tuple(out)


def scanned_path(path: tuple, segs: tuple[Segment, ...]) -> tuple[tuple, int | None]:
  """An unrolled parameter path `("layers", i, *rest)` as (scanned path, row); other paths
  are the same in both layouts (row None)."""
  if len(path) < 2 or path[0] != "layers":
    return path, None
  p, key = places(segs)[int(path[1])], type(path[1])  # int or str keys, as given
  return ("stacks", key(p.segment), "blocks", key(p.position), *path[2:]), p.row
