"""The device study's plan: how many steps every arm trains, which arms (rule × seed) fit the
time budget, and why.

Each arm trains one run and grids its final checkpoint. Its planned seconds are

  train    = steps × batch × seq_len / tokens_per_s
  compile  = train_compile_s × (1 + forwards × forward_over_train)
  grid     = cells × sequences × seq_len / (FORWARD_SPEEDUP × tokens_per_s)
  other    = setup_s + checkpoint_s

with the figures of device_figures.py (each labelled measured, estimate or allowance).
`forwards` counts the grid's compiled programs (one per k1, `moejax.kgrid.forward`) plus the
trainer's held-out eval step. A forward is a third of a train step's FLOPs (2N against 6N
per token), so the grid's cells run at FORWARD_SPEEDUP × the training tokens/s.

Before the first arm, the probe (device_probe.py) compiles the first arm's train step and
runs it PROBE_STEPS steps: the first arm's train-step compile is then a cached one, and so
is every program of a rule's later seeds (the persistent compile cache,
`train.compile_cache`), planned at `warm_over_cold` of a cold compile. The plan from the
committed figures counts the probe after the startup; the plan on the device starts from
the seconds already spent.

The steps (`fit_steps`): the preset's `train.steps` when MIN_SEEDS seeds per rule fit the
time left at the figures, else the most steps that do (then the first arm's train step is
compiled again: its schedule has other constants). Never more than the preset's: its tokens
per run are the study's design; time to spare goes to more seeds, as arms "beyond plan"
that run when the measured times of the arms before them leave room (`device_study.py`).
Every arm trains the same steps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from device_figures import Figures

from moejax.config import RunConfig, grid_labels
from moejax.kgrid import cells as cells_lib
from moejax.sizing import worksheet

FORWARD_SPEEDUP = 3.0
PROBE_STEPS = 100
MIN_SEEDS = 2
STEP_MULTIPLE = 10
RULES = ("qwen3_moe", "olmoe")  # renormalized, unnormalized: sweep.CORE_RULES
PLANNED, BEYOND = "planned", "beyond plan"
TOKENS_OVER_CPU, ACTIVE_OVER_CPU = 20, 5  # the floors the device study is sized for


class Arm(NamedTuple):
  name: str
  rule: str
  seed: int


class PlannedArm(NamedTuple):
  arm: Arm
  train_s: float
  compile_s: float
  grid_s: float
  overhead_s: float
  status: str  # PLANNED | BEYOND

  @property
  def total_s(self) -> float:
    return self.train_s + self.compile_s + self.grid_s + self.overhead_s


def tokens_per_step(rc: RunConfig) -> int:
  return rc.data.batch_size * rc.data.seq_len


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


def compile_s(rc: RunConfig, f: Figures, normalizes: bool, arm: Arm, train_cached: bool):
  """Planned compile seconds of one arm: cold for a rule's first arm (its train step cached
  when `train_cached`: the probe compiled it), cached for a later seed."""
  _, k1s = grid_shape(rc, normalizes)
  train = f.train_compile_s.value
  forwards = train * (k1s + 1) * f.forward_over_train.value
  warm = f.warm_over_cold.value
  if arm.seed > 0:
    return (train + forwards) * warm
  cached = train_cached and arm.rule == RULES[0]
  return train * (warm if cached else 1.0) + forwards


def plan_arm(rc: RunConfig, f: Figures, normalizes: bool, arm: Arm, train_cached: bool):
  """(train, compile, grid, other) planned seconds of one arm."""
  rate, ev = f.tokens_per_s.value, rc.eval
  train = rc.train.steps * tokens_per_step(rc) / rate
  cells, _ = grid_shape(rc, normalizes)
  grid = cells * ev.sequences * rc.data.seq_len / (FORWARD_SPEEDUP * rate)
  other = f.setup_s.value + f.checkpoint_s.value
  return train, compile_s(rc, f, normalizes, arm, train_cached), grid, other


def probe_s(rc: RunConfig, f: Figures) -> float:
  """The probe after the startup, planned: a cold train-step compile and its steps (its build
  is in the startup)."""
  return f.train_compile_s.value + PROBE_STEPS * tokens_per_step(rc) / f.tokens_per_s.value


def plan(rc, f: Figures, budget_s: float, max_seeds: int, norms: dict, spent_s: float,
         train_cached: bool = True) -> list[PlannedArm]:  # fmt: skip
  """Every arm with its planned seconds after `spent_s`; PLANNED while the running total fits
  `budget_s`. `norms`: rule -> whether it normalizes (the `sqrt` cell exists only then)."""
  out, total = [], spent_s
  for arm in arms(max_seeds):
    parts = plan_arm(rc, f, norms[arm.rule], arm, train_cached)
    total += sum(parts)
    out.append(PlannedArm(arm, *parts, PLANNED if total <= budget_s else BEYOND))
  return out


def fit_steps(rc, f: Figures, left_s: float, norms: dict, seeds: int = MIN_SEEDS):
  """(steps, train_cached): the preset's steps when `seeds` seeds per rule fit `left_s`, else
  the most (a multiple of STEP_MULTIPLE) that do, with the first arm's train step compiled
  again; (None, True) when not even one step does."""
  keep = plan(rc, f, math.inf, seeds, norms, 0.0, train_cached=True)
  if sum(p.total_s for p in keep) <= left_s:
    return rc.train.steps, True
  fixed = plan(rc, f, math.inf, seeds, norms, 0.0, train_cached=False)
  train = sum(p.train_s for p in fixed)
  room = left_s - (sum(p.total_s for p in fixed) - train)
  per_step = train / rc.train.steps
  steps = int(room / per_step) // STEP_MULTIPLE * STEP_MULTIPLE if room > 0 else 0
  return (steps, False) if steps > 0 else (None, True)


def seeds_planned(planned: list[PlannedArm]) -> int:
  """Seeds that every rule has inside the plan."""
  per_rule = {}
  for p in planned:
    if p.status == PLANNED:
      per_rule[p.arm.rule] = per_rule.get(p.arm.rule, 0) + 1
  return min(per_rule.get(r, 0) for r in RULES)


def params(rc: RunConfig) -> dict:
  """Non-embedding parameters, total and active per token (`describe`'s convention)."""
  rc = rc.with_vocab(worksheet.nominal_vocab(rc)[0])
  return worksheet.worksheet(rc).to_dict()["conventions"]["non_embedding"]


def scale_lines(rc: RunConfig, cpu: RunConfig) -> list[str]:
  """Tokens per run and parameters against the CPU study's, with the floors' verdicts."""
  p, q = params(rc), params(cpu)
  tok, cpu_tok = rc.train.steps * tokens_per_step(rc), cpu.train.steps * tokens_per_step(cpu)
  ok = lambda b: "yes" if b else "NO"
  return [
    (
      f"  tokens per arm: {rc.train.steps:,} steps x {tokens_per_step(rc):,} = "
      f"{tok / 1e6:.1f}M, {tok / cpu_tok:.1f}x the CPU study's {cpu_tok / 1e6:.2f}M "
      f"(>= {TOKENS_OVER_CPU}x: {ok(tok >= TOKENS_OVER_CPU * cpu_tok)})"
    ),
    (
      f"  non-embedding parameters: {p['total'] / 1e6:.1f}M, {p['active'] / 1e6:.2f}M active "
      f"per token, {p['active'] / q['active']:.1f}x the CPU study's "
      f"{q['active'] / 1e6:.2f}M active "
      f"(>= {ACTIVE_OVER_CPU}x: {ok(p['active'] >= ACTIVE_OVER_CPU * q['active'])})"
    ),
    (
      f"  tokens per parameter: {tok / p['total']:.2f} ({tok / p['active']:.1f} per active "
      f"one); the CPU study's {cpu_tok / q['total']:.2f} ({cpu_tok / q['active']:.1f})"
    ),
  ]


def table(planned: list[PlannedArm], f: Figures, budget_s: float, spent_s: float) -> str:
  lines = [f"plan (budget {budget_s:.0f} s; figures for {f.where}):", *f.lines()]
  lines.append(f"  {'before the first arm':<20}{'':>38}{spent_s:>9.1f}")
  lines.append(f"  {'arm':<20}{'train s':>9}{'compile s':>11}{'grid s':>9}{'other s':>9}"
               f"{'total s':>9}  status")  # fmt: skip
  running = spent_s
  for p in planned:
    running += p.total_s
    lines.append(
      f"  {p.arm.name:<20}{p.train_s:>9.1f}{p.compile_s:>11.1f}{p.grid_s:>9.1f}"
      f"{p.overhead_s:>9.1f}{running:>9.1f}  {p.status}"
    )
  lines.append(
    f"  {seeds_planned(planned)} seed(s) per rule inside the plan; arms beyond it run when the "
    "measured times of the arms before them leave room"
  )
  return "\n".join(lines)


def min_rate(rc, f: Figures, budget_s: float, norms: dict, spent_s: float,
             seeds: int = MIN_SEEDS) -> float:  # fmt: skip
  """The tokens/s at which `seeds` seeds per rule just fit `budget_s` at the other figures
  (train and grid seconds scale as 1 / tokens/s; compiles and overheads do not)."""
  planned = plan(rc, f, math.inf, seeds, norms, spent_s)
  fixed = spent_s + sum(p.compile_s + p.overhead_s for p in planned)
  tokens = sum(p.train_s + p.grid_s for p in planned) * f.tokens_per_s.value
  return tokens / (budget_s - fixed) if budget_s > fixed else math.inf


def steps_line(steps, preset_steps: int, left_s: float, seeds: int = MIN_SEEDS) -> str:
  """Why every arm trains the steps it does (`fit_steps`'s answer)."""
  if steps is None:
    return (
      f"steps: the preset's {preset_steps:,}; no step count fits {seeds} seeds per rule in the "
      f"{left_s:.0f} s left: arms run as the time allows"
    )
  if steps == preset_steps:
    return f"steps: {steps:,} (the preset's): {seeds} seeds per rule fit the {left_s:.0f} s left"
  return (
    f"steps: {steps:,}, fewer than the preset's {preset_steps:,}: the most with which {seeds} "
    f"seeds per rule fit the {left_s:.0f} s left"
  )
