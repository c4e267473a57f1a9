#include "blas.h"

#include <dlfcn.h>

namespace mjn {
namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
using Sgemm32 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                         const float*, int32_t, float, float*, int32_t);
using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using Sgemv32 = void (*)(int, int, int32_t, int32_t, float, const float*, int32_t, const float*,
                         int32_t, float, float*, int32_t);
using Sgemv64 = void (*)(int, int, int64_t, int64_t, float, const float*, int64_t, const float*,
                         int64_t, float, float*, int64_t);
using SetThreads = void (*)(int);

void* g_sgemm = nullptr;
void* g_sgemv = nullptr;
bool g_ilp64 = false;

// y[n] = beta * y + op(B) x, op(B) [n, k] from the row-major B (transposed when tb: B is
// [n, k]; else B is [k, n]), x read with stride incx.
void gemv(bool tb, int64_t n, int64_t k, const float* B, int64_t ldb, const float* x,
          int64_t incx, float beta, float* y) {
  // cblas_sgemv's (rows, cols) are B's own: [n, k] untransposed when tb, [k, n] transposed
  const int op = tb ? kNoTrans : kTrans;
  const int64_t rows = tb ? n : k, cols = tb ? k : n;
  if (g_ilp64) {
    reinterpret_cast<Sgemv64>(g_sgemv)(kRowMajor, op, rows, cols, 1.0f, B, ldb, x, incx, beta, y,
                                       1);
  } else {
    reinterpret_cast<Sgemv32>(g_sgemv)(kRowMajor, op, int32_t(rows), int32_t(cols), 1.0f, B,
                                       int32_t(ldb), x, int32_t(incx), beta, y, 1);
  }
}

}  // namespace

const char* blas_load(const char* path, const char* sgemm, const char* sgemv, int ilp64,
                      const char* threads) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return "cannot load the BLAS library";
  void* fn = dlsym(lib, sgemm);
  if (fn == nullptr) return "the BLAS library has no such sgemm symbol";
  void* fn_v = dlsym(lib, sgemv);
  if (fn_v == nullptr) return "the BLAS library has no such sgemv symbol";
  void* set = threads ? dlsym(lib, threads) : nullptr;
  if (threads && set == nullptr) return "the BLAS library has no such thread-count setter";
  if (set) reinterpret_cast<SetThreads>(set)(1);
  g_ilp64 = ilp64 != 0;
  g_sgemm = fn;
  g_sgemv = fn_v;
  return nullptr;
}

bool blas_ready() { return g_sgemm != nullptr; }

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  // a row at a time: sgemm would pack all of B for a few rows (K = 0 stays with sgemm, which
  // scales C by beta where sgemv returns early)
  if (M < kGemvRows && K > 0) {
    for (int64_t i = 0; i < M; ++i)
      gemv(tb, N, K, B, ldb, ta ? A + i : A + i * lda, ta ? lda : 1, beta, C + i * ldc);
    return;
  }
  const int opa = ta ? kTrans : kNoTrans, opb = tb ? kTrans : kNoTrans;
  if (g_ilp64) {
    reinterpret_cast<Sgemm64>(g_sgemm)(kRowMajor, opa, opb, M, N, K, 1.0f, A, lda, B, ldb, beta,
                                       C, ldc);
  } else {
    reinterpret_cast<Sgemm32>(g_sgemm)(kRowMajor, opa, opb, int32_t(M), int32_t(N), int32_t(K),
                                       1.0f, A, int32_t(lda), B, int32_t(ldb), beta, C,
                                       int32_t(ldc));
  }
}

}  // namespace mjn
