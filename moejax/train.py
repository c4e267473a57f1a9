"""`python -m moejax.train --config configs/X.py --workdir DIR [--config.a.b=v ...]`.

Trains from scratch, or resumes from the latest checkpoint in DIR when one exists.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from moejax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "A get_config() file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")


def main() -> int:
  cli.parse_flags(sys.argv, _CONFIG)
  if _CONFIG.value is None:
    cli.fail("--config is required, e.g. --config configs/quickstart.py")
  if not _WORKDIR.value:
    cli.fail("--workdir is required, e.g. --workdir runs/quickstart")
  from moejax import distributed  # pylint: disable=import-outside-toplevel  (jax import is slow)

  distributed.initialize()  # before any other JAX call; a no-op for a single process
  from moejax import runio, trainer  # pylint: disable=import-outside-toplevel

  main_process = distributed.is_main()
  log = print if main_process else (lambda *a, **k: None)
  _CONFIG.value.train.progress &= main_process
  try:
    trainer.train(_CONFIG.value, _WORKDIR.value, log=log)
  except trainer.Diverged as e:
    cli.fail(e, code=1)
  if _CONFIG.value.eval.after_train:
    from moejax import grid  # pylint: disable=import-outside-toplevel

    grid.run_grid(_WORKDIR.value, log=log)
    if main_process:
      print(runio.read_text(runio.path(_WORKDIR.value, "eval", "k_grid.md")))
      print(f"grid: {_WORKDIR.value}/eval/k_grid.{{jsonl,md,png}}")
  return 0


if __name__ == "__main__":
  cli.run_main(main)
