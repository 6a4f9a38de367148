// Softmax front-end: argument checks, backend dispatch.
#include "meshfuse/ops/softmax.h"

#include "ops/common.h"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse {
namespace {

const KernelTable<detail::SoftmaxForwardFn> kForward(
    "softmax",
    {{KernelBackend::Reference, detail::kReferenceDevices, detail::kFloatDTypes,
      &detail::reference::softmax_forward},
     {KernelBackend::CPU,
      {DeviceType::CPU},
      detail::kFloatDTypes,
      &detail::cpu::softmax_forward} MESHFUSE_CUDA_ENTRY(detail::kFloatDTypes, softmax_forward)});

const KernelTable<detail::SoftmaxBackwardFn> kBackward(
    "softmax_backward",
    {{KernelBackend::Reference, detail::kReferenceDevices, detail::kFloatDTypes,
      &detail::reference::softmax_backward},
     {KernelBackend::CPU,
      {DeviceType::CPU},
      detail::kFloatDTypes,
      &detail::cpu::softmax_backward} MESHFUSE_CUDA_ENTRY(detail::kFloatDTypes, softmax_backward)});

// Checks `x` (floating, rank >= 1) and returns its rows x cols.
detail::SoftmaxShape rows_of(std::string_view op, std::string_view name, const TensorView& x) {
  detail::check_defined(op, name, x);
  detail::check_dtype(op, name, x, {DType::F32, DType::F64, DType::BF16, DType::F16});
  MESHFUSE_CHECK(x.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: '{}' must have at least 1 dimension, got a 0-d tensor", op, name);
  return {x.dtype(), detail::leading_rows(x), x.size(-1)};
}

void check_like(std::string_view op, std::string_view name, const TensorView& t,
                const TensorView& like, std::string_view like_name) {
  detail::check_defined(op, name, t);
  detail::check_same_dtype(op, name, t, like.dtype(), like_name);
  detail::check_shape(op, name, t, like.shape());
}

}  // namespace

void softmax(const TensorView& x, const TensorView& y, double logits_multiplier,
             const Stream& stream) {
  constexpr std::string_view op = "softmax";
  const detail::SoftmaxShape s = rows_of(op, "x", x);
  detail::check_output(op, "y", y, x.shape(), x.dtype());
  auto* fn = kForward.select({{"x", x}, {"y", y}});
  detail::HostStaging host(op, x, stream);
  const detail::Contiguous xc(host.input(x), host.stream());
  fn(s, xc.view().data(), host.output(y).data(), logits_multiplier, host.stream());
  host.finish();
}

void softmax_backward(const TensorView& grad_y, const TensorView& y, const TensorView& grad_x,
                      double logits_multiplier, const Stream& stream) {
  constexpr std::string_view op = "softmax_backward";
  const detail::SoftmaxShape s = rows_of(op, "y", y);
  check_like(op, "grad_y", grad_y, y, "y");
  detail::check_output(op, "grad_x", grad_x, y.shape(), y.dtype());
  auto* fn = kBackward.select({{"grad_y", grad_y}, {"y", y}, {"grad_x", grad_x}});
  detail::HostStaging host(op, y, stream);
  const detail::Contiguous dy(host.input(grad_y), host.stream()), yc(host.input(y), host.stream());
  fn(s, dy.view().data(), yc.view().data(), host.output(grad_x).data(), logits_multiplier,
     host.stream());
  host.finish();
}

}  // namespace meshfuse
