"""Command-line plumbing shared by `moejax.train`, `moejax.evaluate` and `moejax.describe`:
flag parsing, config files (`load_file`), one-line errors and exit codes.

User errors (bad config values, unknown keys, missing files) print one line and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import inspect
import os
import re
import stat
import sys
import traceback
import types
from typing import Callable

import ml_collections
from absl import flags

from moejax import remote, usage
from moejax.config import renames
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
  """The message for the first `--config.a.b=v` override whose key the loaded config does
  not have (`renames.unknown_key`: its new name, or the nearest key), or None."""
  for arg in argv:
    m = re.match(r"--config\.([\w.]+)(=|$)", arg)
    if not m:
      continue
    node, parts = cfg, m.group(1).split(".")
    for i, part in enumerate(parts):
      if not hasattr(node, "keys"):
        leaf = ".".join(parts[:i])
        return f"--config.{m.group(1)}: {leaf} is a key, not a section; set --config.{leaf}=..."
      if part not in node:
        missing = ".".join(parts[: i + 1])
        return renames.unknown_key(missing, node.keys(), flag=True, given=m.group(1))
      node = node[part]
  return None


def parse_flags(argv: list[str], config_flag=None, example: str = "configs/quickstart.py") -> None:
  """Parses absl flags, and loads `config_flag` (ml_collections loads lazily), turning
  every parse or load problem into a one-line exit 2. With `config_flag`, `--config` is
  required (`example`: a file to suggest), and its file is first loaded by `load_file`,
  which names the file for a syntax error, a bad `:arg` or a get_config that raises.
  `--help` or `-h` anywhere prints the command's help and exits 0 (`moejax.usage`)."""
  if usage.asked(argv):
    usage.show()
  spec = config_path(argv) if config_flag is not None else None
  override = next((a for a in argv if a.startswith("--config.")), None)
  if config_flag is not None and spec is None and override:  # absl: "Unknown ... flag"
    fail(f"--config is required, e.g. --config {example} ({override} overrides a key of it)")
  base = _load(spec) if spec is not None else None
  try:
    flags.FLAGS(argv)
    if config_flag is not None and config_flag.value is None:
      fail(f"--config is required, e.g. --config {example}")
    if config_flag is not None:
      config_flag.value.keys()  # a failed load only raises on first use
  except flags.Error as e:
    fail(e)
  except OSError as e:  # ml_collections re-raises a failed config load as OSError
    fail(f"cannot load --config {spec}: {e}")
  except (AttributeError, KeyError) as e:
    unknown = _unknown_key(argv, base) if base is not None else None
    fail(unknown or f"bad --config override ({e})")


def _load(spec: str) -> ml_collections.ConfigDict:
  """The config file alone (no overrides), or a one-line exit 2 naming the file."""
  try:
    return load_file(spec)
  except UserError as e:
    fail(e)


def _line(path: str, e: BaseException) -> str:
  """`path:N`, N the last line of `path` in the traceback of `e` (where it was raised, or the
  line of the file that called into the code that raised it)."""
  frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
  return f"{path}:{frames[-1].lineno}" if frames else path


def exec_file(path: str, label: str, name: str) -> types.ModuleType:
  """Runs the Python file `path` as module `name`; a syntax error or an exception at its top
  level is a one-line UserError `label path:line: ...` (a config file, a sweep file)."""
  with open(path) as f:
    source = f.read()
  try:
    code = compile(source, path, "exec")
  except SyntaxError as e:
    raise UserError(f"{label} {path}:{e.lineno}: syntax error ({e.msg})") from None
  module = types.ModuleType(name)
  module.__file__ = path
  try:
    exec(code, module.__dict__)  # pylint: disable=exec-used
  except Exception as e:  # anything a module's top level can raise
    raise UserError(
      f"{label} {_line(path, e)}: loading it raised {type(e).__name__}: {e}"
    ) from None
  return module


def call_file(path: str, label: str, fn: Callable, *args):
  """`fn(*args)`, `fn` a function of the file `exec_file` ran; an exception is a one-line
  UserError `label path:line: fn raised ...`, a UserError of its own keeps its text."""
  try:
    return fn(*args)
  except UserError:
    raise
  except Exception as e:  # a file's own check, e.g. study_renorm's unknown rule
    where = _line(path, e)
    raise UserError(f"{label} {where}: {fn.__name__}() raised {type(e).__name__}: {e}") from None


def load_file(spec: str) -> ml_collections.ConfigDict:
  """The config of `path[:arg]` (a `get_config([arg])` file); every way it can fail is a
  one-line UserError naming the file: missing, a syntax error, an import or get_config
  that raises, an argument it does not take, a result that is not a ConfigDict."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise UserError(
      f"cannot load --config {spec}: {path}: {not_a_file(path)}; give a get_config() file, "
      "e.g. configs/quickstart.py"
    )
  module = exec_file(path, "--config", "_moejax_config")
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise UserError(f"--config {path}: defines no get_config()")
  if arg and not inspect.signature(get_config).parameters:
    raise UserError(f"--config {spec}: get_config() of {path} takes no argument; drop ':{arg}'")
  c = call_file(path, "--config", get_config, *([arg] if arg else []))
  if not isinstance(c, ml_collections.ConfigDict):
    raise UserError(
      f"--config {spec}: get_config() returned {type(c).__name__}; it must return an "
      "ml_collections.ConfigDict (e.g. moejax.config.base_config() with changes)"
    )
  return c


_KINDS = (
  (stat.S_ISDIR, "a directory, not a file"),
  (stat.S_ISFIFO, "a named pipe (FIFO), not a regular file"),
  (stat.S_ISSOCK, "a socket, not a regular file"),
  (stat.S_ISCHR, "a device, not a regular file"),
  (stat.S_ISBLK, "a device, not a regular file"),
)


def not_a_file(path: str) -> str:
  """What local `path`, not a regular file, is instead: `no such file`, `a directory, not a
  file`, `a named pipe (FIFO), not a regular file`, ..., or the OS's reason."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return "no such file"
  except OSError as e:
    return f"not reachable ({e.strerror})"
  return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_dir(flag: str, path: str) -> None:
  """A UserError naming `flag` unless `path` is a directory, or can be made one, that this
  process may write into: not a file, not inside one, not under a read-only folder. Nothing
  is created. A URL is not checked that way (object stores have no files in the way); a
  gs:// one's bucket must answer (`moejax.remote.check`)."""
  if "://" in path:
    remote.check(path, f"{flag} {path}")  # a gs:// bucket answers, fast (moejax.remote)
    return
  parent = path
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent.rstrip(os.sep))
  parent = parent or "."
  if not os.path.isdir(parent):
    raise UserError(f"{flag} {path}: {parent} is a file, not a directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f"{flag} {path}: {parent} is not writable")


def config_path(argv: list[str]) -> str | None:
  """The `--config[=]path[:arg]` value on the command line, if any."""
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
  return None


_OS_ERRORS = {
  FileNotFoundError: "no such file or directory",
  PermissionError: "permission denied",
  IsADirectoryError: "is a directory",
}


def os_error_line(e: OSError) -> str:
  """`reason: path` for an OSError, whether raised by the OS (strerror and filename set) or
  by a filesystem library that passes only the path (gcsfs: `FileNotFoundError(path)`)."""
  reason = e.strerror or _OS_ERRORS.get(type(e), type(e).__name__)
  where = e.filename if e.filename is not None else " ".join(map(str, e.args))
  return f"{reason}: {where}" if where else reason


def run_main(main: Callable[[], int | None]) -> None:
  """Runs `main`, mapping UserError / missing files to one line and exit code 2. With
  MOEJAX_TRACEBACK=1 the traceback is printed above that line (where a library raised it)."""
  try:
    code = main()
  except UserError as e:
    _traceback_if_asked()
    fail(e)
  except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
    _traceback_if_asked()
    fail(os_error_line(e))
  except KeyboardInterrupt:  # outside the train loop, which saves and exits 0 on Ctrl-C
    fail("interrupted outside the train loop (in the loop, Ctrl-C checkpoints and exits 0)", 130)
  sys.exit(code or 0)


def _traceback_if_asked() -> None:
  if os.environ.get("MOEJAX_TRACEBACK") == "1":
    traceback.print_exc()
