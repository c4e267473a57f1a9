// The dropless plan, built inside the call from the routing (moejax.kernels.plans.dropless_plan
// with one-row blocks): assignment a = t*K + k of expert e takes row start[e] + its rank among
// expert e's assignments in a order, so rows are contiguous per expert from row 0. An expert
// id of E (an unused rank, elastic-k) takes no row: its row_TxK is R. R = T*K; the rows past
// the used ones are empty (tok_R = T).
#pragma once

#include <cstdint>
#include <vector>

namespace mjn {

struct Plan {
  std::vector<int32_t> tok_R, expert_R, row_TxK;
};

// False when an expert id is outside [0, E] (nothing is planned then).
inline bool dropless_plan(const int32_t* experts_TxK, int64_t T, int64_t K, int64_t E,
                          Plan* p) {
  const int64_t A = T * K;
  std::vector<int64_t> fill(E + 1, 0);
  for (int64_t a = 0; a < A; ++a) {
    int32_t e = experts_TxK[a];
    if (e < 0 || e > E) return false;
    if (e < E) fill[e + 1]++;
  }
  for (int64_t e = 0; e < E; ++e) fill[e + 1] += fill[e];
  p->tok_R.assign(A, int32_t(T));
  p->expert_R.assign(A, int32_t(E - 1));
  p->row_TxK.assign(A, int32_t(A));
  for (int64_t a = 0; a < A; ++a) {
    int32_t e = experts_TxK[a];
    if (e == E) continue;
    int64_t r = fill[e]++;
    p->row_TxK[a] = int32_t(r);
    p->tok_R[r] = int32_t(a / K);
    p->expert_R[r] = e;
  }
  return true;
}

}  // namespace mjn
