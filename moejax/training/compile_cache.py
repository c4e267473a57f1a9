"""JAX's persistent compilation cache for training (`train.compile_cache`), set before the
first compile: a second run of the same program (a sweep's runs, a resume) reads its
executables back instead of compiling them.

`auto` (the default) keeps a cache JAX was already given (JAX_COMPILATION_CACHE_DIR, or
`jax.config` in this process) and otherwise uses `~/.cache/moejax/xla`; a path (local or
gs://) is used as given; '' turns it off. The sweep launcher points every run of a sweep at
`<root>/<sweep>/xla_cache` (launch/commands.py). The AOT paths (moejax.aot, describe
--topology/--gpu, the sweep precheck) never call this: their compile-only clients cannot
read entries back. JAX's thresholds apply (`jax_persistent_cache_min_compile_time_secs`,
1 s by default: the train and eval steps are kept, not the small eager ops).
"""

from __future__ import annotations

import os
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache

from moejax import remote
from moejax.errors import UserError

AUTO = "auto"
DIR_FLAG = "jax_compilation_cache_dir"


def default_dir() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "moejax", "xla")


def resolve(setting: str) -> str | None:
  """The cache directory `train.compile_cache` names (None: off)."""
  if setting == AUTO:
    return jax.config.values.get(DIR_FLAG) or default_dir()
  return os.path.expanduser(setting) if setting else None


def _check_writable(setting: str, cache: str) -> None:
  """`cache` made if absent, and a file written and removed there, or a one-line UserError
  (JAX would warn at every compile, in several lines, and cache nothing)."""
  try:
    os.makedirs(cache, exist_ok=True)
  except OSError as e:
    raise UserError(
      f"train.compile_cache={setting!r}: {cache} is not a directory that can be created "
      f"({e.strerror}); use a writable folder, gs://..., or '' (off)"
    ) from None
  try:
    with tempfile.TemporaryFile(dir=cache):
      pass
  except OSError as e:
    raise UserError(
      f"train.compile_cache={setting!r}: {cache} is not writable ({e.strerror}); use a "
      "writable folder, gs://..., or '' (off)"
    ) from None


def enable(setting: str) -> str | None:
  """Points JAX at the cache `setting` names (or turns it off) and returns its directory.
  A change of directory resets JAX's handle, so it also applies after earlier compiles."""
  cache = resolve(setting)
  if cache is not None and "://" in cache:
    remote.check(cache, f"train.compile_cache={setting!r}")
  if cache is not None and "://" not in cache:
    _check_writable(setting, cache)
  changed = jax.config.values.get(DIR_FLAG) != cache
  if changed:
    jax.config.update(DIR_FLAG, cache)
    compilation_cache.reset_cache()
  return cache
