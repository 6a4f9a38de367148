// Reference RMSNorm: row by row, element by element, in double.
#include <cmath>
#include <vector>

#include "ops/common.h"
#include "ops/rmsnorm/rmsnorm_kernels.h"

namespace meshfuse::detail::reference {
namespace {

template <typename T>
double load(const void* p, std::int64_t i) {
  return to_float(static_cast<const T*>(p)[i]);
}

template <typename T>
double weight_at(const void* weight, std::int64_t c) {
  return weight ? load<T>(weight, c) : 1.0;
}

}  // namespace

void rmsnorm_forward(const RmsNormShape& s, const RmsNormForwardArgs& a, const Stream&) {
  dispatch_float(s.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const auto pre_norm = [&](std::int64_t i) {
      return load<T>(a.x, i) * a.multiplier + (a.residual ? load<T>(a.residual, i) : 0.0);
    };
    for (std::int64_t row = 0; row < s.rows; ++row) {
      const std::int64_t base = row * s.cols;
      double sum_sq = 0;
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double v = pre_norm(base + c);
        sum_sq += v * v;
        if (a.r) static_cast<T*>(a.r)[base + c] = from_double<T>(v);
      }
      const double rstd = 1.0 / std::sqrt(sum_sq / static_cast<double>(s.cols) + a.eps);
      if (a.rstd) static_cast<rstd_t<T>*>(a.rstd)[row] = static_cast<rstd_t<T>>(rstd);
      for (std::int64_t c = 0; c < s.cols; ++c)
        static_cast<T*>(a.y)[base + c] =
            from_double<T>(pre_norm(base + c) * rstd * weight_at<T>(a.weight, c));
    }
  });
}

void rmsnorm_backward(const RmsNormShape& s, const RmsNormBackwardArgs& a, const Stream&) {
  dispatch_float(s.dtype, "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    std::vector<double> dweight(a.dweight ? s.cols : 0, 0.0);
    for (std::int64_t row = 0; row < s.rows; ++row) {
      const std::int64_t base = row * s.cols;
      const double rstd = static_cast<const rstd_t<T>*>(a.rstd)[row];
      const auto n = [&](std::int64_t c) {
        return load<T>(a.input, base + c) * a.input_scale * rstd;
      };
      const auto dn = [&](std::int64_t c) {
        return load<T>(a.grad_y, base + c) * weight_at<T>(a.weight, c);
      };
      double dot = 0;
      for (std::int64_t c = 0; c < s.cols; ++c) dot += dn(c) * n(c);
      const double mean = dot / static_cast<double>(s.cols);
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double dr =
            rstd * (dn(c) - n(c) * mean) + (a.grad_r ? load<T>(a.grad_r, base + c) : 0.0);
        static_cast<T*>(a.dx)[base + c] = from_double<T>(dr * a.multiplier);
        if (a.dresidual) static_cast<T*>(a.dresidual)[base + c] = from_double<T>(dr);
        if (a.dweight) dweight[c] += load<T>(a.grad_y, base + c) * n(c);
      }
    }
    for (std::int64_t c = 0; c < static_cast<std::int64_t>(dweight.size()); ++c)
      static_cast<T*>(a.dweight)[c] = from_double<T>(dweight[c]);
  });
}

}  // namespace meshfuse::detail::reference
