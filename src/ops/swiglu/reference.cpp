// Reference SwiGLU: one element at a time, in double.
#include <cmath>

#include "ops/common.h"
#include "ops/swiglu/swiglu_kernels.h"

namespace meshfuse::detail::reference {
namespace {

template <typename T>
T& at(SwigluOperand op, std::int64_t r, std::int64_t c) {
  return static_cast<T*>(op.data)[r * op.row_stride + c * op.col_stride];
}

}  // namespace

void swiglu_forward(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out,
                    const Stream&) {
  dispatch_float(s.dtype, "swiglu", [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t r = 0; r < s.rows; ++r)
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double g = to_float(at<T>(gate, r, c));
        const double u = to_float(at<T>(up, r, c));
        const double y = u * g / (1.0 + std::exp(-g));
        at<T>(out, r, c) = from_double<T>(y);
      }
  });
}

void swiglu_backward(const SwigluShape& s, SwigluOperand grad_out, SwigluOperand gate,
                     SwigluOperand up, SwigluOperand grad_gate, SwigluOperand grad_up,
                     const Stream&) {
  dispatch_float(s.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t r = 0; r < s.rows; ++r)
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double dy = to_float(at<T>(grad_out, r, c));
        const double g = to_float(at<T>(gate, r, c));
        const double u = to_float(at<T>(up, r, c));
        const double sig = 1.0 / (1.0 + std::exp(-g));
        at<T>(grad_up, r, c) = from_double<T>(dy * g * sig);
        at<T>(grad_gate, r, c) =
            from_double<T>(dy * u * sig * (1.0 + g * (1.0 - sig)));
      }
  });
}

}  // namespace meshfuse::detail::reference
