#include "swiglu.h"

namespace mjn {

#define MJN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

MJN_CLONES void swiglu_rows(const float* gu, int64_t n, int64_t F, float* h) {
  for (int64_t i = 0; i < n; ++i) {
    const float* g = gu + i * 2 * F;
    float* out = h + i * F;
    for (int64_t f = 0; f < F; ++f) out[f] = g[f] * sigmoid(g[f]) * g[F + f];
  }
}

MJN_CLONES void swiglu_rows_grad(const float* gu, const float* dh, const float* w_N, int64_t n,
                                 int64_t F, float* dgu, float* hw, float* dw_N) {
  for (int64_t i = 0; i < n; ++i) {
    const float *g = gu + i * 2 * F, *u = g + F, *d = dh + i * F;
    float *dg = dgu + i * 2 * F, *du = dg + F, *hr = hw + i * F;
    float w = w_N[i], dw = 0.0f;
#pragma omp simd reduction(+ : dw)  // -fopenmp-simd: this sum may be reordered to vectorize
    for (int64_t f = 0; f < F; ++f) {
      float s = sigmoid(g[f]), a = g[f] * s, hf = a * u[f], dwh = d[f] * w;
      dw += hf * d[f];
      dg[f] = dwh * u[f] * s * (1.0f + g[f] * (1.0f - s));
      du[f] = dwh * a;
      hr[f] = hf * w;
    }
    dw_N[i] = dw;
  }
}

}  // namespace mjn
