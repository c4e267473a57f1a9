"""`python -m moejax.tasks nextline --config C --out DIR [--items N --choices 4]`.

Writes an lm-eval task made from the run's held-out documents (moejax.downstream.nextline):
DIR/nextline.yaml and DIR/nextline.jsonl, for `python -m moejax.evaluate --tasks
DIR/nextline.yaml`. `--workdir RUN` reads a trained run's saved config instead of --config.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from moejax import cli, usage
from moejax.config.reader import resolve
from moejax.downstream import nextline
from moejax.kgrid.loading import load_config

BUILDERS = ("nextline",)
_CONFIG = config_flags.DEFINE_config_file("config", None, "A get_config() file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Or a trained run whose config to read.")
_OUT = flags.DEFINE_string("out", None, "Folder for the task's YAML and JSONL.")
_ITEMS = flags.DEFINE_integer("items", nextline.Spec().items, "Items (distinct).")
_CHOICES = flags.DEFINE_integer("choices", nextline.Spec().choices, "Choices per item.")
_CONTEXT = flags.DEFINE_integer("context_chars", nextline.Spec().context_chars, "Context length.")
_SEED = flags.DEFINE_integer("seed", nextline.Spec().seed, "Seed of the draws.")


def positional(argv: list[str]) -> list[str]:
  """The arguments that are not flags nor a flag's value (every flag here takes one: a
  `--flag value` pair, or `--flag=value`)."""
  out, i = [], 1
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("-"):
      i += 1 if "=" in arg else 2
      continue
    out.append(arg)
    i += 1
  return out


def builder(argv: list[str]) -> str:
  """The one task builder named on the command line, or a one-line exit 2 naming what was
  given and the builders there are."""
  named, known = positional(argv), ", ".join(BUILDERS)
  if not named:
    cli.fail(f"name the task to build: python -m moejax.tasks {'|'.join(BUILDERS)} ...")
  if named[0] not in BUILDERS:
    cli.fail(f"{named[0]!r} is not a task builder; python -m moejax.tasks builds: {known}")
  if len(named) > 1:
    cli.fail(f"one task builder at a time: {named[0]!r}, then also {named[1]!r}")
  return named[0]


def main() -> int:
  if usage.asked(sys.argv):
    usage.show()
  name = builder(sys.argv)
  argv = [a for a in sys.argv if a != name]
  with_config = any(a.startswith("--config") for a in argv)
  cli.parse_flags(argv, _CONFIG if with_config else None)
  if not _OUT.value:
    cli.fail("--out is required: the folder for nextline.yaml and nextline.jsonl")
  cli.check_dir("--out", _OUT.value)  # a file, inside a file or unwritable: before the read
  if with_config == bool(_WORKDIR.value):
    cli.fail("give one of --config C (a configs/*.py file) or --workdir RUN")
  rc = resolve(_CONFIG.value) if with_config else load_config(_WORKDIR.value)
  spec = nextline.Spec(_ITEMS.value, _CHOICES.value, _CONTEXT.value, _SEED.value)
  path, n = nextline.write_task(rc.data, _OUT.value, spec)
  print(f"wrote {path} ({n} items): python -m moejax.evaluate --workdir RUN --tasks {path}")
  return 0


if __name__ == "__main__":
  cli.run_main(main)
