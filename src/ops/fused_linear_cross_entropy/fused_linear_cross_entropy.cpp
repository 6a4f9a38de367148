// Fused linear cross-entropy front-end: argument checks, backend dispatch, and the workspace
// query.
#include "meshfuse/ops/fused_linear_cross_entropy.h"

#include "ops/common.h"
#include "ops/cross_entropy/options.h"
#include "ops/fused_linear_cross_entropy/fused_linear_cross_entropy_kernels.h"

namespace meshfuse {
namespace {

using detail::kFusedLinearCrossEntropy;

// One kernel computes both directions; the table named for the direction asked for is the one
// resolved, so that each direction is listed and forced like every other op's.
const auto kForward = MESHFUSE_KERNEL_TABLE(std::string(kFusedLinearCrossEntropy),
                                            detail::kFloatDTypes, fused_linear_cross_entropy);
const auto kBackward = MESHFUSE_KERNEL_TABLE(std::string(kFusedLinearCrossEntropy) + "_backward",
                                             detail::kFloatDTypes, fused_linear_cross_entropy);

void check_chunk_rows(std::int64_t chunk_rows) {
  MESHFUSE_CHECK(chunk_rows >= 0, ErrorCode::InvalidArgument,
                 "{}: chunk_rows must be positive, or 0 for the device's default, got {}",
                 kFusedLinearCrossEntropy, chunk_rows);
}

// The loss or a parameter's gradient: an output of the input dtype or, for a 16-bit input, f32.
void check_wide_output(std::string_view name, const TensorView& t, const Shape& shape,
                       DType dtype) {
  constexpr std::string_view op = kFusedLinearCrossEntropy;
  detail::check_defined(op, name, t);
  detail::check_same_or_f32(op, name, t, dtype, "x");
  detail::check_output(op, name, t, shape, t.dtype());
}

}  // namespace

void fused_linear_cross_entropy(const TensorView& x, const TensorView& weight,
                                const TensorView& bias, const TensorView& labels,
                                const TensorView& grad_loss, const TensorView& loss,
                                const TensorView& grad_x, const TensorView& grad_weight,
                                const TensorView& grad_bias, const CrossEntropyOptions& options,
                                std::int64_t chunk_rows, const Stream& stream) {
  constexpr std::string_view op = kFusedLinearCrossEntropy;
  detail::check_float(op, "x", x);
  detail::check_rank(op, "x", x, 2);
  detail::check_defined(op, "weight", weight);
  detail::check_same_dtype(op, "weight", weight, x.dtype(), "x");
  detail::check_rank(op, "weight", weight, 2);
  MESHFUSE_CHECK(weight.size(1) == x.size(1), ErrorCode::ShapeMismatch,
                 "{}: 'weight' {} must be (V, {}) to match 'x' {}", op, shape_str(weight.shape()),
                 x.size(1), shape_str(x.shape()));
  FusedLinearCrossEntropyShape s{x.dtype(),          x.size(0),        x.size(1),
                                 weight.size(0),     chunk_rows,       options.reduction,
                                 bias.defined(),     grad_x.defined(), grad_weight.defined(),
                                 grad_bias.defined()};
  if (bias.defined()) {
    detail::check_same_dtype(op, "bias", bias, s.dtype, "x");
    detail::check_shape(op, "bias", bias, {s.vocab});
  }
  detail::check_defined(op, "labels", labels);
  detail::check_dtype(op, "labels", labels, {DType::I32, DType::I64});
  detail::check_shape(op, "labels", labels, {s.rows});
  detail::check_cross_entropy_options(op, options);
  MESHFUSE_CHECK(options.vocab_start == 0 && options.vocab_size == 0, ErrorCode::InvalidArgument,
                 "{}: a vocabulary shard is not supported: vocab_start and vocab_size must be 0, "
                 "got {} and {}",
                 op, options.vocab_start, options.vocab_size);
  check_chunk_rows(chunk_rows);
  if (chunk_rows == 0) chunk_rows = fused_linear_cross_entropy_chunk_rows(x.device().type, s.vocab);
  s.chunk_rows = chunk_rows;
  const Shape loss_shape = s.reduction == Reduction::None ? Shape{s.rows} : Shape{};
  check_wide_output("loss", loss, loss_shape, s.dtype);
  const bool grads = s.grad_x || s.grad_weight || s.grad_bias;
  MESHFUSE_CHECK(!grads || grad_loss.defined(), ErrorCode::InvalidArgument,
                 "{}: 'grad_loss' (the upstream gradient of the loss) is required when a gradient "
                 "output is given",
                 op);
  if (grad_loss.defined()) {
    detail::check_same_dtype(op, "grad_loss", grad_loss, loss.dtype(), "loss");
    detail::check_shape(op, "grad_loss", grad_loss, loss_shape);
  }
  if (s.grad_x) detail::check_output(op, "grad_x", grad_x, x.shape(), s.dtype);
  if (s.grad_weight) check_wide_output("grad_weight", grad_weight, weight.shape(), s.dtype);
  if (s.grad_bias) {
    MESHFUSE_CHECK(s.bias, ErrorCode::InvalidArgument, "{}: 'grad_bias' is given but 'bias' is not",
                   op);
    check_wide_output("grad_bias", grad_bias, {s.vocab}, s.dtype);
  }
  detail::run_kernel(
      grads ? kBackward : kForward,
      {{"x", x},
       {"weight", weight},
       {"bias", bias},
       {"labels", labels},
       {"grad_loss", grad_loss},
       {"loss", loss},
       {"grad_x", grad_x},
       {"grad_weight", grad_weight},
       {"grad_bias", grad_bias}},
      stream, [&](auto* fn, detail::KernelCall& call) {
        const auto in = [&](const TensorView& t) { return call.input(t).data(); };
        const auto out = [&](const TensorView& t) { return call.output(t).data(); };
        fn(s, labels.dtype(),
           {in(x), in(weight), in(bias), in(labels), in(grad_loss), out(loss), out(grad_x),
            out(grad_weight), out(grad_bias), loss.dtype(),
            grad_weight.defined() ? grad_weight.dtype() : s.dtype,
            grad_bias.defined() ? grad_bias.dtype() : s.dtype},
           options, call.stream());
      });
}

std::int64_t fused_linear_cross_entropy_chunk_rows(DeviceType type, std::int64_t vocab) {
  if (type == DeviceType::CPU) return kFusedLinearCrossEntropyCpuChunkRows;
  constexpr std::int64_t kMultiple = 256;
  const std::int64_t rows =
      kFusedLinearCrossEntropyCudaChunkBytes / (4 * std::max<std::int64_t>(vocab, 1));
  return std::max(kMultiple, rows / kMultiple * kMultiple);
}

FusedLinearCrossEntropyWorkspace fused_linear_cross_entropy_workspace(
    const FusedLinearCrossEntropyShape& shape) {
  FusedLinearCrossEntropyShape s = shape;
  MESHFUSE_CHECK(s.rows >= 0 && s.hidden >= 0 && s.vocab >= 0, ErrorCode::InvalidArgument,
                 "{}: sizes must be non-negative, got rows={} hidden={} vocab={}",
                 kFusedLinearCrossEntropy, s.rows, s.hidden, s.vocab);
  check_chunk_rows(s.chunk_rows);
  if (s.chunk_rows == 0) s.chunk_rows = kFusedLinearCrossEntropyCpuChunkRows;
  if (!is_floating_point(s.dtype)) detail::fail_dtype(kFusedLinearCrossEntropy, s.dtype);
  const detail::cpu::FusedLinearCrossEntropyPlan p = detail::cpu::plan(s);
  const std::int64_t a = s.dtype == DType::F64 ? 8 : 4;  // the compute type's size
  // The lse of the compute type's logits is double (cross_entropy_lse_dtype).
  return {p.logits * a, (p.lse + p.row_loss + p.row_grad) * 8,
          (p.x_chunk + p.grad_x_chunk + p.weight_block + p.bias) * 4, p.grad_bias * 8};
}

}  // namespace meshfuse
