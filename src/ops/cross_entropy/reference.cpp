// Reference cross-entropy: the formulas of cross_entropy.h, one row at a time, in double.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse::detail::reference {
namespace {

// log sum_j exp(m * x_j): -inf for a row entirely -inf (as torch.logsumexp), NaN if a NaN or
// +inf is in the row (the max skips NaN, as fmax would, the sum does not). The max by a compare,
// not std::fmax: GCC 12.2 for Arm64 crashes vectorising an fmax reduction of floats widened to
// double (internal compiler error in vect_transform_reduction).
template <typename T>
double logsumexp(const T* x, std::int64_t n, double m) {
  double max = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j < n; ++j) {
    const double v = m * to_float(x[j]);
    max = v > max ? v : max;
  }
  if (max == -std::numeric_limits<double>::infinity()) return max;
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += std::exp(m * to_float(x[j]) - max);
  return max + std::log(sum);
}

template <typename L>
std::int64_t label_at(const void* labels, std::int64_t i) {
  return static_cast<const L*>(labels)[i];
}

}  // namespace

void cross_entropy_forward(const CrossEntropyShape& s, const void* logits, const void* labels,
                           void* loss, void* lse, const CrossEntropyOptions& o, const Stream&) {
  const std::int64_t count = check_labels("cross_entropy", s, labels, o);
  const auto classes = static_cast<double>(vocab_classes(o, s.vocab));
  std::vector<double> row_loss(static_cast<std::size_t>(s.rows), 0.0);
  dispatch_float(s.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(s.label_dtype, "cross_entropy", [&](auto ltag) {
      using L = decltype(ltag);
      for (std::int64_t i = 0; i < s.rows; ++i) {
        const std::int64_t y = label_at<L>(labels, i);
        if (y == o.ignore_index) {
          if (lse) static_cast<lse_t<T>*>(lse)[i] = 0;
          continue;
        }
        const T* x = static_cast<const T*>(logits) + row_offset(i, s.vocab);
        const double m = o.logits_multiplier, eps = o.label_smoothing;
        const double l = logsumexp(x, s.vocab, m);
        double mean_v = 0;
        for (std::int64_t j = 0; j < s.vocab; ++j) mean_v += m * to_float(x[j]);
        mean_v /= classes;
        // The label's logit, 0 when it is in another shard.
        const std::int64_t col = y - o.vocab_start;
        const double v_label = col >= 0 && col < s.vocab ? m * to_float(x[col]) : 0.0;
        double li = (1 - eps) * (l - v_label);
        if (eps != 0) li += eps * (l - mean_v);
        if (o.z_loss_scale != 0) li += o.z_loss_scale * l * l;
        row_loss[i] = li;
        if (lse) static_cast<lse_t<T>*>(lse)[i] = static_cast<lse_t<T>>(l);
      }
    });
  });
  store_loss(s, row_loss, count, o.reduction, loss);
}

void cross_entropy_backward(const CrossEntropyShape& s, const void* grad_loss, const void* logits,
                            const void* labels, const void* lse, void* grad_logits,
                            const CrossEntropyOptions& o, const Stream&) {
  const std::int64_t count = check_labels("cross_entropy_backward", s, labels, o);
  const auto classes = static_cast<double>(vocab_classes(o, s.vocab));
  std::vector<double> row_grad;
  const CrossEntropyUpstream up = read_upstream(s, grad_loss, count, o.reduction, row_grad);
  dispatch_float(s.dtype, "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(s.label_dtype, "cross_entropy_backward", [&](auto ltag) {
      using L = decltype(ltag);
      for (std::int64_t i = 0; i < s.rows; ++i) {
        const T* x = static_cast<const T*>(logits) + row_offset(i, s.vocab);
        T* dx = static_cast<T*>(grad_logits) + row_offset(i, s.vocab);
        const std::int64_t y = label_at<L>(labels, i);
        if (y == o.ignore_index) {
          for (std::int64_t j = 0; j < s.vocab; ++j) dx[j] = from_double<T>(0.0);
          continue;
        }
        const double m = o.logits_multiplier, eps = o.label_smoothing;
        const double l = static_cast<const lse_t<T>*>(lse)[i];
        const double g = up.scale * (up.row_grad ? up.row_grad[i] : 1.0) * m;
        const double p_scale = o.z_loss_scale != 0 ? 1 + 2 * o.z_loss_scale * l : 1.0;
        const std::int64_t col = y - o.vocab_start;  // outside [0, vocab): in another shard
        for (std::int64_t j = 0; j < s.vocab; ++j) {
          const double p = std::exp(m * to_float(x[j]) - l);
          const double target = eps / classes + (j == col ? 1 - eps : 0.0);
          dx[j] = from_double<T>(g * (p * p_scale - target));
        }
      }
    });
  });
}

}  // namespace meshfuse::detail::reference
