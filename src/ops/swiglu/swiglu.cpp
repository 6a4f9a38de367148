// SwiGLU front-end: argument checks, views for the packed layouts, backend dispatch.
#include "meshfuse/ops/swiglu.h"

#include "ops/common.h"
#include "ops/swiglu/swiglu_kernels.h"

namespace meshfuse {
namespace {

using detail::SwigluOperand;
using detail::SwigluShape;

// swiglu and swiglu_packed run the same kernels, registered under each op's own name so that
// errors, the registry and resolved_backend() name the op that was called.
const auto kForward = MESHFUSE_KERNEL_TABLE("swiglu", detail::kFloatDTypes, swiglu_forward);
const auto kBackward =
    MESHFUSE_KERNEL_TABLE("swiglu_backward", detail::kFloatDTypes, swiglu_backward);
const auto kPacked = MESHFUSE_KERNEL_TABLE("swiglu_packed", detail::kFloatDTypes, swiglu_forward);
const auto kPackedBackward =
    MESHFUSE_KERNEL_TABLE("swiglu_packed_backward", detail::kFloatDTypes, swiglu_backward);

SwigluOperand plain(const TensorView& t) { return {t.data(), t.dim() == 0 ? 1 : t.size(-1), 1}; }

// gate and up inside a contiguous packed tensor of last dim 2*cols.
std::pair<SwigluOperand, SwigluOperand> packed(const TensorView& x, SwigluLayout layout,
                                               std::int64_t cols) {
  const auto e = static_cast<std::int64_t>(element_size(x.dtype()));
  char* base = static_cast<char*>(x.data());
  if (layout == SwigluLayout::Halves) return {{base, 2 * cols, 1}, {base + cols * e, 2 * cols, 1}};
  return {{base, 2 * cols, 2}, {base + e, 2 * cols, 2}};
}

// The packed last dim must be even; returns I = last dim / 2.
std::int64_t half_width(std::string_view op, const TensorView& x) {
  MESHFUSE_CHECK(x.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: 'x' must have at least 1 dimension, got a 0-d tensor", op);
  MESHFUSE_CHECK(x.size(-1) % 2 == 0, ErrorCode::InvalidArgument,
                 "{}: the last dimension of 'x' must be even (gate and up), got {}", op,
                 x.size(-1));
  return x.size(-1) / 2;
}

}  // namespace

void swiglu(const TensorView& gate, const TensorView& up, const TensorView& out,
            const Stream& stream) {
  constexpr std::string_view op = "swiglu";
  detail::check_float(op, "gate", gate);
  detail::check_like(op, "up", up, gate, "gate");
  detail::check_output(op, "out", out, gate.shape(), gate.dtype());
  const SwigluShape s{gate.dtype(), detail::leading_rows(gate),
                      gate.dim() == 0 ? 1 : gate.size(-1)};
  detail::run_kernel(kForward, {{"gate", gate}, {"up", up}, {"out", out}},
                     {{"out", "gate"}, {"out", "up"}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       fn(s, plain(call.input(gate)), plain(call.input(up)),
                          plain(call.output(out)), call.stream());
                     });
}

void swiglu_backward(const TensorView& grad_out, const TensorView& gate, const TensorView& up,
                     const TensorView& grad_gate, const TensorView& grad_up, const Stream& stream) {
  constexpr std::string_view op = "swiglu_backward";
  detail::check_float(op, "gate", gate);
  detail::check_like(op, "up", up, gate, "gate");
  detail::check_like(op, "grad_out", grad_out, gate, "gate");
  detail::check_output(op, "grad_gate", grad_gate, gate.shape(), gate.dtype());
  detail::check_output(op, "grad_up", grad_up, gate.shape(), gate.dtype());
  const SwigluShape s{gate.dtype(), detail::leading_rows(gate),
                      gate.dim() == 0 ? 1 : gate.size(-1)};
  detail::run_kernel(kBackward,
                     {{"gate", gate},
                      {"up", up},
                      {"grad_out", grad_out},
                      {"grad_gate", grad_gate},
                      {"grad_up", grad_up}},
                     // Elementwise: every input element is read before either output's.
                     {{"grad_gate", "gate"},
                      {"grad_gate", "up"},
                      {"grad_gate", "grad_out"},
                      {"grad_up", "gate"},
                      {"grad_up", "up"},
                      {"grad_up", "grad_out"}},
                     stream, [&](auto* fn, detail::KernelCall& call) {
                       fn(s, plain(call.input(grad_out)), plain(call.input(gate)),
                          plain(call.input(up)), plain(call.output(grad_gate)),
                          plain(call.output(grad_up)), call.stream());
                     });
}

void swiglu_packed(const TensorView& x, SwigluLayout layout, const TensorView& out,
                   const Stream& stream) {
  constexpr std::string_view op = "swiglu_packed";
  detail::check_float(op, "x", x);
  const std::int64_t cols = half_width(op, x);
  detail::check_output(op, "out", out, detail::with_last(x.shape(), cols), x.dtype());
  detail::run_kernel(kPacked, {{"x", x}, {"out", out}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       const auto [gate, up] = packed(call.input(x), layout, cols);
                       fn({x.dtype(), detail::leading_rows(x), cols}, gate, up,
                          plain(call.output(out)), call.stream());
                     });
}

void swiglu_packed_backward(const TensorView& grad_out, const TensorView& x, SwigluLayout layout,
                            const TensorView& grad_x, const Stream& stream) {
  constexpr std::string_view op = "swiglu_packed_backward";
  detail::check_float(op, "x", x);
  const std::int64_t cols = half_width(op, x);
  detail::check_defined(op, "grad_out", grad_out);
  detail::check_same_dtype(op, "grad_out", grad_out, x.dtype(), "x");
  detail::check_shape(op, "grad_out", grad_out, detail::with_last(x.shape(), cols));
  detail::check_output(op, "grad_x", grad_x, x.shape(), x.dtype());
  detail::run_kernel(kPackedBackward, {{"x", x}, {"grad_out", grad_out}, {"grad_x", grad_x}},
                     stream, [&](auto* fn, detail::KernelCall& call) {
                       const auto [gate, up] = packed(call.input(x), layout, cols);
                       const auto [grad_gate, grad_up] = packed(call.output(grad_x), layout, cols);
                       fn({x.dtype(), detail::leading_rows(x), cols}, plain(call.input(grad_out)),
                          gate, up, grad_gate, grad_up, call.stream());
                     });
}

}  // namespace meshfuse
