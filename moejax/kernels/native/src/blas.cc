#include "blas.h"

#include <dlfcn.h>

namespace mjn {
namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
using Sgemm32 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                         const float*, int32_t, float, float*, int32_t);
using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using SetThreads = void (*)(int);

void* g_sgemm = nullptr;
bool g_ilp64 = false;

}  // namespace

const char* blas_load(const char* path, const char* sgemm, int ilp64, const char* threads) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return "cannot load the BLAS library";
  void* fn = dlsym(lib, sgemm);
  if (fn == nullptr) return "the BLAS library has no such sgemm symbol";
  void* set = threads ? dlsym(lib, threads) : nullptr;
  if (threads && set == nullptr) return "the BLAS library has no such thread-count setter";
  if (set) reinterpret_cast<SetThreads>(set)(1);
  g_ilp64 = ilp64 != 0;
  g_sgemm = fn;
  return nullptr;
}

bool blas_ready() { return g_sgemm != nullptr; }

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
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
