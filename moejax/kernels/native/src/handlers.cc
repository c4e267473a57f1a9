// The XLA FFI handlers (moejax_native_forward / _backward) and the BLAS init entry point.
#include <vector>

#include "blas.h"
#include "ffi_util.h"
#include "kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mjn {
namespace {

// Checks every operand's shape and dtype against x [T, D] and w_gu [E, D, 2F]; fills `p`'s
// sizes. Returns an error naming the first operand that does not fit.
ffi::Error check(ffi::AnyBuffer x, ffi::AnyBuffer w_R, ffi::Buffer<ffi::S32> tok_R,
                 ffi::Buffer<ffi::S32> expert_R, ffi::Buffer<ffi::S32> row_TxK,
                 ffi::AnyBuffer w_gu, ffi::AnyBuffer w_down, int64_t* s) {
  if (auto err = check_experts(x, w_gu, w_down, s); err.failure()) return err;
  int64_t T = s[0], E = s[3];
  if (w_R.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("native moe: w_R must have x's dtype");
  if (w_R.dimensions().size() != 1) return bad_shape("w_R", w_R.dimensions());
  int64_t R = w_R.dimensions()[0];
  if (tok_R.dimensions().size() != 1 || tok_R.dimensions()[0] != R)
    return bad_shape("tok_R", tok_R.dimensions());
  if (expert_R.dimensions().size() != 1 || expert_R.dimensions()[0] != R)
    return bad_shape("expert_R", expert_R.dimensions());
  Dims rk = row_TxK.dimensions();
  if (rk.size() != 2 || rk[0] != T) return bad_shape("row_TxK", rk);
  for (int64_t r = 0; r < R; ++r) {
    int32_t tok = tok_R.typed_data()[r], e = expert_R.typed_data()[r];
    if (tok < 0 || tok > T || (tok < T && (e < 0 || e >= E)))
      return ffi::Error::InvalidArgument("native moe: tok_R/expert_R out of range");
  }
  for (int64_t a = 0; a < T * rk[1]; ++a) {
    int32_t r = row_TxK.typed_data()[a];
    if (r < 0 || r > R) return ffi::Error::InvalidArgument("native moe: row_TxK out of range");
  }
  s[4] = R, s[5] = rk[1];
  return ffi::Error::Success();
}

template <typename X>
Problem<X> problem(const int64_t* s, ffi::AnyBuffer x, ffi::AnyBuffer w_R,
                   ffi::Buffer<ffi::S32> tok_R, ffi::Buffer<ffi::S32> expert_R,
                   ffi::Buffer<ffi::S32> row_TxK, const float* w_gu, const float* w_down) {
  return Problem<X>{s[0], s[1], s[2], s[3], s[4], s[5],
                    static_cast<const X*>(x.untyped_data()),
                    static_cast<const X*>(w_R.untyped_data()), tok_R.typed_data(),
                    expert_R.typed_data(), row_TxK.typed_data(), w_gu, w_down};
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w_R,
                   ffi::Buffer<ffi::S32> tok_R, ffi::Buffer<ffi::S32> expert_R,
                   ffi::Buffer<ffi::S32> row_TxK, ffi::AnyBuffer w_gu, ffi::AnyBuffer w_down,
                   ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gu) {
  if (!blas_ready()) return ffi::Error::Internal("native moe: no BLAS loaded");
  int64_t s[6];
  if (auto err = check(x, w_R, tok_R, expert_R, row_TxK, w_gu, w_down, s); err.failure())
    return err;
  WeightsF32 w(w_gu, w_down);
  const float *wg = w.gu, *wd = w.down;
  if (x.element_type() == ffi::DataType::F32) {
    auto p = problem<float>(s, x, w_R, tok_R, expert_R, row_TxK, wg, wd);
    forward(pool, p, static_cast<float*>(y->untyped_data()),
            static_cast<float*>(gu->untyped_data()));
  } else {
    auto p = problem<uint16_t>(s, x, w_R, tok_R, expert_R, row_TxK, wg, wd);
    forward(pool, p, static_cast<uint16_t*>(y->untyped_data()),
            static_cast<uint16_t*>(gu->untyped_data()));
  }
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer gu,
                    ffi::AnyBuffer w_R, ffi::Buffer<ffi::S32> tok_R,
                    ffi::Buffer<ffi::S32> expert_R, ffi::Buffer<ffi::S32> row_TxK,
                    ffi::AnyBuffer w_gu, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> dx,
                    ffi::Result<ffi::AnyBuffer> dw_R, ffi::Result<ffi::AnyBuffer> dw_gu,
                    ffi::Result<ffi::AnyBuffer> dw_down) {
  if (!blas_ready()) return ffi::Error::Internal("native moe: no BLAS loaded");
  int64_t s[6];
  if (auto err = check(x, w_R, tok_R, expert_R, row_TxK, w_gu, w_down, s); err.failure())
    return err;
  if (dy.element_type() != x.element_type() || gu.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("native moe: dy and gu must have x's dtype");
  WeightsF32 w(w_gu, w_down);
  const float *wg = w.gu, *wd = w.down;
  float* dwg = static_cast<float*>(dw_gu->untyped_data());
  float* dwd = static_cast<float*>(dw_down->untyped_data());
  if (x.element_type() == ffi::DataType::F32) {
    auto p = problem<float>(s, x, w_R, tok_R, expert_R, row_TxK, wg, wd);
    backward(pool, p, static_cast<const float*>(dy.untyped_data()),
             static_cast<const float*>(gu.untyped_data()), static_cast<float*>(dx->untyped_data()),
             static_cast<float*>(dw_R->untyped_data()), dwg, dwd);
  } else {
    auto p = problem<uint16_t>(s, x, w_R, tok_R, expert_R, row_TxK, wg, wd);
    backward(pool, p, static_cast<const uint16_t*>(dy.untyped_data()),
             static_cast<const uint16_t*>(gu.untyped_data()),
             static_cast<uint16_t*>(dx->untyped_data()),
             static_cast<uint16_t*>(dw_R->untyped_data()), dwg, dwd);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mjn

XLA_FFI_DEFINE_HANDLER_SYMBOL(moejax_native_forward, mjn::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(moejax_native_backward, mjn::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// Called once from Python (ctypes) with the BLAS it found; returns nullptr or an error.
extern "C" __attribute__((visibility("default"))) const char* moejax_native_init(
    const char* path, const char* sgemm, const char* sgemv, int ilp64, const char* threads) {
  return mjn::blas_load(path, sgemm, sgemv, ilp64, threads);
}

// The XLA FFI API version of the headers this library was built with (major * 1000 + minor):
// XLA registers a handler only up to its own version, so the loader compares it with the
// running jaxlib's before registering (loader.py).
extern "C" __attribute__((visibility("default"))) int moejax_native_ffi_api() {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}
