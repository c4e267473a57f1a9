"""The native kernel's OpenBLAS at a few rows per expert: sgemm against one sgemv per row.

A decode step gives each chosen expert one row (batch 1) or a few (batch 8 at E = 64, K = 8:
1.5 on average). OpenBLAS's sgemm packs the whole weight matrix on every call, so at a few
rows it reads the weights at a fraction of the rate sgemv does. This measures both on the
library the kernel loads (`moejax.kernels.native.loader`, with the OPENBLAS_CORETYPE it
chooses), one thread, over `--experts` distinct [d, 2f] matrices (each read once per pass,
far larger than the caches together): GB/s of weights read per rows count M. The kernel
takes sgemv below `kGemvRows` rows (moejax/kernels/native/src/blas.h).

Run alone, on a quiet host: python benchmarks/blas_rows.py
Writes benchmarks/results/blas_rows.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def openblas() -> ctypes.CDLL:
  """The kernel's private OpenBLAS, loaded as the kernel loads it, one thread."""
  from moejax.kernels.native import loader

  (path, sgemm, sgemv, _, threads), *_ = loader.blas_candidates(loader.HERE)
  core = loader.coretype(loader.cpu_flags(), dict(os.environ))
  if core is not None:
    os.environ["OPENBLAS_CORETYPE"] = core
  lib = ctypes.CDLL(path)
  getattr(lib, threads)(1)
  fp, f, i = ctypes.POINTER(ctypes.c_float), ctypes.c_float, ctypes.c_int
  lib.gemm = getattr(lib, sgemm)
  lib.gemm.argtypes = [i, i, i, i, i, i, f, fp, i, fp, i, f, fp, i]
  lib.gemv = getattr(lib, sgemv)
  lib.gemv.argtypes = [i, i, i, i, f, fp, i, fp, i, f, fp, i]
  lib.core = core
  return lib


def gb_s(fn, nbytes: int, repeats: int) -> float:
  fn()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t)
  return nbytes / best / 1e9


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--d", type=int, default=512)
  p.add_argument("--n", type=int, default=2048, help="columns: 2f of gate and up")
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--rows", default="1,2,3,4,6,8")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  lib = openblas()
  d, n = args.d, args.n
  W = np.random.default_rng(0).standard_normal((args.experts, d, n), dtype=np.float32)
  ptr = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))  # noqa: E731
  rows = []
  for m in (int(r) for r in args.rows.split(",")):
    x = np.random.default_rng(m).standard_normal((m, d), dtype=np.float32)
    y_gemm, y_gemv = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)

    def gemm():
      for w in W:
        lib.gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, d, 1.0, ptr(x), d, ptr(w), n, 0.0,
                 ptr(y_gemm), n)  # fmt: skip

    def gemv():
      for w in W:
        for r in range(m):
          lib.gemv(ROW_MAJOR, TRANS, d, n, 1.0, ptr(w), n, ptr(x[r]), 1, 0.0, ptr(y_gemv[r]), 1)

    a, b = gb_s(gemm, W.nbytes, args.repeats), gb_s(gemv, W.nbytes, args.repeats)
    assert np.allclose(y_gemm, y_gemv, rtol=1e-4, atol=1e-3)  # the same product, last expert
    rows.append({"rows": m, "sgemm_gb_s": round(a, 2), "sgemv_per_row_gb_s": round(b, 2),
                 "sgemv_over_sgemm": round(b / a, 3)})  # fmt: skip
    print(rows[-1], flush=True)
  figures = {"shape": f"[{d}, {n}] float32 x {args.experts} experts, one thread",
             "openblas_coretype": lib.core or "OpenBLAS's own choice", "rows": rows}  # fmt: skip
  write_result("blas_rows", figures)


if __name__ == "__main__":
  main()
