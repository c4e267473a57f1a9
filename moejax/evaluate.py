"""`python -m moejax.evaluate --workdir DIR [--step N] [--k1 8,4,2] [--k2 native,k1,K,4K,E,gain]`
(or `--tasks T[,T...]`: the same grid in downstream accuracy, docs/kgrid.md "Downstream tasks").

Evaluates a checkpoint at fewer experts (k1) under every normalization (k2) and the
rescaling cells (`sqrt`, `gain`) on the held-out split. Writes DIR/eval/k_grid.{jsonl,md,png}
for the latest checkpoint, or DIR/eval/step{N}/k_grid.* with --step N (docs/design.md §7); the
work is done by `moejax.kgrid`.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import flags

from moejax import cli
from moejax.config.sections import EvalConfig
from moejax.downstream import entry
from moejax.errors import UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with config.json and checkpoints/.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_K1 = flags.DEFINE_string("k1", "", "Comma-separated k1 values (default K, K/2, ..., 1).")
_K2 = flags.DEFINE_string(
  "k2",
  "",
  "Comma-separated k2: native, k1, K, 2K, 4K, E, integers, sqrt, gain "
  "(default eval.k2, else native,k1,K,2K,E).",
)
_SEQUENCES = flags.DEFINE_integer("sequences", None, "Held-out sequences (default eval.sequences).")
_BATCH = flags.DEFINE_integer("batch_size", None, "Eval batch size (default eval.batch_size).")
_RESAMPLES = flags.DEFINE_integer("resamples", None, "Bootstrap resamples (default 2000).")
_TASKS = flags.DEFINE_string("tasks", None, "lm-eval tasks (names or YAML files), comma-separated.")
_INCLUDE = flags.DEFINE_string("include_path", None, "--tasks: a folder of task YAMLs.")
_LIMIT = flags.DEFINE_integer("limit", None, "--tasks: at most this many items per task.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "--tasks: parameters in float32 or bfloat16.")
_NUM_FEWSHOT = flags.DEFINE_integer(
  "num_fewshot", None, "--tasks: few-shot examples per prompt (default: each task's own)."
)
_FEWSHOT_SEED = flags.DEFINE_integer(
  "fewshot_seed", 1234, "--tasks: seed of the few-shot draws, reset before every cell."
)
_CHAT = flags.DEFINE_bool(
  "apply_chat_template", False, "--tasks: render prompts with the imported tokenizer's chat template."
)
_DECODE_SPEED = flags.DEFINE_bool(
  "decode_speed", False, "Measure decode tok/s per (k1, batch) against the bandwidth bound."
)
_BATCHES = flags.DEFINE_string("batch", "1,8,32", "--decode_speed: batch sizes, comma-separated.")
_GAIN_SEQUENCES = flags.DEFINE_integer(
  "gain_sequences", None, "Calibration windows of the gain fit (default eval.gain_sequences)."
)


# the grid's flags -> the `eval.*` key each sets over the run's saved value
GRID_FLAGS = {
  "k1": "k1",
  "k2": "k2",
  "sequences": "sequences",
  "batch_size": "batch_size",
  "resamples": "bootstrap_resamples",
  "gain_sequences": "gain_sequences",
}


def grid_eval(saved: EvalConfig, **given) -> EvalConfig:
  """The run's `eval.*` with the grid flags that are given (not None or '') set over it; a
  value its key does not allow is a UserError naming the flag and the key."""
  ev = saved
  for name, value in given.items():
    if value is None or value == "":
      continue
    try:
      ev = dataclasses.replace(ev, **{GRID_FLAGS[name]: value})
    except UserError as e:
      raise UserError(f"--{name}={value}: {e}") from None
  return ev


def main() -> int:
  cli.parse_flags(sys.argv)
  if not _WORKDIR.value:
    cli.fail("--workdir is required, e.g. --workdir runs/quickstart")
  from moejax import distributed, runio  # pylint: disable=import-outside-toplevel

  config, checkpoints = (runio.path(_WORKDIR.value, n) for n in ("config.json", "checkpoints"))
  if config.exists() and not checkpoints.is_dir():  # orbax's manager would create it
    cli.fail(f"--workdir {_WORKDIR.value}: no checkpoints/ (not trained yet); train first")
  if _TASKS.value is not None:  # the grid in downstream accuracy (docs/kgrid.md)
    kw = {"include_path": _INCLUDE.value, "limit": _LIMIT.value, "dtype": _DTYPE.value}
    kw |= {"num_fewshot": _NUM_FEWSHOT.value, "fewshot_seed": _FEWSHOT_SEED.value,
           "apply_chat_template": _CHAT.value}  # fmt: skip
    kw |= {"k1": _K1.value, "k2": _K2.value, "step": _STEP.value, "batch_size": _BATCH.value}
    entry.run_tasks(_WORKDIR.value, _TASKS.value, resamples=_RESAMPLES.value, **kw)
    return 0
  if _DECODE_SPEED.value:  # decode speed per (k1, batch) (docs/performance.md)
    return _decode_speed(_WORKDIR.value)
  distributed.initialize()  # before any other JAX call; a no-op for a single process
  main_process = distributed.is_main()
  from moejax.kgrid.loading import load_config  # pylint: disable=import-outside-toplevel
  from moejax.kgrid.run import run_grid  # pylint: disable=import-outside-toplevel  (imports jax)

  ev = grid_eval(
    load_config(_WORKDIR.value).eval,
    k1=_K1.value,
    k2=_K2.value,
    sequences=_SEQUENCES.value,
    batch_size=_BATCH.value,
    resamples=_RESAMPLES.value,
    gain_sequences=_GAIN_SEQUENCES.value,
  )
  log = print if main_process else (lambda *a, **k: None)
  run_grid(_WORKDIR.value, ev, step=_STEP.value, log=log)
  if main_process:
    sub = [] if _STEP.value is None else [f"step{_STEP.value}"]
    print(runio.read_text(runio.path(_WORKDIR.value, "eval", *sub, "k_grid.md")))
  return 0


def _decode_speed(workdir: str) -> int:
  from moejax.config import grid_labels  # pylint: disable=import-outside-toplevel
  from moejax.decode import speed  # pylint: disable=import-outside-toplevel
  from moejax.kgrid.loading import load_config  # pylint: disable=import-outside-toplevel

  batches = []
  for tok in _BATCHES.value.split(","):
    if not tok.strip().isdigit() or int(tok) < 1:
      cli.fail(f"--batch value {tok.strip()!r} is not allowed; use integers >= 1, e.g. 1,8,32")
    batches.append(int(tok))
  rc = load_config(workdir)
  if rc.moe is None:
    raise UserError(f"{workdir} holds a dense model (model.moe_every=0); nothing to route")
  k1s = grid_labels.parse_k1(_K1.value, rc.moe.top_k, rc.moe.n_experts)
  speed.run_decode_speed(workdir, rc, k1s=k1s, batches=batches, step=_STEP.value)
  return 0


if __name__ == "__main__":
  cli.run_main(main)
