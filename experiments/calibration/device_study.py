"""The calibration study at accelerator scale, on one GPU:

    python experiments/calibration/device_study.py --out DIR [--budget-s 480] [--seeds 5]
        [--set KEY=VALUE ...] [--config configs/study_calibration.py:device] [--scratch DIR]
    python experiments/calibration/device_study.py --plan-only [--device h100|h200]

Trains qwen3_moe (renormalized) and olmoe (unnormalized) on `configs/study_calibration.py:
device`, seed-major (every rule gets seed n before any gets n + 1), and grids each final
checkpoint at k1 in {8, 4, 2, 1} x k2 in {native, k1, K, E} plus `sqrt` and `gain` (the
preset's eval.k1/k2). It prints the plan from the committed figures (device_plan.py,
device_figures.py: what is measured, what is estimated and from what), then measures its own
first steps (device_probe.py: the first arm's train step compiled and run), fixes every arm's
step count from them (`device_plan.fit_steps`: the preset's, or fewer where two seeds per
rule would not fit) and prints that plan and its reason. Then it runs every arm whose time
fits what is left of `--budget-s` (counted from this process's start, less RESERVE_S for the
report): the plan's figure until an arm of the same rule has run, that arm's measured time
after. An arm that does not fit is listed as skipped; one that fails (e.g. diverges) as
failed. `--plan-only` prints the plan from the committed figures for an H100 and an H200 (or
the `--device` named) and exits: no device, nothing trained.

In one process: `moejax.train`'s and `moejax.evaluate`'s entry points (`trainer.train`,
`kgrid.run.run_grid`) called in turn. A process per arm would pay JAX's import, the CUDA
client's start and the corpus load again for every arm; here they are paid once, and the
persistent compile cache (`train.compile_cache`, one folder under --scratch) serves the
first arm's train step (the probe compiled it) and a rule's later seeds in the same way.

DIR receives four files, rewritten after every arm so a run cut off mid-way still leaves
what finished: `runs.tar.gz` (runs/<arm>/{config.json, metrics.jsonl, eval/k_grid.jsonl};
no checkpoints: they stay under --scratch and are deleted once gridded), `plan.json` (the
figures, the probe, the steps and why, each arm's status and measured seconds, the host,
commit and device kind), `report.md` (`device_report.section`: H1, H2 and H10 beside the CPU
study's factor A) and `log.txt`. Unpack runs.tar.gz beside plan.json
(experiments/calibration/device/) and `python experiments/calibration/report.py` puts the
section into the study's README.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here: imports and the corpus are in it

import argparse
import ast
import copy
import datetime
import gc
import json
import os
import pathlib
import platform
import shutil
import sys
import tarfile
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import device_figures
import device_plan
import device_probe
import device_report

from moejax import cli
from moejax.errors import UserError

CONFIG = "configs/study_calibration.py:device"
CPU_CONFIG = "configs/study_calibration.py:cpu"  # the study it is compared with
RESERVE_S = 20.0  # the report and the archive after the last arm
KEEP = ("config.json", "metrics.jsonl", "eval/k_grid.jsonl")
FILES = ("runs.tar.gz", "plan.json", "report.md", "log.txt")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=pathlib.Path, help="where the 4 files go (required to run)")
  p.add_argument("--budget-s", type=float, default=480.0, help="seconds from start to report")
  p.add_argument("--seeds", type=int, default=5, help="at most this many seeds per rule")
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--scratch", type=pathlib.Path, default=None, help="checkpoints, cache")
  p.add_argument(
    "--plan-only", action="store_true", help="print the plan from the committed figures, exit"
  )
  p.add_argument(
    "--device",
    choices=sorted(device_figures.SPECS),
    action="append",
    help="--plan-only: the device(s) to plan for (default: all of them)",
  )
  return p


def apply_set(c, assignment: str) -> None:
  """KEY=VALUE into the ConfigDict (VALUE a Python literal, else a string)."""
  key, sep, raw = assignment.partition("=")
  if not sep:
    raise UserError(f"--set {assignment!r}: use KEY=VALUE, e.g. train.steps=100")
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  *parents, leaf = key.split(".")
  node = c
  try:
    for part in parents:
      node = node[part]
    node[leaf] = value
  except (KeyError, AttributeError, TypeError) as e:
    raise UserError(f"--set {assignment!r}: {e}") from None


class Log:
  """print, and the same lines into DIR/log.txt."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    path.write_text("")

  def __call__(self, *parts, **_) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    with open(self.path, "a") as f:
      f.write(line + "\n")


def elapsed() -> float:
  return time.monotonic() - T0


def arm_config(base, rule: str, seed: int, cache: pathlib.Path):
  c = copy.deepcopy(base)
  c.model.moe.rule = rule
  c.train.seed = seed
  c.train.compile_cache = str(cache)
  return c


def fit_heldout(base, log) -> None:
  """Fewer evaluated sequences where this Python's stdlib holds out too few windows for the
  grid's sequences plus gain's calibration ones (both come from the held-out split)."""
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel
  from moejax.data import pipeline  # pylint: disable=import-outside-toplevel

  rc = resolve(base)
  have = pipeline.heldout_windows(rc.data, None)[0].shape[0]
  need = rc.eval.sequences + rc.eval.gain_sequences
  if have < need:
    n = max(have - rc.eval.gain_sequences, have // 2)
    log(f"held-out split: {have} windows < {need} (eval.sequences + gain_sequences); grid on {n}")
    base.eval.sequences = n


def host_info() -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from moejax.training import tracking  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {
    "device_kind": devices[0].device_kind,
    "platform": jax.default_backend(),
    "device_count": len(devices),
    "cpu": cpu,
    "cores": os.cpu_count(),
    "commit": os.environ.get("MOEJAX_COMMIT") or tracking.git_commit(),
    "jax": jax.__version__,
    "python": platform.python_version(),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
  }


def run_arm(cfg, workdir: pathlib.Path, log) -> dict:
  """Train, then grid the final checkpoint; the seconds of each."""
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel
  from moejax.kgrid.run import run_grid  # pylint: disable=import-outside-toplevel
  from moejax.training import trainer  # pylint: disable=import-outside-toplevel

  t0 = time.monotonic()
  summary = trainer.train(resolve(cfg), str(workdir), log=log)
  if summary["stopped_by"]:
    raise RuntimeError(f"training stopped by {summary['stopped_by']} at step {summary['step']}")
  t1 = time.monotonic()
  run_grid(str(workdir), log=log)
  return {"train_s": t1 - t0, "grid_s": time.monotonic() - t1}


def first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else ""


def keep(workdir: pathlib.Path, dest: pathlib.Path) -> None:
  for rel in KEEP:
    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(workdir / rel, dest / rel)


def pack(results: pathlib.Path, out: pathlib.Path, state: dict) -> None:
  """plan.json and runs/ under `results`, then DIR's files (each replaced whole)."""
  state["elapsed_s"] = elapsed()
  (results / "plan.json").write_text(json.dumps(state, indent=1))
  tmp = out / "runs.tar.gz.part"
  with tarfile.open(tmp, "w:gz") as tar:
    if (results / "runs").exists():
      tar.add(results / "runs", arcname="runs")
  os.replace(tmp, out / "runs.tar.gz")
  shutil.copyfile(results / "plan.json", out / "plan.json")
  report = device_report.section(results)
  (out / "report.md").write_text(report)


def expected_s(arm: dict, state: dict) -> float:
  """The seconds this arm is expected to take: the measured time of the last arm that ran the
  same programs in the same state (its rule's, both a later seed: read from the compile
  cache); else its plan scaled by the last arm's measured over planned; else its plan."""
  ran = [a for a in state["arms"] if a.get("measured_s") and a["status"] == device_report.DONE]
  same = [a for a in ran if a["rule"] == arm["rule"] and a["seed"] > 0 and arm["seed"] > 0]
  if same:
    return same[-1]["measured_s"]
  if ran:
    return arm["planned_s"] * ran[-1]["measured_s"] / ran[-1]["planned_s"]
  return arm["planned_s"]


def load(args, log) -> tuple:
  """(the config with --set applied, its resolved RunConfig per rule, rule -> normalizes)."""
  path = args.config if os.path.exists(args.config.partition(":")[0]) else str(REPO / args.config)
  base = cli.load_file(path)
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  for assignment in args.set:
    apply_set(base, assignment)
  resolve(base)  # a bad key or value: one line, before anything trains
  if args.seeds < 1 or args.budget_s <= 0:
    raise UserError("--seeds must be >= 1 and --budget-s > 0")
  if log is not None:
    fit_heldout(base, log)
  rcs = {r: resolve(arm_config(base, r, 0, pathlib.Path("."))) for r in device_plan.RULES}
  return base, rcs, {r: rc.rule.norm != "none" for r, rc in rcs.items()}


def cpu_study():
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  return resolve(cli.load_file(str(REPO / CPU_CONFIG)))


def committed_plan(rc, device: str, budget: float, seeds: int, norms: dict, log):
  """Prints the plan from the committed figures for `device`; its Figures, or None where
  they cannot support one (said so)."""
  try:
    f = device_figures.committed(rc, device)
  except device_figures.Unsupported as e:
    log(f"plan for {device}: the committed figures cannot support one: {e}")
    return None
  spent = f.startup_s.value + device_plan.probe_s(rc, f)
  planned = device_plan.plan(rc, f, budget, seeds, norms, spent)
  log(device_plan.table(planned, f, budget, spent))
  need = device_plan.min_rate(rc, f, budget, norms, spent)
  if device_plan.seeds_planned(planned) < device_plan.MIN_SEEDS:
    log(
      f"  the committed figures do not hold {device_plan.MIN_SEEDS} seeds per rule at these "
      "steps in this budget: the probe's measured figures decide on the device"
    )
  log(
    f"  {device_plan.MIN_SEEDS} seeds per rule at these steps need >= {need:,.0f} tokens/s at "
    f"these compile figures; the estimate is {f.tokens_per_s.value:,.0f} "
    f"({f.tokens_per_s.value / need:.2f}x). On the device the probe measures it (device_probe.py)."
  )
  return f


def plan_only(args) -> int:
  _, rcs, norms = load(args, None)
  rc, budget = rcs[device_plan.RULES[0]], args.budget_s - RESERVE_S
  print("\n".join(device_plan.scale_lines(rc, cpu_study())))
  for device in args.device or sorted(device_figures.SPECS):
    committed_plan(rc, device, budget, args.seeds, norms, print)
  return 0


def set_steps(base, steps: int) -> None:
  """Every arm's steps; warmup keeps its share, eval and checkpoint stay at the end."""
  t = base.train
  base.optim.warmup_steps = base.optim.warmup_steps * steps // t.steps
  t.steps = t.eval_every = t.ckpt_every = steps


def probe_figures(base, committed, cache: pathlib.Path, kind: str, log):
  """(Figures from the probe, the probe's dict), or the committed figures and None where
  the probe failed (said so: the arms then fail or run on their own)."""
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  rule = device_plan.RULES[0]
  log(f"probe: {device_plan.PROBE_STEPS} steps of {rule}'s train step, from {elapsed():.0f} s")
  try:
    probe = device_probe.probe(resolve(arm_config(base, rule, 0, cache)), device_plan.PROBE_STEPS)
  except Exception as e:  # noqa: BLE001  (said, and the arms report their own failures)
    if committed is None:
      raise UserError(f"the probe failed ({type(e).__name__}: {first_line(e)}) and the "
                      "committed figures cannot support a plan") from None  # fmt: skip
    log(f"probe: failed ({type(e).__name__}: {first_line(e)}); the committed figures stay")
    return committed, None
  log(
    f"probe: setup {probe.setup_s:.1f} s, first step {probe.compile_s:.1f} s, "
    f"{probe.tokens_per_s:,.0f} tokens/s"
  )
  return device_figures.measured(probe, kind, elapsed()), probe._asdict()


def fix_steps(base, rcs, norms, f, budget: float, log) -> dict:
  """Every arm's steps from the figures (device_plan.fit_steps), said with the reason."""
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  rc, left = rcs[device_plan.RULES[0]], budget - elapsed()
  steps, cached = device_plan.fit_steps(rc, f, left, norms)
  reason = device_plan.steps_line(steps, rc.train.steps, left)
  log(reason)
  if steps is not None and steps != rc.train.steps:
    set_steps(base, steps)
    rc = resolve(arm_config(base, device_plan.RULES[0], 0, pathlib.Path(".")))
  cpu = cpu_study()
  for line in device_plan.scale_lines(rc, cpu):
    log(line)
  per_run = lambda c: c.train.steps * device_plan.tokens_per_step(c)
  if per_run(rc) < device_plan.TOKENS_OVER_CPU * per_run(cpu):
    log(
      f"note: below the floor of {device_plan.TOKENS_OVER_CPU}x the CPU study's tokens per run: "
      "at this device's measured rate the budget holds no more; a larger --budget-s would"
    )
  return {"rc": rc, "steps": rc.train.steps, "steps_reason": reason, "train_cached": cached}


def initial_state(args, host: dict, figures: dict, fixed: dict, planned: list) -> dict:
  """plan.json before any arm: the command, the figures, the steps and why, the arms."""
  arms = [
    {"name": p.arm.name, "rule": p.arm.rule, "seed": p.arm.seed,
     "planned_s": round(p.total_s, 1), "plan": p.status, "status": "pending"}
    for p in planned
  ]  # fmt: skip
  return {
    "command": " ".join(["python", "experiments/calibration/device_study.py", *sys.argv[1:]]),
    "budget_s": args.budget_s,
    "reserve_s": RESERVE_S,
    **figures,
    "steps": fixed["steps"],
    "steps_reason": fixed["steps_reason"],
    "host": host,
    "arms": arms,
  }


def run(args) -> int:
  if args.plan_only:
    return plan_only(args)
  if args.out is None:
    raise UserError("--out DIR is required (or --plan-only)")
  args.out.mkdir(parents=True, exist_ok=True)
  log = Log(args.out / "log.txt")
  base, rcs, norms = load(args, log)
  budget = args.budget_s - RESERVE_S
  host = host_info()
  kind = host["device_kind"]
  device = "h100" if "h100" in kind.lower() else "h200"
  log(f"device: {kind} ({host['platform']}); plan from the committed figures for {device}:")
  committed = committed_plan(rcs[device_plan.RULES[0]], device, budget, args.seeds, norms, log)
  scratch = args.scratch or pathlib.Path(tempfile.mkdtemp(prefix="moejax_device_study_"))
  results, cache = scratch / "results", scratch / "xla_cache"
  results.mkdir(parents=True, exist_ok=True)
  f, probe = probe_figures(base, committed, cache, kind, log)
  fixed = fix_steps(base, rcs, norms, f, budget, log)
  spent = elapsed()
  cached = fixed["train_cached"] and probe is not None
  planned = device_plan.plan(fixed["rc"], f, budget, args.seeds, norms, spent, cached)
  log(device_plan.table(planned, f, budget, spent))
  figures = {"committed": figures_dict(committed), "measured": figures_dict(f), "probe": probe}
  state = initial_state(args, host, figures, fixed, planned)
  log(f"scratch {scratch}")
  pack(results, args.out, state)
  run_arms(args, base, state, results, cache, scratch, log)
  pack(results, args.out, state)
  log(f"wrote {', '.join(str(args.out / f) for f in FILES)} at {elapsed():.0f} s")
  return 0


def figures_dict(f) -> dict | None:
  if f is None:
    return None
  return {"where": f.where, **{k: v._asdict() for k, v in f._asdict().items() if k != "where"}}


def run_arms(args, base, state: dict, results, cache, scratch, log) -> None:
  for arm in state["arms"]:
    left = args.budget_s - RESERVE_S - elapsed()
    need = expected_s(arm, state)
    if need > left:
      arm.update(status=device_report.SKIPPED, reason=f"needs {need:.0f} s, {left:.0f} s left")
      log(f"{arm['name']}: skipped ({arm['reason']})")
      continue
    log(f"{arm['name']}: start at {elapsed():.0f} s (expects {need:.0f} s, {left:.0f} s left)")
    workdir = scratch / "work" / arm["name"]
    t0 = time.monotonic()
    try:
      seconds = run_arm(arm_config(base, arm["rule"], arm["seed"], cache), workdir, log)
      keep(workdir, results / "runs" / arm["name"])
      arm.update(status=device_report.DONE, **{k: round(v, 1) for k, v in seconds.items()})
    except Exception as e:  # noqa: BLE001  (one arm's failure is reported, the rest go on)
      arm.update(status=device_report.FAILED, error=f"{type(e).__name__}: {first_line(e)}")
      log(f"{arm['name']}: failed: {arm['error']}")
    arm["measured_s"] = round(time.monotonic() - t0, 1)
    shutil.rmtree(workdir, ignore_errors=True)  # the checkpoint: gridded, not returned
    gc.collect()
    pack(results, args.out, state)
    log(f"{arm['name']}: {arm['status']} in {arm['measured_s']:.0f} s (at {elapsed():.0f} s)")


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  cli.run_main(lambda: run(args))  # a UserError: one line, exit 2


if __name__ == "__main__":
  main()
