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


def ptr(a: np.ndarray):
  return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def gb_s(fn, nbytes: int, repeats: int) -> float:
  """GB/s of reading `nbytes` in one call of fn, best of `repeats` after a warm-up."""
  fn()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t)
  return nbytes / best / 1e9


def sgemm_all(lib, W_ExDxN: np.ndarray, x_MxD: np.ndarray, y_MxN: np.ndarray) -> None:
  """y = x W[e] for every expert e: one sgemm each (the last expert's product stays in y)."""
  (m, d), n = x_MxD.shape, W_ExDxN.shape[2]
  for w in W_ExDxN:
    lib.gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, d, 1.0, ptr(x_MxD), d, ptr(w), n, 0.0,
             ptr(y_MxN), n)  # fmt: skip


def sgemv_all(lib, W_ExDxN: np.ndarray, x_MxD: np.ndarray, y_MxN: np.ndarray) -> None:
  """The same product as `sgemm_all`, one sgemv per row (what the kernel does below 4 rows)."""
  d, n = W_ExDxN.shape[1:]
  for w in W_ExDxN:
    for x_D, y_N in zip(x_MxD, y_MxN):
      lib.gemv(ROW_MAJOR, TRANS, d, n, 1.0, ptr(w), n, ptr(x_D), 1, 0.0, ptr(y_N), 1)


def row(lib, W_ExDxN: np.ndarray, m: int, repeats: int) -> dict:
  """One table row: both paths' GB/s of weights read at m rows, their product checked equal."""
  d, n = W_ExDxN.shape[1:]
  x_MxD = np.random.default_rng(m).standard_normal((m, d), dtype=np.float32)
  y_gemm, y_gemv = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
  a = gb_s(lambda: sgemm_all(lib, W_ExDxN, x_MxD, y_gemm), W_ExDxN.nbytes, repeats)
  b = gb_s(lambda: sgemv_all(lib, W_ExDxN, x_MxD, y_gemv), W_ExDxN.nbytes, repeats)
  assert np.allclose(y_gemm, y_gemv, rtol=1e-4, atol=1e-3)
  return {"rows": m, "sgemm_gb_s": round(a, 2), "sgemv_per_row_gb_s": round(b, 2),
          "sgemv_over_sgemm": round(b / a, 3)}  # fmt: skip


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--d", type=int, default=512)
  p.add_argument("--n", type=int, default=2048, help="columns: 2f of gate and up")
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--rows", default="1,2,3,4,6,8")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  lib = openblas()
  rng = np.random.default_rng(0)
  W_ExDxN = rng.standard_normal((args.experts, args.d, args.n), dtype=np.float32)
  rows = []
  for m in (int(r) for r in args.rows.split(",")):
    rows.append(row(lib, W_ExDxN, m, args.repeats))
    print(rows[-1], flush=True)
  figures = {"shape": f"[{args.d}, {args.n}] float32 x {args.experts} experts, one thread",
             "openblas_coretype": lib.core or "OpenBLAS's own choice", "rows": rows}  # fmt: skip
  write_result("blas_rows", figures)


if __name__ == "__main__":
  main()
