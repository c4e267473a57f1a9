"""Factor A retrained at 10 seeds (0-9) for the study in downstream accuracy (issue 52):
`python -m launch.sweep experiments/calibration/sweep_tasks.py --backend local`.

The same runs as sweep.py's factor A (configs/study_calibration.py, qwen3_moe and olmoe, 600
steps) at seeds 0-9, kept apart (`results` below) so the committed 5-seed report is not
mixed with runs of another commit. Each run keeps its final checkpoint for the task grid:
`python -m moejax.tasks nextline --workdir RUN --out TASK` once (every run shares the
held-out split: data.split_seed does not depend on train.seed), then
`python -m moejax.evaluate --workdir RUN --tasks TASK/nextline.yaml --k1 8,4,2,1
--k2 native,k1,K` per run (docs/kgrid.md "Downstream tasks").
"""

from launch.spec import RunSpec, Sweep, product

CONFIG = "configs/study_calibration.py"
CORE_RULES = ("qwen3_moe", "olmoe")
SEEDS = tuple(range(10))
# the loss grid's cells the reproduction reads (H1: native, k2 = k1, k2 = K), not the study's
# eight k2 choices with the `gain` fit, which took half of a run's time on 2 CPU cores; seeds
# 0 and 1 (both rules) were gridded at all eight before this was set
LOSS_K2 = "native,k1,K"


def get_sweep() -> Sweep:
  runs = [
    RunSpec(
      name=f"a-{p['rule']}-s{p['seed']}",
      config=CONFIG,
      overrides={"model.moe.rule": p["rule"], "train.seed": p["seed"], "eval.k2": LOSS_K2},
      factors={"factor": "A", "rule": p["rule"], "seed": p["seed"]},
    )
    for p in product(seed=SEEDS, rule=CORE_RULES)
  ]
  return Sweep(name="calibration_tasks", runs=runs, results="experiments/calibration/runs_tasks")
