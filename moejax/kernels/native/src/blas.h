// Row-major single-precision GEMM through a BLAS loaded at run time (moejax_native_init).
#pragma once

#include <cstdint>

namespace mjn {

// Loads `path` and its `sgemm` and `sgemv` symbols (cblas_sgemm's and cblas_sgemv's
// signatures, 32- or 64-bit ints), and sets the library's own threads to 1 through `threads`
// (a private copy: XLA's pool does the threading). Returns an error message or nullptr.
const char* blas_load(const char* path, const char* sgemm, const char* sgemv, int ilp64,
                      const char* threads);
bool blas_ready();

// Below this many rows of op(A), gemm runs one sgemv per row. OpenBLAS's sgemm packs all of
// B on every call, so at the one row per expert of a batch-1 decode step it read the weights
// at 8.8 GB/s on one core where sgemv read them at 20.1; 2 rows: 8.7 and 12.0, 3: 5.6 and
// 9.1, 4: 9.1 and 8.4 (benchmarks/blas_rows.py, AMD EPYC, [512, 2048] float32).
inline constexpr int64_t kGemvRows = 4;

// C[M,N] = op(A) op(B) + beta * C, row-major; op transposes when ta/tb.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace mjn
