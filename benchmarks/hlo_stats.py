"""What a compiled program does per step, read from its optimized HLO (`compiled.as_text()`):
kernels launched, the elementwise fusions' output bytes, dynamic-update-slice fusions and the
zero fills outside loops, each while body counted as often as its known trip count.

Used by `aot_compile_time.py --hlo-stats` to say where a scanned step's extra work is on a
GPU without a GPU: XLA:GPU names a fusion by its root (`loop_broadcast_fusion`,
`loop_dynamic_update_slice_fusion`) and writes `known_trip_count` in a while's
backend_config. A dynamic-update-slice fusion is counted, not sized: its result is the
whole buffer it updates, in place where XLA can, so its output shape says nothing of the
bytes it writes.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from moejax.aot import loops

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
DEDUPLICATED = re.compile(r'deduplicated_name="([^"]+)"')
OP_NAME = re.compile(r'op_name="([^"]+)"')


class Stats(NamedTuple):
  """Per step: kernels, while loops entered, dynamic-update-slice fusions, MiB written by
  the other elementwise (kLoop) fusions, MiB of zero fills (broadcast fusions) outside loops."""

  launches: int
  loops: int
  dus_fusions: int
  loop_fusion_mib: float
  zero_fill_mib: float


NONE = Stats(0, 0, 0, 0.0, 0.0)


def array_bytes(shape_text: str) -> int:
  """Bytes of every array in an HLO result shape (a tuple's elements summed)."""
  total = 0
  for dtype, dims in ARRAY.findall(shape_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * DTYPE_BYTES[dtype]
  return total


def _names(instr: loops.Instr) -> str:
  """The instruction's name, the name XLA gave it first where it deduplicated it, and the
  JAX op it came from (an async start's own name says nothing of its fusion)."""
  found = (m.group(1) for m in (DEDUPLICATED.search(instr.line), OP_NAME.search(instr.line)) if m)
  return " ".join((instr.name, *found))


def _written(instr: loops.Instr) -> int:
  """Bytes an instruction writes: an async start's result is (its operands, its outputs, a
  context scalar), and only the outputs are written."""
  shape = instr.line.split(" = ", 1)[1].split(f" {instr.opcode}(", 1)[0]
  if instr.opcode.endswith("-start") and shape.startswith("(("):
    depth = 0
    for i, ch in enumerate(shape[1:], 1):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        outputs = shape[i + 1 :].rsplit(",", 1)[0]  # without the context
        return array_bytes(outputs)
  return array_bytes(shape)


def _instr_stats(instr: loops.Instr, in_entry: bool) -> Stats:
  # loops.launches_nothing (views, control, AllocateBuffer) launches nothing; neither does an
  # async op's "-done", which waits for the "-start" that launched it.
  if loops.launches_nothing(instr) or instr.opcode.endswith("-done"):
    return NONE
  name = _names(instr)
  dus = instr.opcode.startswith("fusion") and "dynamic_update_slice" in name
  loop_fusion = instr.opcode in ("fusion", "fusion-start") and "kind=kLoop" in instr.line
  loop_fusion = loop_fusion and not dus
  mib = _written(instr) / 2**20
  return Stats(
    launches=1,
    loops=0,
    dus_fusions=int(dus),
    loop_fusion_mib=mib if loop_fusion else 0.0,
    zero_fill_mib=mib if (in_entry and loop_fusion and "broadcast" in name) else 0.0,
  )


def _add(a: Stats, b: Stats, times: int = 1) -> Stats:
  return Stats(*(x + times * y for x, y in zip(a, b, strict=True)))


def stats(hlo: str) -> Stats:
  """Per-step Stats of an optimized HLO module: its entry computation's kernels, plus each
  while body's Stats times the loop's known trip count (once where the count is unknown)."""
  comps = loops.computations(hlo)
  first = loops.entry(hlo)

  def of(computation: str) -> Stats:
    total = NONE
    for instr in comps[computation]:
      total = _add(total, _instr_stats(instr, computation == first))
      if instr.opcode == "while":
        body, trip = loops.while_parts(instr)
        total = _add(total, Stats(0, 1, 0, 0.0, 0.0))
        total = _add(total, of(body), trip if trip is not None else 1)
    return total

  return of(first)
