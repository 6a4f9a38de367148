// RMSNorm front-end: argument checks and backend dispatch. rmsnorm and fused_residual_add_rmsnorm
// share one kernel pair (and one check path); each op has its own tables so the registry lists
// both.
#include "meshfuse/ops/rmsnorm.h"

#include <cmath>

#include "ops/common.h"
#include "ops/rmsnorm/rmsnorm_kernels.h"

namespace meshfuse {
namespace {

const auto kRmsNorm = MESHFUSE_KERNEL_TABLE("rmsnorm", detail::kFloatDTypes, rmsnorm_forward);
const auto kRmsNormBackward =
    MESHFUSE_KERNEL_TABLE("rmsnorm_backward", detail::kFloatDTypes, rmsnorm_backward);
const auto kFused =
    MESHFUSE_KERNEL_TABLE("fused_residual_add_rmsnorm", detail::kFloatDTypes, rmsnorm_forward);
const auto kFusedBackward = MESHFUSE_KERNEL_TABLE("fused_residual_add_rmsnorm_backward",
                                                  detail::kFloatDTypes, rmsnorm_backward);

// x must be a floating tensor of rank >= 1; returns its (rows, H).
detail::RmsNormShape row_shape(std::string_view op, std::string_view name, const TensorView& x) {
  detail::check_float(op, name, x);
  MESHFUSE_CHECK(x.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: '{}' must have at least 1 dimension, got a 0-d tensor", op, name);
  return {x.dtype(), detail::leading_rows(x), x.size(-1)};
}

void check_weight(std::string_view op, const TensorView& weight, const TensorView& x,
                  std::string_view x_name) {
  if (!weight.defined()) return;
  detail::check_same_dtype(op, "weight", weight, x.dtype(), x_name);
  detail::check_shape(op, "weight", weight, {x.size(-1)});
}

// An optional output that only makes sense together with `needs` (named `needs_name`).
void check_absent_without(std::string_view op, std::string_view name, const TensorView& t,
                          bool needs, std::string_view needs_name) {
  MESHFUSE_CHECK(needs || !t.defined(), ErrorCode::InvalidArgument,
                 "{}: '{}' must be undefined when '{}' is not given, got {}", op, name, needs_name,
                 t.str());
}

void forward(std::string_view op, const KernelTable<detail::RmsNormForwardFn>& table,
             const TensorView& x, const TensorView& residual, const TensorView& weight,
             const TensorView& y, const TensorView& r, const TensorView& rstd, double eps,
             double multiplier, const Stream& stream) {
  const detail::RmsNormShape s = row_shape(op, "x", x);
  if (residual.defined()) detail::check_like(op, "residual", residual, x, "x");
  check_weight(op, weight, x, "x");
  MESHFUSE_CHECK(eps >= 0, ErrorCode::InvalidArgument, "{}: 'eps' must be >= 0, got {}", op, eps);
  detail::check_output(op, "y", y, x.shape(), x.dtype());
  if (residual.defined())
    detail::check_output(op, "r", r, x.shape(), x.dtype());
  else
    check_absent_without(op, "r", r, false, "residual");
  if (rstd.defined())
    detail::check_output(op, "rstd", rstd, {s.rows}, rmsnorm_rstd_dtype(x.dtype()));
  detail::run_kernel(
      table,
      {{"x", x}, {"residual", residual}, {"weight", weight}, {"y", y}, {"r", r}, {"rstd", rstd}},
      // y is written element by element after its row's sum; r is not (the second pass reads x
      // and residual again).
      {{"y", "x"}, {"y", "residual"}}, stream, [&](auto* fn, detail::KernelCall& call) {
        fn(s,
           {call.input(x).data(), call.input(residual).data(), call.input(weight).data(),
            call.output(y).data(), call.output(r).data(), call.output(rstd).data(), eps,
            multiplier},
           call.stream());
      });
}

// `input` is r when the forward had a residual (then dresidual is its gradient), else x.
void backward(std::string_view op, const KernelTable<detail::RmsNormBackwardFn>& table,
              const TensorView& grad_y, const TensorView& grad_r, const TensorView& input,
              std::string_view input_name, const TensorView& weight, const TensorView& rstd,
              const TensorView& dx, const TensorView& dresidual, const TensorView& dweight,
              double multiplier, const Stream& stream) {
  const detail::RmsNormShape s = row_shape(op, "grad_y", grad_y);
  detail::check_like(op, input_name, input, grad_y, "grad_y");
  const bool residual = dresidual.defined();
  // dresidual may be dx itself when multiplier is 1 (then they are equal): written once.
  const bool shared = residual && dx.numel() > 0 && dresidual.data() == dx.data();
  MESHFUSE_CHECK(!shared || multiplier == 1.0, ErrorCode::InvalidArgument,
                 "{}: 'dresidual' may share dx's memory only when multiplier is 1 (they differ "
                 "otherwise), got multiplier {}",
                 op, multiplier);
  const TensorView written_dresidual = shared ? TensorView() : dresidual;
  if (grad_r.defined()) {
    check_absent_without(op, "grad_r", grad_r, residual, "dresidual");
    detail::check_like(op, "grad_r", grad_r, grad_y, "grad_y");
  }
  check_weight(op, weight, grad_y, "grad_y");
  detail::check_defined(op, "rstd", rstd);
  detail::check_dtype(op, "rstd", rstd, {rmsnorm_rstd_dtype(grad_y.dtype())});
  detail::check_shape(op, "rstd", rstd, {s.rows});
  detail::check_output(op, "dx", dx, grad_y.shape(), grad_y.dtype());
  if (residual) detail::check_output(op, "dresidual", dresidual, grad_y.shape(), grad_y.dtype());
  if (dweight.defined()) {
    check_absent_without(op, "dweight", dweight, weight.defined(), "weight");
    detail::check_output(op, "dweight", dweight, {s.cols}, grad_y.dtype());
  }
  detail::run_kernel(
      table,
      {{"grad_y", grad_y},
       {"grad_r", grad_r},
       {input_name, input},
       {"weight", weight},
       {"rstd", rstd},
       {"dx", dx},
       {"dresidual", written_dresidual},
       {"dweight", dweight}},
      stream, [&](auto* fn, detail::KernelCall& call) {
        fn(s,
           {call.input(grad_y).data(), call.input(grad_r).data(), call.input(input).data(),
            call.input(weight).data(), call.input(rstd).data(), call.output(dx).data(),
            call.output(written_dresidual).data(), call.output(dweight).data(),
            residual ? 1.0 : multiplier, multiplier},
           call.stream());
      });
}

}  // namespace

void rmsnorm(const TensorView& x, const TensorView& weight, const TensorView& y,
             const TensorView& rstd, double eps, const Stream& stream) {
  forward("rmsnorm", kRmsNorm, x, {}, weight, y, {}, rstd, eps, 1.0, stream);
}

void rmsnorm_backward(const TensorView& grad_y, const TensorView& x, const TensorView& weight,
                      const TensorView& rstd, const TensorView& dx, const TensorView& dweight,
                      const Stream& stream) {
  backward("rmsnorm_backward", kRmsNormBackward, grad_y, {}, x, "x", weight, rstd, dx, {}, dweight,
           1.0, stream);
}

void fused_residual_add_rmsnorm(const TensorView& x, const TensorView& residual,
                                const TensorView& weight, const TensorView& y, const TensorView& r,
                                const TensorView& rstd, double eps, double multiplier,
                                const Stream& stream) {
  forward("fused_residual_add_rmsnorm", kFused, x, residual, weight, y, r, rstd, eps, multiplier,
          stream);
}

void fused_residual_add_rmsnorm_backward(const TensorView& grad_y, const TensorView& grad_r,
                                         const TensorView& r, const TensorView& weight,
                                         const TensorView& rstd, const TensorView& dx,
                                         const TensorView& dresidual, const TensorView& dweight,
                                         double multiplier, const Stream& stream) {
  backward("fused_residual_add_rmsnorm_backward", kFusedBackward, grad_y, grad_r, r, "r", weight,
           rstd, dx, dresidual, dweight, multiplier, stream);
}

}  // namespace meshfuse
