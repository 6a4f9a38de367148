// RMSNorm front-end: argument checks and backend dispatch. rmsnorm and fused_residual_add_rmsnorm
// share one kernel pair (and one check path); each op has its own tables so the registry lists
// both.
#include "meshfuse/ops/rmsnorm.h"

#include <cmath>

#include "ops/common.h"
#include "ops/rmsnorm/rmsnorm_kernels.h"

namespace meshfuse {
namespace {

using detail::RmsNormBackwardFn;
using detail::RmsNormForwardFn;

KernelTable<RmsNormForwardFn> forward_table(const char* op) {
  return {
      op,
      {{KernelBackend::Reference, detail::kReferenceDevices, detail::kFloatDTypes,
        &detail::reference::rmsnorm_forward},
       {KernelBackend::CPU,
        {DeviceType::CPU},
        detail::kFloatDTypes,
        &detail::cpu::rmsnorm_forward} MESHFUSE_CUDA_ENTRY(detail::kFloatDTypes, rmsnorm_forward)}};
}

KernelTable<RmsNormBackwardFn> backward_table(const char* op) {
  return {op,
          {{KernelBackend::Reference, detail::kReferenceDevices, detail::kFloatDTypes,
            &detail::reference::rmsnorm_backward},
           {KernelBackend::CPU,
            {DeviceType::CPU},
            detail::kFloatDTypes,
            &detail::cpu::rmsnorm_backward} MESHFUSE_CUDA_ENTRY(detail::kFloatDTypes,
                                                                rmsnorm_backward)}};
}

const KernelTable<RmsNormForwardFn> kRmsNorm = forward_table("rmsnorm");
const KernelTable<RmsNormBackwardFn> kRmsNormBackward = backward_table("rmsnorm_backward");
const KernelTable<RmsNormForwardFn> kFused = forward_table("fused_residual_add_rmsnorm");
const KernelTable<RmsNormBackwardFn> kFusedBackward =
    backward_table("fused_residual_add_rmsnorm_backward");

void check_like(std::string_view op, std::string_view name, const TensorView& t,
                const TensorView& like, std::string_view like_name) {
  detail::check_defined(op, name, t);
  detail::check_same_dtype(op, name, t, like.dtype(), like_name);
  detail::check_shape(op, name, t, like.shape());
}

// x must be a floating tensor of rank >= 1; returns its (rows, H).
detail::RmsNormShape row_shape(std::string_view op, std::string_view name, const TensorView& x) {
  detail::check_defined(op, name, x);
  detail::check_dtype(op, name, x, {DType::F32, DType::F64, DType::BF16, DType::F16});
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

void forward(std::string_view op, const KernelTable<RmsNormForwardFn>& table, const TensorView& x,
             const TensorView& residual, const TensorView& weight, const TensorView& y,
             const TensorView& r, const TensorView& rstd, double eps, double multiplier,
             const Stream& stream) {
  const detail::RmsNormShape s = row_shape(op, "x", x);
  if (residual.defined()) check_like(op, "residual", residual, x, "x");
  check_weight(op, weight, x, "x");
  MESHFUSE_CHECK(eps >= 0, ErrorCode::InvalidArgument, "{}: 'eps' must be >= 0, got {}", op, eps);
  detail::check_output(op, "y", y, x.shape(), x.dtype());
  if (residual.defined())
    detail::check_output(op, "r", r, x.shape(), x.dtype());
  else
    check_absent_without(op, "r", r, false, "residual");
  if (rstd.defined()) detail::check_output(op, "rstd", rstd, {s.rows}, DType::F32);
  auto* fn = table.select(
      {{"x", x}, {"residual", residual}, {"weight", weight}, {"y", y}, {"r", r}, {"rstd", rstd}});
  detail::HostStaging host(op, x, stream);
  const detail::Contiguous xc(host.input(x), host.stream()),
      res(host.input(residual), host.stream()), w(host.input(weight), host.stream());
  fn(s,
     {xc.view().data(), res.view().data(), w.view().data(), host.output(y).data(),
      host.output(r).data(), static_cast<float*>(host.output(rstd).data()), eps, multiplier},
     host.stream());
  host.finish();
}

// `input` is r when the forward had a residual (then dresidual is its gradient), else x.
void backward(std::string_view op, const KernelTable<RmsNormBackwardFn>& table,
              const TensorView& grad_y, const TensorView& grad_r, const TensorView& input,
              std::string_view input_name, const TensorView& weight, const TensorView& rstd,
              const TensorView& dx, const TensorView& dresidual, const TensorView& dweight,
              double multiplier, const Stream& stream) {
  const detail::RmsNormShape s = row_shape(op, "grad_y", grad_y);
  check_like(op, input_name, input, grad_y, "grad_y");
  const bool residual = dresidual.defined();
  // dresidual may be dx itself when multiplier is 1 (then they are equal): written once.
  const bool shared = residual && dresidual.data() == dx.data();
  MESHFUSE_CHECK(!shared || multiplier == 1.0, ErrorCode::InvalidArgument,
                 "{}: 'dresidual' may share dx's memory only when multiplier is 1 (they differ "
                 "otherwise), got multiplier {}",
                 op, multiplier);
  const TensorView written_dresidual = shared ? TensorView() : dresidual;
  if (grad_r.defined()) {
    check_absent_without(op, "grad_r", grad_r, residual, "dresidual");
    check_like(op, "grad_r", grad_r, grad_y, "grad_y");
  }
  check_weight(op, weight, grad_y, "grad_y");
  detail::check_defined(op, "rstd", rstd);
  detail::check_dtype(op, "rstd", rstd, {DType::F32});
  detail::check_shape(op, "rstd", rstd, {s.rows});
  detail::check_output(op, "dx", dx, grad_y.shape(), grad_y.dtype());
  if (residual) detail::check_output(op, "dresidual", dresidual, grad_y.shape(), grad_y.dtype());
  if (dweight.defined()) {
    check_absent_without(op, "dweight", dweight, weight.defined(), "weight");
    detail::check_output(op, "dweight", dweight, {s.cols}, grad_y.dtype());
  }
  auto* fn = table.select({{"grad_y", grad_y},
                           {"grad_r", grad_r},
                           {std::string_view(input_name), input},
                           {"weight", weight},
                           {"rstd", rstd},
                           {"dx", dx},
                           {"dresidual", written_dresidual},
                           {"dweight", dweight}});
  detail::HostStaging host(op, grad_y, stream);
  const detail::Contiguous dy(host.input(grad_y), host.stream()),
      dr(host.input(grad_r), host.stream()), in(host.input(input), host.stream()),
      w(host.input(weight), host.stream()), rs(host.input(rstd), host.stream());
  fn(s,
     {dy.view().data(), dr.view().data(), in.view().data(), w.view().data(),
      static_cast<const float*>(rs.view().data()), host.output(dx).data(),
      host.output(written_dresidual).data(), host.output(dweight).data(),
      residual ? 1.0 : multiplier, multiplier},
     host.stream());
  host.finish();
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
