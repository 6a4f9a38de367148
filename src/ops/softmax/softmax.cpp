// Softmax front-end: argument checks, backend dispatch.
#include "meshfuse/ops/softmax.h"

#include "ops/common.h"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse {
namespace {

const auto kForward = MESHFUSE_KERNEL_TABLE("softmax", detail::kFloatDTypes, softmax_forward);
const auto kBackward =
    MESHFUSE_KERNEL_TABLE("softmax_backward", detail::kFloatDTypes, softmax_backward);

// Checks `x` (floating, rank >= 1) and returns its rows x cols.
detail::SoftmaxShape rows_of(std::string_view op, std::string_view name, const TensorView& x) {
  detail::check_float(op, name, x);
  MESHFUSE_CHECK(x.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: '{}' must have at least 1 dimension, got a 0-d tensor", op, name);
  return {x.dtype(), detail::leading_rows(x), x.size(-1)};
}

}  // namespace

void softmax(const TensorView& x, const TensorView& y, double logits_multiplier,
             const Stream& stream) {
  constexpr std::string_view op = "softmax";
  const detail::SoftmaxShape s = rows_of(op, "x", x);
  detail::check_logits_multiplier(op, logits_multiplier);
  detail::check_output(op, "y", y, x.shape(), x.dtype());
  detail::run_kernel(kForward, {{"x", x}, {"y", y}}, {{"y", "x"}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       fn(s, call.input(x).data(), call.output(y).data(), logits_multiplier,
                          call.stream());
                     });
}

void softmax_backward(const TensorView& grad_y, const TensorView& y, const TensorView& grad_x,
                      double logits_multiplier, const Stream& stream) {
  constexpr std::string_view op = "softmax_backward";
  const detail::SoftmaxShape s = rows_of(op, "y", y);
  detail::check_logits_multiplier(op, logits_multiplier);
  detail::check_like(op, "grad_y", grad_y, y, "y");
  detail::check_output(op, "grad_x", grad_x, y.shape(), y.dtype());
  detail::run_kernel(kBackward, {{"grad_y", grad_y}, {"y", y}, {"grad_x", grad_x}},
                     {{"grad_x", "grad_y"}, {"grad_x", "y"}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       fn(s, call.input(grad_y).data(), call.input(y).data(),
                          call.output(grad_x).data(), logits_multiplier, call.stream());
                     });
}

}  // namespace meshfuse
