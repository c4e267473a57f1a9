"""The calibration study at accelerator scale, in one device call:

    python experiments/calibration/device_study.py --out DIR [--budget-s 480] [--seeds 5]
        [--set KEY=VALUE ...] [--config configs/study_calibration.py:device] [--scratch DIR]

Trains qwen3_moe (renormalized) and olmoe (unnormalized) on `configs/study_calibration.py:
device`, seed-major (every rule gets seed n before any gets n + 1), and grids each final
checkpoint at k1 in {8, 4, 2, 1} x k2 in {native, k1, K, E} plus `sqrt` and `gain` (the
preset's eval.k1/k2). First it prints the plan (`device_plan`: each arm's seconds from the
committed H200 tokens/s and compile times); then it runs every arm whose time fits what is
left of `--budget-s` (counted from this process's start, less RESERVE_S for the report):
the plan's figure until an arm of the same rule has run, that arm's measured time after.
An arm that does not fit is listed as skipped; one that fails (e.g. diverges) as failed.

In one process: `moejax.train`'s and `moejax.evaluate`'s entry points (`trainer.train`,
`kgrid.run.run_grid`) called in turn. A process per arm would pay JAX's import, the CUDA
client's start and the corpus load again for every arm; here they are paid once, and the
persistent compile cache (`train.compile_cache`, one folder under --scratch) serves a rule's
later seeds in the same way.

DIR receives four files, rewritten after every arm so a call cut off mid-way still returns
what finished: `runs.tar.gz` (runs/<arm>/{config.json, metrics.jsonl, eval/k_grid.jsonl};
no checkpoints: they stay under --scratch and are deleted once gridded), `plan.json` (the
plan, each arm's status and measured seconds, the host, commit and device kind),
`report.md` (`device_report.section`: H1, H2 and H10 beside the CPU study's factor A) and
`log.txt`. Unpack runs.tar.gz beside plan.json (experiments/calibration/device/) and
`python experiments/calibration/report.py` puts the section into the study's README.
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

import device_plan
import device_report

from moejax import cli
from moejax.errors import UserError

CONFIG = "configs/study_calibration.py:device"
RESERVE_S = 20.0  # the report and the archive after the last arm
KEEP = ("config.json", "metrics.jsonl", "eval/k_grid.jsonl")
FILES = ("runs.tar.gz", "plan.json", "report.md", "log.txt")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path, help="where the 4 files go")
  p.add_argument("--budget-s", type=float, default=480.0, help="seconds from start to report")
  p.add_argument("--seeds", type=int, default=5, help="at most this many seeds per rule")
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--scratch", type=pathlib.Path, default=None, help="checkpoints, cache")
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
  from moejax.data import pipeline  # pylint: disable=import-outside-toplevel
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

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
  from moejax.kgrid.run import run_grid  # pylint: disable=import-outside-toplevel
  from moejax.training import trainer  # pylint: disable=import-outside-toplevel
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

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
  """The seconds this arm is expected to take: the last measured arm of its rule (a later
  seed: its programs come from the compile cache); for a rule's first arm, the measured first
  arm of another rule (the same shape, as many programs to compile); else the plan's."""
  ran = [a for a in state["arms"] if a.get("measured_s") and a["status"] == device_report.DONE]
  same = [a for a in ran if a["rule"] == arm["rule"]]
  if same:
    return same[-1]["measured_s"]
  cold = [a for a in ran if a["seed"] == arm["seed"] == 0]
  return cold[0]["measured_s"] if cold else arm["planned_s"]


def run(args) -> int:
  args.out.mkdir(parents=True, exist_ok=True)
  log = Log(args.out / "log.txt")
  path = args.config if os.path.exists(args.config.partition(":")[0]) else str(REPO / args.config)
  base = cli.load_file(path)
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  preset = resolve(base)  # the plan's figures are measured at the preset's own shape
  for assignment in args.set:
    apply_set(base, assignment)
  resolve(base)  # a bad key or value: one line, before anything trains
  if args.seeds < 1 or args.budget_s <= 0:
    raise UserError("--seeds must be >= 1 and --budget-s > 0")
  fit_heldout(base, log)
  rcs = {r: resolve(arm_config(base, r, 0, pathlib.Path("."))) for r in device_plan.RULES}
  m = device_plan.measured(preset)
  if device_plan.shape_label(preset) != device_plan.shape_label(rcs[device_plan.RULES[0]]):
    log("note: --set changed the expert shape; the plan's seconds are the preset shape's")
  norms = {r: rc.rule.norm != "none" for r, rc in rcs.items()}
  budget = args.budget_s - RESERVE_S
  planned = device_plan.plan(rcs[device_plan.RULES[0]], m, budget, args.seeds, norms)
  log(device_plan.table(planned, m, budget))
  scratch = args.scratch or pathlib.Path(tempfile.mkdtemp(prefix="moejax_device_study_"))
  results, cache = scratch / "results", scratch / "xla_cache"
  results.mkdir(parents=True, exist_ok=True)
  state = {
    "command": " ".join(["python", "experiments/calibration/device_study.py", *sys.argv[1:]]),
    "budget_s": args.budget_s,
    "reserve_s": RESERVE_S,
    "measured": m._asdict(),
    "host": host_info(),
    "arms": [
      {
        "name": p.arm.name,
        "rule": p.arm.rule,
        "seed": p.arm.seed,
        "planned_s": round(p.total_s, 1),
        "plan": p.status,
        "status": "pending",
      }
      for p in planned
    ],
  }
  log(f"device: {state['host']['device_kind']} ({state['host']['platform']}); scratch {scratch}")
  pack(results, args.out, state)
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
  pack(results, args.out, state)
  log(f"wrote {', '.join(str(args.out / f) for f in FILES)} at {elapsed():.0f} s")
  return 0


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  cli.run_main(lambda: run(args))  # a UserError: one line, exit 2


if __name__ == "__main__":
  main()
