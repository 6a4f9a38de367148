#include "exec/interpret.h"

#include "meshfuse/core/error.h"
#include "meshfuse/ops/cross_entropy.h"
#include "meshfuse/ops/elementwise.h"
#include "meshfuse/ops/fused_linear_cross_entropy.h"
#include "meshfuse/ops/gemm.h"
#include "meshfuse/ops/rmsnorm.h"
#include "meshfuse/ops/softmax.h"
#include "meshfuse/ops/swiglu.h"

namespace meshfuse::detail {

namespace {

// A per-row statistic (rstd, shaped as x's leading dims) as the kernels take it: (rows,).
TensorView flat(const TensorView& t) { return t.reshape({t.numel()}); }

// The optional result `i` (a weight's or bias's gradient when the op has that operand).
TensorView result(const std::vector<TensorView>& out, std::size_t i) {
  return i < out.size() ? out[i] : TensorView();
}

}  // namespace

void run_op(const ProgramOp& op, const std::vector<TensorView>& in,
            const std::vector<TensorView>& out, const Stream& stream) {
  switch (op.type) {
    case OpType::Linear:
      return linear(in[0], in[1], in[2], out[0], stream);
    case OpType::LinearBackward:
      return linear_backward(in[0], in[1], in[2], out[0], out[1], result(out, 2), stream);
    case OpType::Matmul:
      if (in[0].dim() == 2) return gemm(in[0], in[1], {}, out[0], {}, stream);
      return bmm(in[0], in[1], {}, out[0], {}, stream);
    case OpType::MatmulBackward: {
      // d(a b) = (g b^T, a^T g).
      const auto mm = in[0].dim() == 2 ? gemm : bmm;
      mm(in[0], in[2], {}, out[0], {.transpose_b = true}, stream);
      return mm(in[1], in[0], {}, out[1], {.transpose_a = true}, stream);
    }
    case OpType::Add:
      return add(in[0], in[1], out[0], 1.0, stream);
    case OpType::RmsNorm:
      return rmsnorm(in[0], in[1], out[0], flat(out[1]), op.eps, stream);
    case OpType::RmsNormBackward:
      return rmsnorm_backward(in[0], in[1], in[2], flat(in[3]), out[0], result(out, 1), stream);
    case OpType::FusedResidualAddRmsNorm:
      return fused_residual_add_rmsnorm(in[0], in[1], in[2], out[0], out[1], flat(out[2]), op.eps,
                                        op.multiplier, stream);
    case OpType::FusedResidualAddRmsNormBackward:
      return fused_residual_add_rmsnorm_backward(in[0], in[1], in[2], in[3], flat(in[4]), out[0],
                                                 out[1], result(out, 2), op.multiplier, stream);
    case OpType::Swiglu:
      return swiglu(in[0], in[1], out[0], stream);
    case OpType::SwigluBackward:
      return swiglu_backward(in[0], in[1], in[2], out[0], out[1], stream);
    case OpType::SwigluPacked:
      return swiglu_packed(in[0], op.layout, out[0], stream);
    case OpType::SwigluPackedBackward:
      return swiglu_packed_backward(in[0], in[1], op.layout, out[0], stream);
    case OpType::Softmax:
      return softmax(in[0], out[0], op.multiplier, stream);
    case OpType::SoftmaxBackward:
      return softmax_backward(in[0], in[1], out[0], op.multiplier, stream);
    case OpType::CrossEntropy:
      return cross_entropy(in[0], in[1], out[0], out[1], op.loss, stream);
    case OpType::CrossEntropyBackward:
      return cross_entropy_backward(in[0], in[1], in[2], in[3], out[0], op.loss, stream);
    case OpType::FusedLinearCrossEntropy:
      return fused_linear_cross_entropy(in[0], in[1], in[2], in[3], in[4], out[0], result(out, 1),
                                        result(out, 2), result(out, 3), op.loss,
                                        kFusedLinearCrossEntropyChunkRows, stream);
  }
  fail(ErrorCode::Internal, "run_op: op type {} has no kernel", static_cast<int>(op.type));
}

}  // namespace meshfuse::detail
