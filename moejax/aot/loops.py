"""The while loops of a compiled program, read from its optimized HLO text (`as_text()`).

A `while` that XLA could not unroll runs its body once per trip, each op in it a kernel of
its own: on a GPU, several launches of a few microseconds per iteration. XLA writes
`"known_trip_count":{"n":"N"}` in a while's backend config when the count is a compile-time
constant; without it the count is read from the data at run time. In moejax's dispatch the
data-dependent loops are the block loops (`kernels/grouped.py`: `fori_loop(0, n_used)` over
the used blocks of a plan), whose trips grow with the rows per device (T·K / block + E at
most), so `Loop.grows` is "a kernels/ loop whose trip count is not a constant". Fixed loops (a searchsorted's
bisection, the micro-batch scan, an RNG's rounds) keep their count whatever the batch.
XLA:TPU writes no known_trip_count; where a loop's condition compares its counter with a
constant (`compare(counter, constant(N)), direction=LT`, as XLA's windowed einsums and
jax's loops write it), N is its `bound`: the trips, the counter starting at 0 and stepping
by 1.

The layer scans (`model.scan_layers`: one `lax.scan` per segment of identical periods of
layers, `moejax.nn.stack`) are loops of their own kind, `layers`: a while whose op_name ends
in the named scope `scan_layers` (`model.LAYER_SCAN_SCOPE`; the backward's is its transpose),
with a constant trip count, the segment's repeats (a segment of one period compiles to no
loop). Loops inside their body (a block loop, a bisection) keep their own kind, one level
deeper.

Each loop's body is summarized by what runs per iteration: matmuls (dots, GEMM fusions and
library GEMM calls), collectives, custom calls by target (Pallas/Mosaic/Triton kernels,
cuBLAS, cuDNN) and the other fusions; nested loops are loops of their own.
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

from moejax.nn.model import LAYER_SCAN_SCOPE

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_SETS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"([^"]+)"')
COLLECTIVES = (
  "all-reduce",
  "all-reduce-start",
  "all-gather",
  "all-gather-start",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-permute-start",
  "ragged-all-to-all",
)
FREE = (  # ops that launch nothing: views, tuples, control
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "conditional",
  "call",
  "partition-id",
  "replica-id",
  "after-all",
  "all-reduce-done",
  "all-gather-done",
  "collective-permute-done",
  "copy-start",
  "copy-done",
  "opt-barrier",
  "get-dimension-size",
)
# custom calls that launch nothing: an uninitialized buffer (XLA:GPU gives one to a scan's
# stacked output that every trip overwrites, `moejax.backend.compile_options`)
FREE_TARGETS = ("AllocateBuffer",)


def launches_nothing(instr: Instr) -> bool:
  """An op of FREE, or a custom call to one of FREE_TARGETS."""
  if instr.opcode == "custom-call":
    target = _TARGET.search(instr.line)
    return bool(target) and target.group(1) in FREE_TARGETS
  return instr.opcode in FREE


class Body(NamedTuple):
  """What one iteration runs (summed over the computations it calls, nested loops aside)."""

  kernels: int  # ops that launch work: fusions, custom calls, collectives, the rest
  matmuls: int  # dots / convolutions, GEMM fusions, library GEMM calls
  collectives: int
  custom: tuple[tuple[str, int], ...]  # (custom-call target, count), sorted

  def text(self) -> str:
    parts = [f"{self.kernels} kernels", f"{self.matmuls} matmuls"]
    if self.collectives:
      parts.append(f"{self.collectives} collectives")
    parts += [f"{n} x {t}" for t, n in self.custom]
    return ", ".join(parts)


class Loop(NamedTuple):
  name: str  # the while instruction
  trip: int | None  # known_trip_count; None: read from the data at run time
  depth: int  # 0: outside every loop
  source: str  # the JAX op that made it (op_name, shortened)
  body: Body
  bound: int | None = None  # the constant its condition compares the counter with
  what: str = ""  # what XLA or jax made it for, where its names say (`_what`)

  @property
  def trips(self) -> int | None:
    """The compile-time trip count: XLA's annotation, else the condition's constant."""
    return self.trip if self.trip is not None else self.bound

  @property
  def grows(self) -> bool:
    """A dispatch kernel's loop (`kernels/`) whose trip count is not a compile-time constant:
    a block loop, whose trips grow with the rows per device. Other loops without a count
    and no constant bound are reported as unannotated."""
    return self.trips is None and self.source.split(" ", 1)[-1].startswith("kernels/")

  @property
  def kind(self) -> str:
    """`layers` (a layer scan), `dispatch` (`grows`), `fixed` (a compile-time trip count)
    or `unannotated`."""
    if self.what == LAYER_SCAN:
      return "layers"
    if self.grows:
      return "dispatch"
    return "unannotated" if self.trips is None else "fixed"


class Instr(NamedTuple):
  name: str
  opcode: str
  line: str


def computations(hlo: str) -> dict[str, list[Instr]]:
  """{computation: its instructions}. A computation ends at a line that is only `}`; an
  instruction may span lines (a Mosaic/Pallas custom call prints its backend config with
  newlines, and a continuation line can start with `}}`), so a line that starts no
  instruction is joined to the one before it."""
  comps: dict[str, list[Instr]] = {}
  current = None
  for line in hlo.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = comps.setdefault(m.group(1), [])
      continue
    if line.rstrip() == "}":
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      op = _OPCODE.search(m.group(2))
      current.append(Instr(m.group(1), op.group(1) if op else "", line))
    elif current:
      last = current[-1]
      current[-1] = last._replace(line=f"{last.line} {line.strip()}")
  return comps


def entry(hlo: str) -> str | None:
  """The name of the module's entry computation."""
  return next((m.group(1) for m in map(_HEADER.match, hlo.splitlines())
               if m and m.string.startswith("ENTRY")), None)  # fmt: skip


def while_parts(instr: Instr) -> tuple[str, int | None]:
  """A while instruction's body computation and its known trip count (None: not annotated)."""
  body, trip = _BODY.search(instr.line), _TRIP.search(instr.line)
  return (body.group(1) if body else ""), (int(trip.group(1)) if trip else None)


def _callees(instr: Instr) -> list[str]:
  out = _CALLS.findall(instr.line)
  for group in _CALL_SETS.findall(instr.line):
    out += [s.strip().lstrip("%") for s in group.split(",") if s.strip()]
  return out


def _is_matmul(instr: Instr, comps) -> bool:
  if instr.opcode in ("dot", "convolution"):
    return True
  if instr.opcode == "custom-call":
    target = _TARGET.search(instr.line)
    return bool(target and re.search(r"gemm|matmul|cublas", target.group(1), re.IGNORECASE))
  if instr.opcode == "fusion":
    kind = _KIND.search(instr.line)
    if kind and "gemm" in kind.group(1):
      return True
    return any(
      i.opcode in ("dot", "convolution") for c in _callees(instr) for i in comps.get(c, [])
    )
  return False


def _body(name: str, comps) -> Body:
  """Counts over `name` and the computations it calls (not into nested while loops, nor
  into a fusion's own computation beyond finding a dot in it)."""
  kernels = matmuls = collectives = 0
  custom: collections.Counter = collections.Counter()
  stack, seen = [name], set()
  while stack:
    comp = stack.pop()
    if comp in seen or comp not in comps:
      continue
    seen.add(comp)
    for instr in comps[comp]:
      if instr.opcode in ("conditional", "call"):
        stack += _callees(instr)
      if launches_nothing(instr):
        continue
      kernels += 1
      matmuls += _is_matmul(instr, comps)
      collectives += instr.opcode in COLLECTIVES
      if instr.opcode == "custom-call":
        target = _TARGET.search(instr.line)
        custom[target.group(1) if target else "?"] += 1
  return Body(kernels, matmuls, collectives, tuple(sorted(custom.items())))


_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')


def _tables(hlo: str) -> dict[str, dict[int, object]]:
  """The module's FileNames, FunctionNames, FileLocations and StackFrames tables."""
  tables: dict[str, dict[int, object]] = {}
  current = None
  for line in hlo.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
      continue
    m = _TABLE_ROW.match(line) if current is not None else None
    if not m:
      current = None if current is not None and not line.strip() else current
      continue
    fields = (
      m.group(2) if m.group(2) is not None else dict(kv.split("=") for kv in m.group(3).split())
    )
    current[int(m.group(1))] = fields
  return tables


def _source(line: str, tables) -> str:
  """Where in moejax the while was written: the innermost moejax frame of its stack
  ('kernels/grouped.py:72 run'), 'fwd'/'bwd' by a transpose in its op path."""
  m = _OP_NAME.search(line)
  side = "bwd" if m and "transpose(" in m.group(1) else "fwd"
  frame = _FRAME_ID.search(line)
  frame_id = int(frame.group(1)) if frame else 0
  frames, locations = tables.get("StackFrames", {}), tables.get("FileLocations", {})
  files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
  for _ in range(64):  # the parent chain; a parent id is printed one above its frame's
    if frame_id not in frames:
      break
    loc = locations.get(int(frames[frame_id]["file_location_id"]), {})
    path = files.get(int(loc.get("file_name_id", 0)), "")
    if "/moejax/" in path and "site-packages" not in path:
      fn = functions.get(int(loc.get("function_name_id", 0)), "")
      fn = fn.replace(".<locals>.", ".")
      return f"{side} {path.split('/moejax/')[-1]}:{loc.get('line')} {fn}"
    frame_id = int(frames[frame_id]["parent_frame_id"]) - 1
  return f"{side} {m.group(1)[-60:] if m else 'while'}"


_OPERANDS = re.compile(r"\bcompare\(%?([\w.\-]+), %?([\w.\-]+)\)")
_CONSTANT = re.compile(r"\bconstant\((\d+)\)")


def _bound(cond: str, comps) -> int | None:
  """N where the condition's root is `compare(counter, constant(N)), direction=LT`."""
  instrs = comps.get(cond, [])
  root = next((i for i in instrs if i.line.lstrip().startswith("ROOT")), None)
  m = _OPERANDS.search(root.line) if root and root.opcode == "compare" else None
  if not m or "direction=LT" not in root.line:
    return None
  const = next((i for i in instrs if i.name == m.group(2) and i.opcode == "constant"), None)
  value = _CONSTANT.search(const.line) if const else None
  return int(value.group(1)) if value else None


LAYER_SCAN = "a layer scan (model.scan_layers): a trip per period of layers"
# The layer scan's own while (forward `jvp(scan_layers)/while`, backward its transpose), not
# the loops in its body (`scan_layers/while/body/.../while`).
_LAYER_OP = re.compile(rf"(?:^|[/(]){LAYER_SCAN_SCOPE}\)*/while$")
_WHAT = (  # (pattern in the body's name or the while's op_name, what it is)
  (
    "windowed_dot_general",
    "XLA's windowed einsum (FSDP gather/scatter overlapped, a shard a trip)",
  ),
  ("searchsorted", "a searchsorted's bisection"),
  ("rng_bit_generator|threefry", "an RNG's rounds"),
)


def _what(body: str, line: str) -> str:
  op = _OP_NAME.search(line)
  if op and _LAYER_OP.search(op.group(1)):
    return LAYER_SCAN
  text = f"{body} {op.group(1) if op else ''}"
  return next((what for pattern, what in _WHAT if re.search(pattern, text)), "")


def report_text(hlo: str) -> tuple[Loop, ...]:
  """Every while loop of an optimized HLO module's text, outermost first."""
  comps = computations(hlo)
  tables = _tables(hlo)
  first = entry(hlo)
  out: list[Loop] = []
  stack = [(first, 0)] if first else [(c, 0) for c in comps]
  seen = set()
  while stack:
    comp, depth = stack.pop(0)
    if comp in seen or comp not in comps:
      continue
    seen.add(comp)
    for instr in comps[comp]:
      if instr.opcode == "while":
        name, trip = while_parts(instr)
        cond = _COND.search(instr.line)
        cond = cond.group(1) if cond else ""
        out.append(
          Loop(
            instr.name,
            trip,
            depth,
            _source(instr.line, tables),
            _body(name, comps),
            _bound(cond, comps),
            _what(name, instr.line),
          )
        )
        stack.append((name, depth + 1))
        seen.add(cond)
      else:  # conditionals, calls, async wrappers, custom calls with called computations
        stack += [(c, depth) for c in _callees(instr)]
  return tuple(out)


def report(compiled) -> tuple[Loop, ...]:
  """The while loops of a `jax.stages.Compiled` (its optimized HLO text)."""
  return report_text(compiled.as_text())


def _order(group: tuple) -> tuple:
  """`format_loops`' order of a (key, count) group: dispatch block loops, then layer scans,
  then the rest; the most repeated first, then by source."""
  (grow, *_, source, _body, what), n = group
  return (not grow, what != LAYER_SCAN, -n, source)


def format_loops(loops: tuple[Loop, ...], indent: str = "  ") -> list[str]:
  """Lines: the count by kind, then the loops grouped by (grows, trips, source, body): the
  dispatch block loops first, then the layer scans, each largest first."""
  if not loops:
    return [f"{indent}while loops: none in the compiled program"]
  kinds = collections.Counter(lp.kind for lp in loops)
  rest = (
    f"{kinds['dispatch']} dispatch block loops (trips grow with rows), {kinds['fixed']} "
    + f"fixed, {kinds['unannotated']} unannotated"
  )
  head = f"{indent}while loops: {len(loops)}; "
  if kinds["layers"]:  # a line of their own: each stays within 100 columns
    lines = [f"{head}{kinds['layers']} layer scans (model.scan_layers),", indent + rest]
  else:
    lines = [head + rest]
  groups = collections.Counter(
    (lp.grows, lp.trips, lp.trip is None, lp.depth, lp.source, lp.body, lp.what) for lp in loops
  )
  for (grow, trips, from_cond, depth, source, body, what), n in sorted(groups.items(), key=_order):
    count = "data" if grow else "?" if trips is None else f"{trips}{' (cond)' * from_cond}"
    nest = f", nested {depth}" if depth else ""
    lines.append(f"{indent}  {n:4d} x [trips: {count}{nest}] {source}")
    if what:
      lines.append(f"{indent}         {what}")
    lines.append(f"{indent}         per trip: {body.text()}")
  return lines
