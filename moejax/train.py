"""`python -m moejax.train --config configs/X.py --workdir DIR [--config.a.b=v ...]`.

Trains from scratch, or resumes from the newest readable checkpoint in DIR. SIGTERM or
Ctrl-C saves a checkpoint at the current step and exits 0; rerun the same command to go on.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from moejax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "A get_config() file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")


def main() -> int:
  cli.parse_flags(sys.argv, _CONFIG, example="configs/quickstart.py")
  if not _WORKDIR.value:
    cli.fail("--workdir is required, e.g. --workdir runs/quickstart")
  from moejax import distributed  # pylint: disable=import-outside-toplevel  (jax import is slow)

  distributed.initialize()  # before any other JAX call; a no-op for a single process
  from moejax import runio  # pylint: disable=import-outside-toplevel
  from moejax.training import trainer  # pylint: disable=import-outside-toplevel
  from moejax.config.reader import resolve  # pylint: disable=import-outside-toplevel

  main_process = distributed.is_main()
  _CONFIG.value.train.progress &= main_process
  rc = resolve(_CONFIG.value)  # every key and the grid's cells, before anything is built

  log = print if main_process else (lambda *a, **k: None)
  try:
    summary = trainer.train(rc, _WORKDIR.value, log=log)
  except (trainer.Diverged, trainer.SaveFailed) as e:
    cli.fail(e, code=1)
  if summary["stopped_by"]:
    log(f"stopped by {summary['stopped_by']} at step {summary['step']}; rerun to resume")
    return 0
  if rc.eval.after_train:
    from moejax.kgrid.run import run_grid  # pylint: disable=import-outside-toplevel

    run_grid(_WORKDIR.value, rc.eval, log=log)
    if main_process:
      print(runio.read_text(runio.path(_WORKDIR.value, "eval", "k_grid.md")))
      print(f"grid: {_WORKDIR.value}/eval/k_grid.{{jsonl,md,png}}")
  return 0


if __name__ == "__main__":
  cli.run_main(main)
