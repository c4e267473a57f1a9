"""Builds the `native` CPU kernel (moejax/kernels/native/src) as an optional extension: where
it cannot be built (no C++ compiler, no jaxlib headers), the install still succeeds and the
dispatcher runs `fused` (one log line, moejax/kernels/native/loader.py). Everything else is
in pyproject.toml."""

from __future__ import annotations

import filecmp
import glob
import importlib.util
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "moejax/kernels/native"


def _package_dir(name: str) -> str | None:
  spec = importlib.util.find_spec(name)
  return None if spec is None else spec.submodule_search_locations[0]


class BuildNative(build_ext):
  """Finds jaxlib's FFI headers and scipy-openblas32's library (build requirements) at build
  time, compiles, and copies the OpenBLAS library beside the kernel, which loads it by path."""

  def build_extension(self, ext):
    from setuptools.errors import CompileError

    jaxlib, openblas = _package_dir("jaxlib"), _package_dir("scipy_openblas32")
    if jaxlib is None or openblas is None:
      raise CompileError("native kernel: jaxlib and scipy-openblas32 are needed to build it")
    ext.include_dirs.append(os.path.join(jaxlib, "include"))
    super().build_extension(ext)
    blas = glob.glob(os.path.join(openblas, "lib", "libscipy_openblas*.so"))
    dests = [os.path.dirname(self.get_ext_fullpath(ext.name))]
    if self.inplace or getattr(self, "editable_mode", False):
      dests.append(NATIVE)
    for dest in dests:
      for lib in blas:
        _replace(lib, os.path.join(dest, os.path.basename(lib)))


def _replace(src: str, dst: str) -> None:
  """Copy src to dst as a new file renamed into place: a process that has dst loaded keeps
  its own copy (another interpreter's editable install may be running its tests)."""
  if os.path.exists(dst) and filecmp.cmp(src, dst, shallow=False):
    return
  tmp = f"{dst}.{os.getpid()}.tmp"
  shutil.copy2(src, tmp)
  os.replace(tmp, dst)


native = Extension(
  "moejax.kernels.native._moejax_native",
  sources=sorted(glob.glob(f"{NATIVE}/src/*.cc")),
  depends=sorted(glob.glob(f"{NATIVE}/src/*.h")),
  language="c++",
  extra_compile_args=["-O3", "-std=c++17", "-fopenmp-simd", "-w"],
  libraries=["dl"],
  optional=True,
)

setup(ext_modules=[native], cmdclass={"build_ext": BuildNative})
