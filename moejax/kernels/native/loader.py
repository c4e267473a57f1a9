"""Finding, loading and registering the native kernel's shared library (once per process).

The library is built by `pip install -e .` (setup.py, an optional extension: no compiler, no
library) next to this file, with the OpenBLAS it calls (`libscipy_openblas.so`, from the
scipy-openblas32 wheel, copied beside it at build time). `MOEJAX_NATIVE_LIB` names another
build (the sanitizer test's). Nothing is loaded until a program using the kernel is traced
(`load`). When anything is missing, `load()` says why: `impl=auto` then runs `fused` (one log
line), and an explicit `impl=native` is a one-line UserError (`moejax.kernels.registry`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import sysconfig
from pathlib import Path

import jax

from moejax.errors import UserError

HERE = Path(__file__).parent
TARGETS = (  # the planned calls (`ops`) and the dropless ones that plan inside (`dropless`)
  "moejax_native_forward",
  "moejax_native_backward",
  "moejax_native_dropless_forward",
  "moejax_native_dropless_backward",
)


def library_path() -> Path | None:
  """The built kernel: $MOEJAX_NATIVE_LIB, else `_moejax_native*.so` beside this file, this
  interpreter's build first (a source tree shared by editable installs of two Pythons holds
  one per Python; the library uses no Python API, so either loads)."""
  if os.environ.get("MOEJAX_NATIVE_LIB"):
    return Path(os.environ["MOEJAX_NATIVE_LIB"])
  own = HERE / f"_moejax_native{sysconfig.get_config_var('EXT_SUFFIX')}"
  found = sorted(HERE.glob("_moejax_native*.so"))
  return own if own.exists() else (found[0] if found else None)


def blas_candidates(lib_dir: Path) -> list[tuple[str, str, str, int, str]]:
  """(path, sgemm symbol, sgemv symbol, 64-bit ints, thread-count setter) to try, in order:
  the OpenBLAS copied beside the kernel, then an installed scipy-openblas32 wheel's (found,
  not imported)."""
  spec = importlib.util.find_spec("scipy_openblas32")
  wheel = [] if spec is None else [Path(d) / "lib" for d in spec.submodule_search_locations]
  dirs = [lib_dir, *wheel]
  found = [p for d in dirs for p in sorted(d.glob("libscipy_openblas*.so"))]
  return [(str(p), "scipy_cblas_sgemm", "scipy_cblas_sgemv", 0, "scipy_openblas_set_num_threads")
          for p in found]  # fmt: skip


AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")  # what OpenBLAS's SkylakeX kernels need


def coretype(cpu_flags: set[str], env: dict) -> str | None:
  """The OPENBLAS_CORETYPE our private OpenBLAS loads with: $MOEJAX_OPENBLAS_CORETYPE, else
  SKYLAKEX on a CPU with AVX-512, else None (OpenBLAS's own choice, or the process's
  OPENBLAS_CORETYPE). On this machine's AMD EPYC (AVX-512, full-width FMA), OpenBLAS 0.3.34
  detects a Haswell, and the environment sets OPENBLAS_CORETYPE=Haswell too: its AVX2
  kernels run [256, 256] x [256, 512] at 93-107 GFLOP/s on one core, SkylakeX's at 172-195
  (docs/performance.md). The copy is private, so numpy's and scipy's BLAS keep theirs."""
  if env.get("MOEJAX_OPENBLAS_CORETYPE"):
    return env["MOEJAX_OPENBLAS_CORETYPE"]
  return "SKYLAKEX" if all(f in cpu_flags for f in AVX512) else None


def cpu_flags() -> set[str]:
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return set()
  line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
  return set(line.split(":", 1)[-1].split())


def _init_blas(lib: ctypes.CDLL, lib_dir: Path) -> str | None:
  """Hands the first BLAS that loads to the kernel, under `coretype`'s OPENBLAS_CORETYPE
  (read when the library loads; restored after); its own threads are set to 1 (a private
  copy: XLA's pool threads the kernel). Returns an error, or None."""
  core, before = coretype(cpu_flags(), dict(os.environ)), os.environ.get("OPENBLAS_CORETYPE")
  if core is not None:
    os.environ["OPENBLAS_CORETYPE"] = core
  try:
    return _init_first(lib, lib_dir)
  finally:
    if core is not None and before is None:
      del os.environ["OPENBLAS_CORETYPE"]
    elif core is not None:
      os.environ["OPENBLAS_CORETYPE"] = before


def _init_first(lib: ctypes.CDLL, lib_dir: Path) -> str | None:
  init = lib.moejax_native_init
  init.restype = ctypes.c_char_p
  init.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
  errors = []
  for path, sgemm, sgemv, ilp64, threads in blas_candidates(lib_dir):
    err = init(path.encode(), sgemm.encode(), sgemv.encode(), ilp64, threads.encode())
    if err is None:
      return None
    errors.append(f"{path}: {err.decode()}")
  return "; ".join(errors) or "no OpenBLAS found (scipy-openblas32)"


FFI_VERSION = re.compile(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)")


def header_api(header: str) -> int | None:
  """major * 1000 + minor from the text of XLA's `xla/ffi/api/c_api.h`, None if absent."""
  found = dict(FFI_VERSION.findall(header))
  return int(found["MAJOR"]) * 1000 + int(found["MINOR"]) if len(found) == 2 else None


def runtime_api() -> int | None:
  """The XLA FFI API version of the running jaxlib (its installed headers), None if unknown."""
  header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
  return header_api(header.read_text()) if header.exists() else None


def api_mismatch(lib: ctypes.CDLL, path: Path) -> str | None:
  """Why XLA would refuse the library's handlers, or None: built against newer FFI headers
  than the running jaxlib's (XLA registers handlers of its own version or older; pyproject
  builds against the oldest jax line's headers so one build serves every line)."""
  built, running = lib.moejax_native_ffi_api(), runtime_api()
  if running is None or built <= running:
    return None
  return (
    f"{path.name} was built against XLA FFI API {built // 1000}.{built % 1000}, newer than "
    f"this jaxlib's {running // 1000}.{running % 1000}: reinstall (pip install -e .)"
  )


@functools.cache
def load() -> str | None:
  """Loads and registers the FFI targets for the CPU platform. Returns None when the kernel
  is ready, else the reason it is not."""
  path = library_path()
  reason = None
  if path is None or not path.exists():
    reason = "not built (no C++ compiler at install time?)"
  else:
    try:
      lib = ctypes.CDLL(str(path))
      reason = api_mismatch(lib, path) or _init_blas(lib, path.parent)
      if reason is None:
        for name in TARGETS:
          jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    except (OSError, AttributeError) as e:
      reason = f"{path}: {e}"
  return reason


def available() -> bool:
  return load() is None


def missing() -> str | None:
  """What the kernel lacks here (`registry.Kernel.missing`), None when it is ready."""
  reason = load()
  return None if reason is None else f"its C++ library is unavailable: {reason}"


def require() -> None:
  """The library loaded, else the one UserError line of an explicit `impl="native"`."""
  if (reason := missing()) is not None:
    raise UserError(
      f"model.moe.impl='native' cannot run here: {reason}; use model.moe.impl=auto or 'fused'"
    )
