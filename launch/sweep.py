"""`python -m launch.sweep experiments/<name>/sweep.py --backend local|sky [options]`.

Every run goes to `<root>/<sweep>/<run>` and into the wandb group named after the sweep,
tagged with its factors. `local` runs N at a time here; `sky` submits SkyPilot managed jobs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from launch import commands, cores, local, precheck, sky, spec
from moejax import cli, usage
from moejax.errors import UserError

PROG = "python -m launch.sweep"
# sky-only flags with their defaults: given with --backend local, they are refused
PRECHECK = {"precheck_workers": 0, "precheck_per_run": False, "precheck_cache": "",
            "precheck_fresh": False}  # fmt: skip


class Parser(argparse.ArgumentParser):
  """argparse with the project's one-line errors (exit 2) instead of the usage block."""

  def error(self, message: str):
    print(f"error: {message}; see {PROG} --help", file=sys.stderr)
    sys.exit(2)


def parser() -> argparse.ArgumentParser:
  p = Parser(
    prog=PROG,
    description=__doc__.split("\n")[2],
    epilog=usage.KEYS,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("sweep_file", help="experiments/<name>/sweep.py defining get_sweep()")
  p.add_argument("--backend", choices=("local", "sky"), required=True)
  p.add_argument("--parallel", type=int, default=1, help="local: runs at a time")
  p.add_argument(
    "--cores-per-run",
    type=int,
    default=cores.AUTO,
    help="local: pin each running run to its own N cores (0: no pinning; default: none "
    "with --parallel 1, else the cores split evenly)",
  )
  p.add_argument("--only", default="", help="comma-separated run names (default: all)")
  p.add_argument("--dry-run", action="store_true", help="write/print commands, run nothing")
  p.add_argument("--root", default="", help="runs root: a folder, or gs://bucket/... for sky")
  p.add_argument("--accelerators", default="", help="sky: e.g. tpu-v5e-16 or H100:8")
  p.add_argument("--use-spot", action="store_true", help="sky: spot/preemptible capacity")
  p.add_argument("--out", default="", help="sky: folder for task YAMLs (runs/launch/<sweep>)")
  p.add_argument(
    "--precheck-workers",
    type=int,
    default=0,
    help="sky: processes compiling the precheck's distinct programs (default 0: one per core "
    "for GPUs, one per two cores for TPU slices, whose compiler runs on two)",
  )
  p.add_argument(
    "--precheck-per-run",
    action="store_true",
    help="sky: compile every run's program, not one per memory signature (launch/precheck.py)",
  )
  p.add_argument(
    "--precheck-cache",
    default="",
    help="sky: folder keeping the precheck's compiled answers, keyed by the lowered program, "
    "target and compilers (default: $MOEJAX_AOT_CACHE, else ~/.cache/moejax/aot; 'none': off)",
  )
  p.add_argument(
    "--precheck-fresh",
    action="store_true",
    help="sky: compile every program again, replacing what --precheck-cache holds",
  )
  return p


def check_args(args) -> None:
  """The flags' values and combinations, before the sweep file is read."""
  if args.precheck_workers < 0:
    raise UserError(
      f"--precheck-workers {args.precheck_workers} is not allowed; use an int >= 1, "
      "or 0 for the default (one per core, one per two cores for TPU slices)"
    )
  given = [k for k, default in PRECHECK.items() if getattr(args, k) != default]
  if args.backend == "local" and given:
    flags = ", ".join("--" + k.replace("_", "-") for k in given)
    raise UserError(
      f"{flags}: the precheck is the sky backend's; --backend local runs no precheck "
      "(each run compiles for itself), so drop it or use --backend sky"
    )


def run_local(sweep: spec.Sweep, runs: list[spec.RunSpec], args) -> int:
  if args.parallel < 1:
    raise UserError(f"--parallel {args.parallel} is not allowed; use an int >= 1")
  if args.cores_per_run == cores.AUTO:
    args.cores_per_run = cores.default_per_run(args.parallel)
  cores.groups(args.cores_per_run, args.parallel)  # refuses a request this machine can't pin
  root = args.root or "runs"
  for run in runs:  # the dry run too: each run directory can be made (nothing is created)
    cli.check_dir(f"--root {root}: run directory", commands.run_dir(root, sweep, run))
  jobs = local.plan(sweep, runs, root)
  if args.dry_run:
    for job in jobs:
      print(f"# {job.run.name}: {job.state}")
      for argv in job.todo:
        print(shlex.join(argv))
    return 0
  failed = local.run(sweep, jobs, args.parallel, cores_per_run=args.cores_per_run)
  if failed:
    print(
      f"error: {len(failed)} run(s) failed or stopped early (rerun to resume):", file=sys.stderr
    )
    for job in failed:
      print(f"  {job.run.name}: {job.log}", file=sys.stderr)
    return 1
  print(f"all {len(jobs)} run(s) complete under {os.path.join(root, sweep.name)}")
  return 0


def run_sky(sweep: spec.Sweep, runs: list[spec.RunSpec], args) -> int:
  if not args.root:
    raise UserError("--root is required for --backend sky, e.g. --root gs://my-bucket/runs")
  exe = sky.find_sky()
  folder = args.out or os.path.join("runs", "launch", sweep.name)
  argvs = sky.write(folder, sweep, runs, args.root, args.accelerators, args.use_spot, exe)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the checks compile; no local device needed
  precheck.check_runs(
    sweep,
    runs,
    lambda r: sky.compute_for(sweep, r, args.accelerators, args.use_spot),
    workers=args.precheck_workers,
    per_run=args.precheck_per_run,
    cache_dir=None if args.precheck_cache == "none" else args.precheck_cache,
    fresh=args.precheck_fresh,
  )
  if args.dry_run:
    for task in sky.validate(exe, [a[-1] for a in argvs]):
      print(
        f"valid: {task['path']} ({task['name']}, {task['num_nodes']} node(s), "
        f"{', '.join(task['resources'])})"
      )
    print(f"dry run: task YAMLs and {os.path.join(folder, 'commands.sh')}; nothing launched")
    return 0
  failed = sky.submit(argvs)
  if failed:
    print(f"error: {len(failed)} job(s) failed to submit: {', '.join(failed)}", file=sys.stderr)
    return 1
  print(f"submitted {len(argvs)} managed job(s); watch them with: {exe} jobs queue")
  return 0


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:
    check_args(args)
    sweep = spec.load(args.sweep_file)
    runs = spec.select(sweep, args.only)
    return (run_local if args.backend == "local" else run_sky)(sweep, runs, args)
  except UserError as e:
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130


if __name__ == "__main__":
  sys.exit(main())
