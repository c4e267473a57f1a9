"""`--help` and `-h` on every `python -m moejax.X` command: the command's usage (its module
docstring), its flags, and where the config keys are documented; printed to stdout, exit 0.

Importing this module defines the `--help`/`-h` absl flag, so a command that parses its flags
with absl answers it wherever the flag comes on the line; `cli.parse_flags` (and `tasks`) look
for it first, so `--help` wins over any other problem of the line."""

from __future__ import annotations

import sys

from absl import flags

HELP_ARGS = ("--help", "-h", "--helpshort", "--helpfull")
KEYS = (
  "config keys: docs/config.md, or `python -m moejax.describe --keys [SECTION]` (SECTION:\n"
  "  train, data, model.moe, ...); a run sets one with --config.SECTION.KEY=VALUE"
)


def asked(argv: list[str]) -> bool:
  """True when the command line asks for help (`--help`, `-h`), before a bare `--`."""
  for arg in argv[1:]:
    if arg == "--":
      return False
    if arg in HELP_ARGS:
      return True
  return False


def text(doc: str | None = None) -> str:
  """The help of the running command: `doc` (default: the `__main__` module's docstring),
  the flags that module defines, and where the config keys are documented."""
  if doc is None:
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
  parts = [doc.strip()]
  listed = flags.FLAGS.main_module_help().strip()
  flag_lines = listed.splitlines()[1:]  # without the module's name
  parts.append("\n".join(["flags:", *flag_lines, "  -h, --help: this help"]))
  parts.append(KEYS)
  return "\n\n".join(p for p in parts if p) + "\n"


def show(doc: str | None = None) -> None:
  """Prints `text(doc)` to stdout and exits 0."""
  sys.stdout.write(text(doc))
  sys.stdout.flush()
  sys.exit(0)


class HelpFlag(flags.BooleanFlag):
  """`--help` / `-h`: the command's help (`show`), exit 0 (absl's own exits 1)."""

  def __init__(self):
    super().__init__("help", False, "show this help and exit", short_name="h")

  def parse(self, argument):
    if self._parse(argument):
      show()


if "help" not in flags.FLAGS:
  flags.DEFINE_flag(HelpFlag())
