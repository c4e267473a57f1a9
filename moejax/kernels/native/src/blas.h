// Row-major single-precision GEMM through a BLAS loaded at run time (moejax_native_init).
#pragma once

#include <cstdint>

namespace mjn {

// Loads `path` and its `sgemm` symbol (cblas_sgemm's signature, 32- or 64-bit ints), and
// sets the library's own threads to 1 through `threads` (a private copy: XLA's pool does
// the threading). Returns an error message or nullptr.
const char* blas_load(const char* path, const char* sgemm, int ilp64, const char* threads);
bool blas_ready();

// C[M,N] = alpha * op(A) op(B) + beta * C, row-major; op transposes when ta/tb.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace mjn
