// Reference fused linear cross-entropy: the unfused composition, all in double: the whole (N, V)
// logits from the reference GEMM, the reference cross-entropy forward and backward, then the
// gradients' GEMMs and column sum; each output rounded once to its own dtype (grad_weight and
// grad_bias may be f32 for 16-bit inputs). No chunks, so none of the per-chunk roundings of a
// 16-bit grad_weight in the other backends: the exact gradient. Not memory-bounded: the ground
// truth.
#include <algorithm>
#include <vector>

#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/fused_linear_cross_entropy/fused_linear_cross_entropy_kernels.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse::detail::reference {
namespace {

// n elements of `dtype` at src, in double.
std::vector<double> load(const void* src, DType dtype, std::int64_t n) {
  std::vector<double> out(static_cast<std::size_t>(n));
  dispatch_float(dtype, kFusedLinearCrossEntropy, [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t i = 0; i < n; ++i) out[i] = to_float(static_cast<const T*>(src)[i]);
  });
  return out;
}

// src rounded once to `dtype` at dst.
void store(const std::vector<double>& src, DType dtype, void* dst) {
  dispatch_float(dtype, kFusedLinearCrossEntropy, [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t i = 0; i < src.size(); ++i) static_cast<T*>(dst)[i] = from_double<T>(src[i]);
  });
}

GemmMatrix matrix(std::vector<double>& data, std::int64_t ld, bool transposed = false) {
  return {data.data(), std::max<std::int64_t>(ld, 1), 0, transposed};
}

}  // namespace

void fused_linear_cross_entropy(const FusedLinearCrossEntropyShape& s, DType label_dtype,
                                const FusedLinearCrossEntropyArgs& a, const CrossEntropyOptions& o,
                                const Stream& stream) {
  const std::int64_t n = s.rows, h = s.hidden, v = s.vocab;
  const CrossEntropyShape ce{DType::F64, DType::F64, label_dtype, n, v};
  check_labels(kFusedLinearCrossEntropy, ce, a.labels, o);  // names this op
  std::vector<double> x = load(a.x, s.dtype, n * h), w = load(a.weight, s.dtype, v * h);
  std::vector<double> bias = a.bias ? load(a.bias, s.dtype, v) : std::vector<double>();
  std::vector<double> logits(static_cast<std::size_t>(n * v));
  gemm({DType::F64, 1, n, v, h, 1.0, a.bias ? 1.0 : 0.0}, matrix(x, h), matrix(w, h, true),
       a.bias ? GemmMatrix{bias.data(), 0, 0, false} : GemmMatrix{}, matrix(logits, v), stream);

  const std::int64_t loss_size = o.reduction == Reduction::None ? n : 1;
  std::vector<double> loss(static_cast<std::size_t>(loss_size)), lse(static_cast<std::size_t>(n));
  cross_entropy_forward(ce, logits.data(), a.labels, loss.data(), lse.data(), o, stream);
  store(loss, a.loss_dtype, a.loss);
  if (!a.grad_x && !a.grad_weight && !a.grad_bias) return;

  std::vector<double> grad_loss = load(a.grad_loss, a.loss_dtype, loss_size);
  std::vector<double> dl(static_cast<std::size_t>(n * v));
  cross_entropy_backward(ce, grad_loss.data(), logits.data(), a.labels, lse.data(), dl.data(), o,
                         stream);
  if (a.grad_x) {  // (N, H) = dl (N, V) @ weight (V, H)
    std::vector<double> dx(static_cast<std::size_t>(n * h));
    gemm({DType::F64, 1, n, h, v, 1.0, 0.0}, matrix(dl, v), matrix(w, h), {}, matrix(dx, h),
         stream);
    store(dx, s.dtype, a.grad_x);
  }
  if (a.grad_weight) {  // (V, H) = dl^T (V, N) @ x (N, H)
    std::vector<double> dw(static_cast<std::size_t>(v * h));
    gemm({DType::F64, 1, v, h, n, 1.0, 0.0}, matrix(dl, v, true), matrix(x, h), {}, matrix(dw, h),
         stream);
    store(dw, a.grad_weight_dtype, a.grad_weight);
  }
  if (a.grad_bias) {
    std::vector<double> db(static_cast<std::size_t>(v));
    column_sum(DType::F64, n, v, matrix(dl, v), db.data(), stream);
    store(db, a.grad_bias_dtype, a.grad_bias);
  }
}

}  // namespace meshfuse::detail::reference
