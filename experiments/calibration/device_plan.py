"""The device study's plan: which arms (rule × seed) fit the time budget, and why.

Each arm trains one run and grids its final checkpoint. Its planned seconds are

  train    = steps × batch × seq_len / tokens_per_s
  compile  = train_compile_s × (1 + forwards × forward_over_train)
  grid     = cells × sequences × seq_len / (FORWARD_SPEEDUP × tokens_per_s) + CHECKPOINT_S

from committed measurements, never from this run:

* `tokens_per_s` is the lowest and `train_compile_s` the highest of the device benchmark's
  H200 rows at the preset's expert shape with the `tokamax` kernel and the preset's layer
  layout (`benchmarks/results/accelerator_h200_*.json` whose command leaves
  `model.scan_layers` and `model.scan_unroll` at their defaults, or sets scan_layers=True:
  the unrolled and unroll-0 layouts are other programs, with compiles up to 37.9 s);
  `benchmarks/accelerator.py`'s default shape is the preset's, with a 32k vocabulary where
  the preset has bytes, so the step is if anything faster here;
* `forward_over_train` is the grid forward's trace + lower + compile time over the train
  step's for the preset, both compiled deviceless for one H200 on the CPU host
  (`benchmarks/aot_compile_time.py --grid-forward`, COMPILE_RESULT; a deviceless compile
  does not autotune, so the ratio, not the seconds, is carried over); `forwards` counts the grid's
  compiled programs (one per k1, `moejax.kgrid.forward`) plus the trainer's
  held-out eval step;
* a forward is a third of a train step's FLOPs (2N against 6N per token), so the grid's
  cells run at FORWARD_SPEEDUP × the training tokens/s; CHECKPOINT_S is an allowance (not
  measured) for writing and reading back the final checkpoint.

A rule's first arm is planned at the full compile; its later seeds run the same programs,
which the persistent compile cache (`train.compile_cache`) reads back, so their compile is
planned at `warm_over_cold` of it: the committed time of the preset's train step and grid
forward read back from that cache over their time compiled, both lowered in one process
as the study's arms are (`benchmarks/compile_cache_hit.py`, CACHE_RESULT; measured on this
host's CPU backend, whose compile is the shorter: a GPU compile adds autotuning, which a
cached program skips). Arms past the budget
are "beyond plan" and still run when the measured times of the arms before them leave room
(`device_study.py`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import NamedTuple

from moejax.config import RunConfig
from moejax.config import grid_labels
from moejax.kgrid import cells as cells_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "benchmarks", "results")
THROUGHPUT_GLOB = "accelerator_h200_*.json"
KERNEL = "tokamax"
OTHER_LAYOUTS = re.compile(r"model\.scan_layers=False|model\.scan_unroll=")  # not the preset's
COMPILE_RESULT = "device_study_compile_h200_1.json"
CACHE_RESULT = "compile_cache_hit.json"
FORWARD_SPEEDUP = 3.0
CHECKPOINT_S = 10.0
RULES = ("qwen3_moe", "olmoe")  # renormalized, unnormalized: sweep.CORE_RULES
PLANNED, BEYOND = "planned", "beyond plan"


class Measured(NamedTuple):
  """The committed figures the plan stands on, and the files they come from."""

  tokens_per_s: float
  train_compile_s: float
  forward_over_train: float
  warm_over_cold: float
  sources: tuple[str, ...]


class Arm(NamedTuple):
  name: str
  rule: str
  seed: int


class PlannedArm(NamedTuple):
  arm: Arm
  train_s: float
  compile_s: float
  grid_s: float
  status: str  # PLANNED | BEYOND

  @property
  def total_s(self) -> float:
    return self.train_s + self.compile_s + self.grid_s


def shape_label(rc: RunConfig) -> str:
  """The device benchmark's E/K/f label of a config's experts."""
  return f"{rc.moe.n_experts}/{rc.moe.top_k}/{rc.moe.d_expert}"


def throughput(shape: str, results: str = RESULTS) -> tuple[float, float, tuple[str, ...]]:
  """(lowest tokens/s, highest compile s, files) over the committed H200 rows of `shape`
  with KERNEL; a ValueError when no row has measured it."""
  rates, compiles, files = [], [], []
  for path in sorted(glob.glob(os.path.join(results, THROUGHPUT_GLOB))):
    with open(path) as f:
      result = json.load(f)
    if OTHER_LAYOUTS.search(result.get("command", "")):
      continue
    rows = result["figures"]["rows"]
    hits = [r for r in rows if r.get("E/K/f") == shape and r.get("impl") == KERNEL]
    hits = [r for r in hits if r.get("tokens_per_s") and r.get("compile_s")]
    if hits:
      files.append(os.path.basename(path))
      rates += [float(r["tokens_per_s"]) for r in hits]
      compiles += [float(r["compile_s"]) for r in hits]
  if not rates:
    raise ValueError(f"no committed H200 {KERNEL} row measures E/K/f {shape} in {results}")
  return min(rates), max(compiles), tuple(files)


def forward_ratio(results: str = RESULTS) -> float:
  """The grid forward's deviceless compile seconds over the train step's (COMPILE_RESULT)."""
  with open(os.path.join(results, COMPILE_RESULT)) as f:
    fig = json.load(f)["figures"]
  return float(fig["rows"][0]["grid_forward_over_train_step"])


def warm_ratio(results: str = RESULTS) -> float:
  """The preset's programs read back from the compile cache over compiled (CACHE_RESULT)."""
  with open(os.path.join(results, CACHE_RESULT)) as f:
    return float(json.load(f)["figures"]["warm_over_cold"])


def measured(rc: RunConfig, results: str = RESULTS) -> Measured:
  rate, compile_s, files = throughput(shape_label(rc), results)
  sources = files + (COMPILE_RESULT, CACHE_RESULT)
  return Measured(rate, compile_s, forward_ratio(results), warm_ratio(results), sources)


def grid_shape(rc: RunConfig, normalizes: bool) -> tuple[int, int]:
  """(cells, compiled forwards) of the grid the config's eval.k1/k2 ask for."""
  K, E = rc.moe.top_k, rc.moe.n_experts
  k1s = grid_labels.parse_k1(rc.eval.k1, K, E)
  labels = grid_labels.parse_k2(rc.eval.k2, K, E, k1s)
  cells, _ = cells_lib.cells(k1s, labels, K, E, normalizes=normalizes)
  return len(cells), len(k1s)


def arms(max_seeds: int, rules: tuple[str, ...] = RULES) -> list[Arm]:
  """Seed-major, so every rule has n seeds before any has n + 1."""
  return [Arm(f"dev-{r}-s{s}", r, s) for s in range(max_seeds) for r in rules]


def plan_arm(rc: RunConfig, m: Measured, normalizes: bool, first: bool) -> tuple[float, ...]:
  """(train, compile, grid) planned seconds of one arm, the first of its rule or a later
  seed (module docstring)."""
  d, ev = rc.data, rc.eval
  train = rc.train.steps * d.batch_size * d.seq_len / m.tokens_per_s
  cells, forwards = grid_shape(rc, normalizes)
  compile_s = m.train_compile_s * (1 + (forwards + 1) * m.forward_over_train)
  compile_s *= 1.0 if first else m.warm_over_cold
  grid = cells * ev.sequences * d.seq_len / (FORWARD_SPEEDUP * m.tokens_per_s) + CHECKPOINT_S
  return train, compile_s, grid


def plan(rc: RunConfig, m: Measured, budget_s: float, max_seeds: int, norms: dict) -> list:
  """Every arm with its planned seconds; PLANNED while the running total fits `budget_s`.
  `norms`: rule -> whether it normalizes (the `sqrt` cell exists only then)."""
  out, total = [], 0.0
  for arm in arms(max_seeds):
    train, compile_s, grid = plan_arm(rc, m, norms[arm.rule], first=arm.seed == 0)
    total += train + compile_s + grid
    status = PLANNED if total <= budget_s else BEYOND
    out.append(PlannedArm(arm, train, compile_s, grid, status))
  return out


def seeds_planned(planned: list[PlannedArm]) -> int:
  """Seeds that every rule has inside the plan."""
  per_rule = {}
  for p in planned:
    if p.status == PLANNED:
      per_rule[p.arm.rule] = per_rule.get(p.arm.rule, 0) + 1
  return min(per_rule.get(r, 0) for r in RULES)


def table(planned: list[PlannedArm], m: Measured, budget_s: float) -> str:
  lines = [
    (
      f"plan (budget {budget_s:.0f} s; {m.tokens_per_s:,.0f} tokens/s and "
      f"{m.train_compile_s:.1f} s train-step compile from the committed H200 runs, grid "
      f"forward compile {m.forward_over_train:.2f}x the train step's, a cached seed's "
      f"{m.warm_over_cold:.2f}x a first; sources: "
      f"{', '.join(m.sources)}):"
    ),
    f"  {'arm':<20}{'train s':>9}{'compile s':>11}{'grid s':>9}{'total s':>9}  status",
  ]
  running = 0.0
  for p in planned:
    running += p.total_s
    lines.append(
      f"  {p.arm.name:<20}{p.train_s:>9.1f}{p.compile_s:>11.1f}{p.grid_s:>9.1f}"
      f"{running:>9.1f}  {p.status}"
    )
  lines.append(
    f"  {seeds_planned(planned)} seed(s) per rule inside the plan; arms beyond it run when the "
    "measured time of the rule's last arm leaves room"
  )
  return "\n".join(lines)
