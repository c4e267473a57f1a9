"""Factor A's retrained runs (sweep_tasks.py) on the nextline task, every cell, then copied.

    python experiments/calibration/tasks_grid.py [--root runs]
        [--items 500] [--only RUN,...]

After `python -m launch.sweep experiments/calibration/sweep_tasks.py --backend local` has
trained and loss-gridded the runs (each keeps its checkpoints under `--root`):

1. the task, once: `python -m moejax.tasks nextline --workdir <first run> --out
   ROOT/calibration_tasks/tasks --items N --seed 0`; every run shares the held-out split
   (`data.split_seed` does not depend on `train.seed`), so every run is scored on the same
   items, paired by item and by seed;
2. per finished run without it: `python -m moejax.evaluate --workdir RUN --tasks
   ROOT/calibration_tasks/tasks/nextline.yaml --k1 8,4,2,1 --k2 K2`, K2 the cells H1 and H10
   read (`k1,K` for qwen3_moe, `native,k1` for olmoe);
3. the run's `eval/tasks/` copied beside its loss grid in sweep_tasks.py's results folder, and
   the task's JSONL beside the runs (`tasks/nextline.jsonl`), so report.py reads them all.

A run's checkpoints are what step 2 reads; nothing here trains. Runs not trained yet are
listed and skipped, so the command can be rerun while the sweep goes on.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import sweep_tasks  # noqa: E402

TASK = "nextline"
K1 = "8,4,2,1"
# the cells H1 and H10 read: the k2 = K saving for the renormalized rule (its native cell at
# k1 < K is k2 = k1), renormalizing against the native cell for the unnormalized one
K2 = {"qwen3_moe": "k1,K", "olmoe": "native,k1"}


def trained(run_dir: pathlib.Path) -> bool:
  """Trained and loss-gridded by the sweep (its final grid written after training)."""
  return (run_dir / "eval" / "k_grid.jsonl").is_file() and (run_dir / "checkpoints").is_dir()


def sh(*args: str) -> None:
  print("+", " ".join(args), flush=True)
  subprocess.run([sys.executable, *args], check=True, cwd=REPO)


def make_task(first: pathlib.Path, tasks: pathlib.Path, items: int) -> pathlib.Path:
  yaml = tasks / f"{TASK}.yaml"
  if not yaml.is_file():
    sh("-m", "moejax.tasks", TASK, "--workdir", str(first), "--out", str(tasks),
       "--items", str(items), "--seed", "0")  # fmt: skip
  return yaml


def grid(run_dir: pathlib.Path, yaml: pathlib.Path, rule: str) -> None:
  if not (run_dir / "eval" / "tasks" / TASK / "k_grid.jsonl").is_file():
    sh("-m", "moejax.evaluate", "--workdir", str(run_dir), "--tasks", str(yaml),
       "--k1", K1, "--k2", K2[rule])  # fmt: skip


def copy(run_dir: pathlib.Path, results: pathlib.Path) -> None:
  dest = results / run_dir.name / "eval" / "tasks"
  shutil.copytree(run_dir / "eval" / "tasks", dest, dirs_exist_ok=True)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="runs", help="the sweep's runs root (launch.sweep --root)")
  p.add_argument("--items", type=int, default=500, help="nextline items (made once)")
  p.add_argument("--only", default="", help="comma-separated run names (default: all)")
  args = p.parse_args()
  sweep = sweep_tasks.get_sweep()
  root, results = REPO / args.root / sweep.name, REPO / sweep.results
  only = set(filter(None, args.only.split(",")))
  specs = {r.name: r for r in sweep.runs if not only or r.name in only}
  runs = [root / name for name in specs]
  ready = [r for r in runs if trained(r)]
  for r in runs:
    if r not in ready:
      print(f"{r.name}: not trained yet, skipped", flush=True)
  if not ready:
    return
  yaml = make_task(ready[0], root / "tasks", args.items)
  os.makedirs(results / "tasks", exist_ok=True)
  shutil.copy2(yaml.with_suffix(".jsonl"), results / "tasks" / f"{TASK}.jsonl")
  for r in ready:
    grid(r, yaml, specs[r.name].factors["rule"])
    copy(r, results)


if __name__ == "__main__":
  main()
