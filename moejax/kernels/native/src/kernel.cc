#include "kernel.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#include "blas.h"
#include "buffers.h"
#include "layout.h"
#include "pool.h"
#include "swiglu.h"

namespace mjn {
namespace {

constexpr int64_t kBlock = 512;  // rows per GEMM (256 measured slower backward: dW updates)
constexpr int64_t kTokens = 256;  // tokens per combine item

// A per-thread scratch buffer of at least n floats (slot < 8), reused across blocks and calls:
// fresh large allocations are mmap'd and unmapped per block, which costs page faults and
// TLB shootdowns across the pool's threads.
float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> bufs[8];
  if (int64_t(bufs[slot].size()) < n) bufs[slot].resize(n);
  return bufs[slot].data();
}

// Rows `rows[0:n]` of the token layout a_TxD (through tok_R) as f32 [n, D].
template <typename X>
void gather(const X* a_TxD, const int32_t* tok_R, const int32_t* rows, int64_t n, int64_t D,
            float* out_NxD) {
  for (int64_t i = 0; i < n; ++i) {
    const X* src = a_TxD + int64_t(tok_R[rows[i]]) * D;
    for (int64_t d = 0; d < D; ++d) out_NxD[i * D + d] = to_f32(src[d]);
  }
}

// out[t] = sum_k a_RxD[row(t, k)] in k order (row R reads zeros), tokens in parallel.
template <typename X>
void combine(ThreadPoolRef pool, const float* a_RxD, const int32_t* row_TxK, int64_t T, int64_t K,
             int64_t R, int64_t D, X* out_TxD) {
  parallel_for(pool, (T + kTokens - 1) / kTokens, [&](int64_t item) {
    std::vector<float> acc(D);
    for (int64_t t = item * kTokens; t < std::min(T, (item + 1) * kTokens); ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        int64_t r = row_TxK[t * K + k];
        if (r >= R) continue;
        for (int64_t d = 0; d < D; ++d) acc[d] += a_RxD[r * D + d];
      }
      for (int64_t d = 0; d < D; ++d) out_TxD[t * D + d] = from_f32<X>(acc[d]);
    }
  });
}

template <typename X>
void zero_dead_rows(const Problem<X>& p, int64_t width, X* a_RxW) {
  for (int64_t r = 0; r < p.R; ++r)
    if (p.tok_R[r] >= p.T) std::fill(a_RxW + r * width, a_RxW + (r + 1) * width, from_f32<X>(0));
}

// One forward row block: gu = x W_gu, h = SwiGLU(gu), y_R rows = w * h W_down.
template <typename X>
void forward_block(const Problem<X>& p, const int32_t* rows, int64_t n, int64_t e, X* gu_Rx2F,
                   float* y_RxD) {
  const int64_t D = p.D, F = p.F;
  float *x_NxD = scratch(0, n * D), *gu_Nx2F = scratch(1, n * 2 * F);
  float *h_NxF = scratch(2, n * F), *y_NxD = scratch(3, n * D);
  gather(p.x_TxD, p.tok_R, rows, n, D, x_NxD);
  gemm(false, false, n, 2 * F, D, x_NxD, D, p.w_gu_ExDx2F + e * D * 2 * F, 2 * F, 0.0f,
       gu_Nx2F, 2 * F);
  for (int64_t i = 0; i < n; ++i) {
    const float* gu = gu_Nx2F + i * 2 * F;
    X* dst = gu_Rx2F + int64_t(rows[i]) * 2 * F;
    for (int64_t f = 0; f < 2 * F; ++f) dst[f] = from_f32<X>(gu[f]);
  }
  swiglu_rows(gu_Nx2F, n, F, h_NxF);
  gemm(false, false, n, D, F, h_NxF, F, p.w_down_ExFxD + e * F * D, D, 0.0f, y_NxD,
       D);
  for (int64_t i = 0; i < n; ++i) {
    float w = to_f32(p.w_R[rows[i]]);
    float* dst = y_RxD + int64_t(rows[i]) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = y_NxD[i * D + d] * w;
  }
}

// One backward row block of expert e: dx_R rows, dw_R rows, and dW[e] += this block's part.
template <typename X>
void backward_block(const Problem<X>& p, const X* dy_TxD, const X* gu_Rx2F, const int32_t* rows,
                    int64_t n, int64_t e, float* dx_RxD, X* dw_R, float* dw_gu, float* dw_down) {
  const int64_t D = p.D, F = p.F;
  float *x_NxD = scratch(0, n * D), *dy_NxD = scratch(1, n * D), *dx_NxD = scratch(2, n * D);
  float *gu_Nx2F = scratch(3, n * 2 * F), *dgu_Nx2F = scratch(4, n * 2 * F);
  float *dh_NxF = scratch(5, n * F), *hw_NxF = scratch(6, n * F), *w_N = scratch(7, 2 * n);
  float* dw_N = w_N + n;
  gather(p.x_TxD, p.tok_R, rows, n, D, x_NxD);
  gather(dy_TxD, p.tok_R, rows, n, D, dy_NxD);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t f = 0; f < 2 * F; ++f)
      gu_Nx2F[i * 2 * F + f] = to_f32(gu_Rx2F[int64_t(rows[i]) * 2 * F + f]);
  const float* w_down = p.w_down_ExFxD + e * F * D;
  const float* w_gu = p.w_gu_ExDx2F + e * D * 2 * F;
  gemm(false, true, n, F, D, dy_NxD, D, w_down, D, 0.0f, dh_NxF, F);
  for (int64_t i = 0; i < n; ++i) w_N[i] = to_f32(p.w_R[rows[i]]);
  swiglu_rows_grad(gu_Nx2F, dh_NxF, w_N, n, F, dgu_Nx2F,
                   hw_NxF, dw_N);
  for (int64_t i = 0; i < n; ++i) dw_R[rows[i]] = from_f32<X>(dw_N[i]);
  gemm(true, false, F, D, n, hw_NxF, F, dy_NxD, D, 1.0f, dw_down + e * F * D, D);
  gemm(true, false, D, 2 * F, n, x_NxD, D, dgu_Nx2F, 2 * F, 1.0f,
       dw_gu + e * D * 2 * F, 2 * F);
  gemm(false, true, n, D, 2 * F, dgu_Nx2F, 2 * F, w_gu, 2 * F, 0.0f, dx_NxD, D);
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(dx_NxD + i * D, D, dx_RxD + int64_t(rows[i]) * D);
}

// Experts by decreasing row count, so the largest start first on the pool.
std::vector<int64_t> experts_by_load(const ExpertRows& er) {
  int64_t E = int64_t(er.start.size()) - 1;
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  auto load = [&](int64_t e) { return er.start[e + 1] - er.start[e]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return load(a) > load(b);
  });
  return order;
}

}  // namespace

template <typename X>
void forward(ThreadPoolRef pool, const Problem<X>& p, X* y_TxD, X* gu_Rx2F) {
  ExpertRows er = group_rows(p.tok_R, p.expert_R, p.R, p.T, p.E);
  std::vector<Item> items = row_blocks(er, kBlock);
  Scratch y_RxD(p.R * p.D);
  zero_dead_rows(p, 2 * p.F, gu_Rx2F);
  parallel_for(pool, int64_t(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    forward_block(p, er.rows.data() + it.begin, it.end - it.begin, it.expert, gu_Rx2F,
                  y_RxD.get());
  });
  combine(pool, y_RxD.get(), p.row_TxK, p.T, p.K, p.R, p.D, y_TxD);
}

template <typename X>
void backward(ThreadPoolRef pool, const Problem<X>& p, const X* dy_TxD, const X* gu_Rx2F,
              X* dx_TxD, X* dw_R, float* dw_gu, float* dw_down) {
  ExpertRows er = group_rows(p.tok_R, p.expert_R, p.R, p.T, p.E);
  std::vector<int64_t> order = experts_by_load(er);
  Scratch dx_RxD(p.R * p.D);
  std::fill(dw_gu, dw_gu + p.E * p.D * 2 * p.F, 0.0f);
  std::fill(dw_down, dw_down + p.E * p.F * p.D, 0.0f);
  zero_dead_rows(p, 1, dw_R);
  parallel_for(pool, p.E, [&](int64_t i) {
    int64_t e = order[i];
    for (int64_t b = er.start[e]; b < er.start[e + 1]; b += kBlock) {
      int64_t n = std::min(kBlock, er.start[e + 1] - b);
      backward_block(p, dy_TxD, gu_Rx2F, er.rows.data() + b, n, e, dx_RxD.get(), dw_R, dw_gu,
                     dw_down);
    }
  });
  combine(pool, dx_RxD.get(), p.row_TxK, p.T, p.K, p.R, p.D, dx_TxD);
}

template void forward<float>(ThreadPoolRef, const Problem<float>&, float*, float*);
template void forward<uint16_t>(ThreadPoolRef, const Problem<uint16_t>&, uint16_t*, uint16_t*);
template void backward<float>(ThreadPoolRef, const Problem<float>&, const float*, const float*,
                              float*, float*, float*, float*);
template void backward<uint16_t>(ThreadPoolRef, const Problem<uint16_t>&, const uint16_t*,
                                 const uint16_t*, uint16_t*, uint16_t*, float*, float*);

}  // namespace mjn
