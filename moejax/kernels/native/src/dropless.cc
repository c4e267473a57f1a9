// The dropless FFI handlers (moejax_native_dropless_forward / _backward): the routing in, the
// plan built inside each call (plan.h), so the XLA program holds no sort, scan or scatter for
// it. Each call then runs the same kernel as the planned handlers (kernel.h).
#include <vector>

#include "blas.h"
#include "ffi_util.h"
#include "kernel.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mjn {
namespace {

// Checks x, the weights and the routing (w_TxK of x's dtype, experts_TxK int32, both [T, K]);
// fills {T, D, F, E, R = T*K, K}.
ffi::Error check(ffi::AnyBuffer x, ffi::AnyBuffer w_TxK, ffi::Buffer<ffi::S32> experts_TxK,
                 ffi::AnyBuffer w_gu, ffi::AnyBuffer w_down, int64_t* s) {
  if (auto err = check_experts(x, w_gu, w_down, s); err.failure()) return err;
  if (w_TxK.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("native moe: w_TxK must have x's dtype");
  Dims w = w_TxK.dimensions(), e = experts_TxK.dimensions();
  if (w.size() != 2 || w[0] != s[0]) return bad_shape("w_TxK", w);
  if (e.size() != 2 || e[0] != w[0] || e[1] != w[1]) return bad_shape("experts_TxK", e);
  s[4] = w[0] * w[1], s[5] = w[1];
  return ffi::Error::Success();
}

// The plan of this call and each row's combine weight (w_R, 0 for an empty row).
template <typename X>
struct Planned {
  Plan plan;
  std::vector<X> w_R;
};

template <typename X>
ffi::Error plan_rows(const int64_t* s, ffi::AnyBuffer w_TxK, ffi::Buffer<ffi::S32> experts_TxK,
                     Planned<X>* out) {
  const int64_t T = s[0], E = s[3], R = s[4], K = s[5];
  if (!dropless_plan(experts_TxK.typed_data(), T, K, E, &out->plan))
    return ffi::Error::InvalidArgument("native moe: experts_TxK out of range");
  const X* w = static_cast<const X*>(w_TxK.untyped_data());
  out->w_R.assign(R, from_f32<X>(0.0f));
  for (int64_t a = 0; a < R; ++a)
    if (out->plan.row_TxK[a] < R) out->w_R[out->plan.row_TxK[a]] = w[a];
  return ffi::Error::Success();
}

template <typename X>
Problem<X> problem(const int64_t* s, ffi::AnyBuffer x, const Planned<X>& pl, const float* w_gu,
                   const float* w_down) {
  return Problem<X>{s[0], s[1], s[2], s[3], s[4], s[5],
                    static_cast<const X*>(x.untyped_data()), pl.w_R.data(),
                    pl.plan.tok_R.data(), pl.plan.expert_R.data(), pl.plan.row_TxK.data(),
                    w_gu, w_down};
}

template <typename X>
ffi::Error forward_as(ffi::ThreadPool pool, const int64_t* s, ffi::AnyBuffer x,
                      ffi::AnyBuffer w_TxK, ffi::Buffer<ffi::S32> experts_TxK, const float* wg,
                      const float* wd, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> gu) {
  Planned<X> pl;
  if (auto err = plan_rows(s, w_TxK, experts_TxK, &pl); err.failure()) return err;
  forward(pool, problem(s, x, pl, wg, wd), static_cast<X*>(y->untyped_data()),
          static_cast<X*>(gu->untyped_data()));
  return ffi::Error::Success();
}

// dL/dw per assignment: its row's, 0 for an assignment without a row.
template <typename X>
ffi::Error backward_as(ffi::ThreadPool pool, const int64_t* s, ffi::AnyBuffer x,
                       ffi::AnyBuffer dy, ffi::AnyBuffer gu, ffi::AnyBuffer w_TxK,
                       ffi::Buffer<ffi::S32> experts_TxK, const float* wg, const float* wd,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw_TxK,
                       float* dwg, float* dwd) {
  Planned<X> pl;
  if (auto err = plan_rows(s, w_TxK, experts_TxK, &pl); err.failure()) return err;
  const int64_t R = s[4];
  std::vector<X> dw_R(R);
  backward(pool, problem(s, x, pl, wg, wd), static_cast<const X*>(dy.untyped_data()),
           static_cast<const X*>(gu.untyped_data()), static_cast<X*>(dx->untyped_data()),
           dw_R.data(), dwg, dwd);
  X* dw = static_cast<X*>(dw_TxK->untyped_data());
  for (int64_t a = 0; a < R; ++a) {
    int32_t r = pl.plan.row_TxK[a];
    dw[a] = r < R ? dw_R[r] : from_f32<X>(0.0f);
  }
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w_TxK,
                   ffi::Buffer<ffi::S32> experts_TxK, ffi::AnyBuffer w_gu, ffi::AnyBuffer w_down,
                   ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gu) {
  if (!blas_ready()) return ffi::Error::Internal("native moe: no BLAS loaded");
  int64_t s[6];
  if (auto err = check(x, w_TxK, experts_TxK, w_gu, w_down, s); err.failure()) return err;
  WeightsF32 w(w_gu, w_down);
  const float *wg = w.gu, *wd = w.down;
  if (x.element_type() == ffi::DataType::F32)
    return forward_as<float>(pool, s, x, w_TxK, experts_TxK, wg, wd, y, gu);
  return forward_as<uint16_t>(pool, s, x, w_TxK, experts_TxK, wg, wd, y, gu);
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer gu,
                    ffi::AnyBuffer w_TxK, ffi::Buffer<ffi::S32> experts_TxK, ffi::AnyBuffer w_gu,
                    ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> dx,
                    ffi::Result<ffi::AnyBuffer> dw_TxK, ffi::Result<ffi::AnyBuffer> dw_gu,
                    ffi::Result<ffi::AnyBuffer> dw_down) {
  if (!blas_ready()) return ffi::Error::Internal("native moe: no BLAS loaded");
  int64_t s[6];
  if (auto err = check(x, w_TxK, experts_TxK, w_gu, w_down, s); err.failure()) return err;
  if (dy.element_type() != x.element_type() || gu.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("native moe: dy and gu must have x's dtype");
  WeightsF32 w(w_gu, w_down);
  const float *wg = w.gu, *wd = w.down;
  float* dwg = static_cast<float*>(dw_gu->untyped_data());
  float* dwd = static_cast<float*>(dw_down->untyped_data());
  if (x.element_type() == ffi::DataType::F32)
    return backward_as<float>(pool, s, x, dy, gu, w_TxK, experts_TxK, wg, wd, dx, dw_TxK, dwg,
                              dwd);
  return backward_as<uint16_t>(pool, s, x, dy, gu, w_TxK, experts_TxK, wg, wd, dx, dw_TxK, dwg,
                               dwd);
}

}  // namespace
}  // namespace mjn

XLA_FFI_DEFINE_HANDLER_SYMBOL(moejax_native_dropless_forward, mjn::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(moejax_native_dropless_backward, mjn::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
