// Helpers the FFI handlers share: shapes in error messages, and the weights as f32.
#pragma once

#include <string>
#include <vector>

#include "swiglu.h"
#include "xla/ffi/api/ffi.h"

namespace mjn {

using Dims = xla::ffi::Span<const int64_t>;

inline std::string shape(Dims d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline xla::ffi::Error bad_shape(const char* name, Dims d) {
  return xla::ffi::Error::InvalidArgument(std::string("native moe: ") + name + " has shape " +
                                          shape(d));
}

// The expert weights w_gu and w_down as f32: their own data, or converted copies held here
// (bf16) for the call.
class WeightsF32 {
 public:
  WeightsF32(xla::ffi::AnyBuffer w_gu, xla::ffi::AnyBuffer w_down)
      : gu(as_f32(w_gu, gu_store_)), down(as_f32(w_down, down_store_)) {}

 private:
  std::vector<float> gu_store_, down_store_;  // declared before gu/down: filled first

  static const float* as_f32(xla::ffi::AnyBuffer w, std::vector<float>& store) {
    if (w.element_type() == xla::ffi::DataType::F32)
      return static_cast<const float*>(w.untyped_data());
    const uint16_t* src = static_cast<const uint16_t*>(w.untyped_data());
    store.resize(w.element_count());
    for (size_t i = 0; i < store.size(); ++i) store[i] = bf16_to_f32(src[i]);
    return store.data();
  }

 public:
  const float* const gu;
  const float* const down;
};

// x [T, D] float32 or bfloat16, w_gu [E, D, 2F] and w_down [E, F, D] of x's dtype: fills
// {T, D, F, E}, or returns an error naming the first operand that does not fit.
inline xla::ffi::Error check_experts(xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer w_gu,
                                     xla::ffi::AnyBuffer w_down, int64_t* s) {
  using xla::ffi::DataType;
  DataType t = x.element_type();
  if (t != DataType::F32 && t != DataType::BF16)
    return xla::ffi::Error::InvalidArgument("native moe: x must be float32 or bfloat16");
  if (w_gu.element_type() != t || w_down.element_type() != t)
    return xla::ffi::Error::InvalidArgument("native moe: the weights must have x's dtype");
  if (x.dimensions().size() != 2) return bad_shape("x", x.dimensions());
  int64_t T = x.dimensions()[0], D = x.dimensions()[1];
  Dims g = w_gu.dimensions();
  if (g.size() != 3 || g[1] != D || g[2] % 2) return bad_shape("w_gu", g);
  int64_t E = g[0], F = g[2] / 2;
  Dims dn = w_down.dimensions();
  if (dn.size() != 3 || dn[0] != E || dn[1] != F || dn[2] != D) return bad_shape("w_down", dn);
  s[0] = T, s[1] = D, s[2] = F, s[3] = E;
  return xla::ffi::Error::Success();
}

}  // namespace mjn
