// Cross-entropy front-end: argument checks, backend dispatch; and the host-side helpers shared
// by the reference and cpu backends (label check, loss reduction, upstream gradient).
#include "meshfuse/ops/cross_entropy.h"

#include <cmath>

#include "core/names.h"
#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/options.h"

namespace meshfuse {

std::string_view to_string(Reduction reduction) {
  switch (reduction) {
    case Reduction::None:
      return "none";
    case Reduction::Mean:
      return "mean";
    case Reduction::Sum:
      return "sum";
  }
  return "?";
}

Reduction parse_reduction(std::string_view name) {
  constexpr Reduction kAll[] = {Reduction::None, Reduction::Mean, Reduction::Sum};
  return detail::parse_name("reduction", name, kAll);
}

std::string_view to_string(LabelCheck check) {
  return check == LabelCheck::Raise ? "raise" : "device_assert";
}

LabelCheck parse_label_check(std::string_view name) {
  constexpr LabelCheck kAll[] = {LabelCheck::Raise, LabelCheck::DeviceAssert};
  return detail::parse_name("label_check", name, kAll);
}

namespace detail {

std::int64_t check_labels(std::string_view op, const CrossEntropyShape& s, const void* labels,
                          const CrossEntropyOptions& options) {
  const std::int64_t classes = vocab_classes(options, s.vocab);
  return dispatch_index(s.label_dtype, op, [&](auto tag) {
    using L = decltype(tag);
    const L* y = static_cast<const L*>(labels);
    std::int64_t count = 0;
    for (std::int64_t i = 0; i < s.rows; ++i) {
      const std::int64_t label = y[i];
      if (label == options.ignore_index) continue;
      if (label < 0 || label >= classes) fail_label(op, classes, i, label, options.ignore_index);
      ++count;
    }
    return count;
  });
}

void fail_label(std::string_view op, std::int64_t classes, std::int64_t row, std::int64_t label,
                std::int64_t ignore_index) {
  fail(ErrorCode::InvalidArgument,
       "{}: labels[{}] = {} is outside [0, {}) and is not ignore_index ({})", op, row, label,
       classes, ignore_index);
}

void store_loss(const CrossEntropyShape& s, const std::vector<double>& row_loss, std::int64_t count,
                Reduction reduction, void* loss) {
  dispatch_float(s.loss_dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(loss);
    if (reduction == Reduction::None) {
      for (std::int64_t i = 0; i < s.rows; ++i) out[i] = from_double<T>(row_loss[i]);
      return;
    }
    double sum = 0;
    for (double l : row_loss) sum += l;
    // 0 / 0 = NaN for mean with every row ignored, as PyTorch.
    out[0] = from_double<T>(reduction == Reduction::Sum ? sum : sum / static_cast<double>(count));
  });
}

CrossEntropyUpstream read_upstream(const CrossEntropyShape& s, const void* grad_loss,
                                   std::int64_t count, Reduction reduction,
                                   std::vector<double>& row_grad_storage) {
  return dispatch_float(s.loss_dtype, "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(grad_loss);
    if (reduction == Reduction::None) {
      row_grad_storage.resize(static_cast<std::size_t>(s.rows));
      for (std::int64_t i = 0; i < s.rows; ++i) row_grad_storage[i] = to_float(g[i]);
      return CrossEntropyUpstream{1.0, row_grad_storage.data()};
    }
    const double scale = to_float(g[0]);
    if (reduction == Reduction::Sum) return CrossEntropyUpstream{scale, nullptr};
    return CrossEntropyUpstream{count == 0 ? 0.0 : scale / static_cast<double>(count), nullptr};
  });
}

}  // namespace detail

namespace {

const auto kForward =
    MESHFUSE_KERNEL_TABLE("cross_entropy", detail::kFloatDTypes, cross_entropy_forward);
const auto kBackward =
    MESHFUSE_KERNEL_TABLE("cross_entropy_backward", detail::kFloatDTypes, cross_entropy_backward);

// Checks logits (N, V), labels (N,), lse (N,) and the options; returns the shape.
detail::CrossEntropyShape check_inputs(std::string_view op, const TensorView& logits,
                                       const TensorView& labels,
                                       const CrossEntropyOptions& options) {
  detail::check_float(op, "logits", logits);
  detail::check_rank(op, "logits", logits, 2);
  detail::check_defined(op, "labels", labels);
  detail::check_dtype(op, "labels", labels, {DType::I32, DType::I64});
  detail::check_shape(op, "labels", labels, {logits.size(0)});
  detail::check_cross_entropy_options(op, options);
  detail::check_vocab_shard(op, options, logits.size(1));
  return {logits.dtype(), logits.dtype(), labels.dtype(), logits.size(0), logits.size(1)};
}

// The loss (forward) or grad_loss (backward): defined, of the logits' dtype or, for 16-bit logits,
// f32; recorded as s.loss_dtype.
void check_loss_dtype(std::string_view op, std::string_view name, const TensorView& t,
                      detail::CrossEntropyShape& s) {
  detail::check_defined(op, name, t);
  detail::check_same_or_f32(op, name, t, s.dtype, "logits");
  s.loss_dtype = t.dtype();
}

Shape loss_shape(const detail::CrossEntropyShape& s, Reduction reduction) {
  return reduction == Reduction::None ? Shape{s.rows} : Shape{};
}

}  // namespace

void cross_entropy(const TensorView& logits, const TensorView& labels, const TensorView& loss,
                   const TensorView& lse, const CrossEntropyOptions& options,
                   const Stream& stream) {
  constexpr std::string_view op = "cross_entropy";
  detail::CrossEntropyShape s = check_inputs(op, logits, labels, options);
  check_loss_dtype(op, "loss", loss, s);
  detail::check_output(op, "loss", loss, loss_shape(s, options.reduction), s.loss_dtype);
  if (lse.defined())
    detail::check_output(op, "lse", lse, {s.rows}, cross_entropy_lse_dtype(s.dtype));
  detail::run_kernel(
      kForward, {{"logits", logits}, {"labels", labels}, {"loss", loss}, {"lse", lse}}, stream,
      [&](auto* fn, detail::KernelCall& call) {
        fn(s, call.input(logits).data(), call.input(labels).data(), call.output(loss).data(),
           call.output(lse).data(), options, call.stream());
      });
}

void cross_entropy_backward(const TensorView& grad_loss, const TensorView& logits,
                            const TensorView& labels, const TensorView& lse,
                            const TensorView& grad_logits, const CrossEntropyOptions& options,
                            const Stream& stream) {
  constexpr std::string_view op = "cross_entropy_backward";
  detail::CrossEntropyShape s = check_inputs(op, logits, labels, options);
  check_loss_dtype(op, "grad_loss", grad_loss, s);
  detail::check_shape(op, "grad_loss", grad_loss, loss_shape(s, options.reduction));
  detail::check_defined(op, "lse", lse);
  detail::check_dtype(op, "lse", lse, {cross_entropy_lse_dtype(s.dtype)});
  detail::check_shape(op, "lse", lse, {s.rows});
  detail::check_output(op, "grad_logits", grad_logits, logits.shape(), s.dtype);
  detail::run_kernel(kBackward,
                     {{"logits", logits},
                      {"grad_loss", grad_loss},
                      {"labels", labels},
                      {"lse", lse},
                      {"grad_logits", grad_logits}},
                     {{"grad_logits", "logits"}}, stream, [&](auto* fn, detail::KernelCall& call) {
                       fn(s, call.input(grad_loss).data(), call.input(logits).data(),
                          call.input(labels).data(), call.input(lse).data(),
                          call.output(grad_logits).data(), options, call.stream());
                     });
}

namespace detail {

void check_cross_entropy_options(std::string_view op, const CrossEntropyOptions& options) {
  MESHFUSE_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0,
                 ErrorCode::InvalidArgument, "{}: label_smoothing must be in [0, 1], got {}", op,
                 options.label_smoothing);
  check_logits_multiplier(op, options.logits_multiplier);
  MESHFUSE_CHECK(std::isfinite(options.z_loss_scale) && options.z_loss_scale >= 0.0,
                 ErrorCode::InvalidArgument, "{}: z_loss_scale must be finite and >= 0, got {}", op,
                 options.z_loss_scale);
}

void check_vocab_shard(std::string_view op, const CrossEntropyOptions& options,
                       std::int64_t vocab) {
  const std::int64_t start = options.vocab_start, classes = vocab_classes(options, vocab);
  // start <= classes - vocab: start + vocab cannot overflow.
  MESHFUSE_CHECK(start >= 0 && classes >= vocab && start <= classes - vocab,
                 ErrorCode::InvalidArgument,
                 "{}: vocab_start = {} and vocab_size = {} do not hold the logits' {} columns: "
                 "need 0 <= vocab_start and vocab_start + {} <= vocab_size (vocab_size 0: the "
                 "logits are the whole vocabulary, from vocab_start 0)",
                 op, start, options.vocab_size, vocab, vocab);
}

}  // namespace detail
}  // namespace meshfuse
