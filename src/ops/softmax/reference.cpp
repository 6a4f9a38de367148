// Reference softmax: two passes per row (max, then sum), in double.
#include <cmath>
#include <limits>

#include "ops/common.h"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse::detail::reference {

void softmax_forward(const SoftmaxShape& s, const void* x, void* y, double multiplier,
                     const Stream&) {
  dispatch_float(s.dtype, "softmax", [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* xr = static_cast<const T*>(x) + row_offset(r, s.cols);
      T* yr = static_cast<T*>(y) + row_offset(r, s.cols);
      // The max skips NaN (as fmax would); NaN must poison the row, which the sum below takes
      // care of. A compare, not std::fmax: GCC 12.2 for Arm64 crashes vectorising an fmax
      // reduction of floats widened to double (an internal compiler error).
      double max = -std::numeric_limits<double>::infinity();
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double v = multiplier * to_float(xr[c]);
        max = v > max ? v : max;
      }
      double sum = 0;
      for (std::int64_t c = 0; c < s.cols; ++c) sum += std::exp(multiplier * to_float(xr[c]) - max);
      for (std::int64_t c = 0; c < s.cols; ++c)
        yr[c] = from_double<T>(std::exp(multiplier * to_float(xr[c]) - max) / sum);
    }
  });
}

void softmax_backward(const SoftmaxShape& s, const void* grad_y, const void* y, void* grad_x,
                      double multiplier, const Stream&) {
  dispatch_float(s.dtype, "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* dyr = static_cast<const T*>(grad_y) + row_offset(r, s.cols);
      const T* yr = static_cast<const T*>(y) + row_offset(r, s.cols);
      T* dxr = static_cast<T*>(grad_x) + row_offset(r, s.cols);
      double dot = 0;
      for (std::int64_t c = 0; c < s.cols; ++c)
        dot += static_cast<double>(to_float(dyr[c])) * to_float(yr[c]);
      for (std::int64_t c = 0; c < s.cols; ++c)
        dxr[c] = from_double<T>(multiplier * to_float(yr[c]) * (to_float(dyr[c]) - dot));
    }
  });
}

}  // namespace meshfuse::detail::reference
