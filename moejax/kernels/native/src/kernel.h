// The routed expert FFN on one host: forward and backward over experts' row blocks.
#pragma once

#include <cstdint>

#include "pool.h"

namespace mjn {

// Shapes and pointers of one call; X is float or uint16_t (bf16 bits). Weights are float
// (the caller converts bf16 weights once per call).
template <typename X>
struct Problem {
  int64_t T, D, F, E, R, K;
  const X* x_TxD;
  const X* w_R;
  const int32_t* tok_R;     // T: an empty row
  const int32_t* expert_R;  // each row's expert
  const int32_t* row_TxK;   // R: a dropped assignment
  const float* w_gu_ExDx2F;
  const float* w_down_ExFxD;
};

// y_TxD = sum_k w * SwiGLU_e(x) over each token's rows; gu_Rx2F: the gate/up residual.
template <typename X>
void forward(ThreadPoolRef pool, const Problem<X>& p, X* y_TxD, X* gu_Rx2F);

// dx_TxD, dw_R and the f32 weight gradients, from dy_TxD and the residual gu_Rx2F.
template <typename X>
void backward(ThreadPoolRef pool, const Problem<X>& p, const X* dy_TxD,
              const X* gu_Rx2F, X* dx_TxD, X* dw_R, float* dw_gu_ExDx2F, float* dw_down_ExFxD);

}  // namespace mjn
