// SwiGLU rows forward and backward, and bf16 <-> f32 conversion; loops GCC vectorizes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mjn {

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }
template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline uint16_t from_f32<uint16_t>(float v) { return f32_to_bf16(v); }

// exp(x) for x <= 0 ... 88: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6
// Taylor polynomial (relative error < 2e-7, about 1 ulp); no calls, so the loops vectorize.
inline float exp_f32(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504089f + magic) - magic;
  float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f +
                                                r * (8.33333377e-3f + r * 1.38888892e-3f)))));
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float sigmoid(float g) { return 1.0f / (1.0f + exp_f32(-g)); }

// h[i, f] = silu(g) * u for n rows of gu = [g | u] (2F wide), h [n, F].
void swiglu_rows(const float* gu, int64_t n, int64_t F, float* h);

// The backward pass of n rows: from gu = [g | u], dh = dL/dh before the row weights w_N,
// writes dgu = [dg | du] (w applied), hw = h * w, and dw_N[i] = sum(h * dh).
void swiglu_rows_grad(const float* gu, const float* dh, const float* w_N, int64_t n, int64_t F,
                      float* dgu, float* hw, float* dw_N);

}  // namespace mjn
