"""Command-line plumbing shared by `moejax.train` and `moejax.evaluate`.

User errors (bad config values, unknown keys, missing files) print one line and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

from absl import flags

from moejax.errors import UserError


def fail(message: str, code: int = 2) -> None:
  """Prints `error: message` on one line to stderr and exits at once.

  `os._exit` skips interpreter teardown, where orbax's abandoned restore coroutines would
  print tracebacks; every checkpoint write has already completed (saves are synchronous).
  """
  print("error: " + " ".join(str(message).split()), file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _unknown_key(argv: list[str], cfg) -> str | None:
  """The first `--config.a.b=v` override whose key the loaded config does not have."""
  for arg in argv:
    m = re.match(r"--config\.([\w.]+)(=|$)", arg)
    if not m:
      continue
    node = cfg
    for part in m.group(1).split("."):
      if not hasattr(node, "keys") or part not in node:
        return m.group(1)
      node = node[part]
  return None


def parse_flags(argv: list[str], config_flag=None) -> None:
  """Parses absl flags, and loads `config_flag` (ml_collections loads lazily), turning
  every parse or load problem into a one-line exit 2. The config file is first loaded by
  `config.load_file`, which names the file for a syntax error, a bad `:arg` or a
  get_config that raises."""
  spec = config_path(argv) if config_flag is not None else None
  base = _load(spec) if spec is not None else None
  try:
    flags.FLAGS(argv)
    if config_flag is not None and config_flag.value is not None:
      config_flag.value.keys()  # a failed load only raises on first use
  except flags.Error as e:
    fail(e)
  except OSError as e:  # ml_collections re-raises a failed config load as OSError
    fail(f"cannot load --config {spec}: {e}")
  except (AttributeError, KeyError) as e:
    key = _unknown_key(argv, base) if base is not None else None
    fail(
      f"unknown config key --config.{key}; see the keys in moejax/config.py"
      if key
      else f"bad --config override ({e})"
    )


def _load(spec: str):
  """The config file alone (no overrides), or a one-line exit 2 naming the file."""
  from moejax import config  # pylint: disable=import-outside-toplevel

  try:
    return config.load_file(spec)
  except UserError as e:
    fail(e)


def config_path(argv: list[str]) -> str | None:
  """The `--config[=]path[:arg]` value on the command line, if any."""
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
  return None


def run_main(main: Callable[[], int | None]) -> None:
  """Runs `main`, mapping UserError / missing files to one line and exit code 2."""
  try:
    code = main()
  except UserError as e:
    fail(e)
  except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
    fail(f"{e.strerror}: {e.filename}")
  except KeyboardInterrupt:  # outside the train loop, which saves and exits 0 on Ctrl-C
    fail("interrupted outside the train loop (in the loop, Ctrl-C checkpoints and exits 0)", 130)
  sys.exit(code or 0)
