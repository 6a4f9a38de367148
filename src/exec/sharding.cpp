#include "meshfuse/exec/sharding.h"

namespace meshfuse {
namespace {

const Placement kR = Replicate{};
const Placement kP = Partial{};

Placement shard(std::int64_t dim) { return Shard{dim}; }

std::int64_t rank_of(const Program& p, Value v) {
  return static_cast<std::int64_t>(p.info(v).shape.size());
}

// Every operand and result `placement`.
ShardingStrategy all(const ProgramOp& op, const Placement& placement) {
  return {std::vector<Placement>(op.inputs.size(), placement),
          std::vector<Placement>(op.outputs.size(), placement)};
}

}  // namespace

std::vector<ShardingStrategy> sharding_strategies(const Program& p, const ProgramOp& op) {
  std::vector<ShardingStrategy> s{all(op, kR)};
  const std::int64_t r = rank_of(p, op.inputs[0]);
  // Row-wise ops: shard any dim but the last, the operands listed (weights) replicated and, when
  // `reduced` lists results, those Partial (a weight's gradient summed over the rows).
  const auto rows = [&](std::vector<std::size_t> replicated,
                        std::vector<std::size_t> reduced = {}) {
    for (std::int64_t d = 0; d + 1 < r; ++d) {
      ShardingStrategy t = all(op, shard(d));
      for (std::size_t i : replicated) t.inputs[i] = kR;
      for (std::size_t j : reduced)
        if (j < t.outputs.size()) t.outputs[j] = kP;  // a gradient the op may not have
      s.push_back(t);
    }
  };
  const bool none = op.loss.reduction == Reduction::None;
  switch (op.type) {
    case OpType::Linear:
      rows({1, 2});
      s.push_back({{kR, shard(0), shard(0)}, {shard(r - 1)}});
      if (!op.inputs[2].defined()) {
        s.push_back({{shard(r - 1), shard(1), kR}, {kP}});
        s.push_back({{kP, kR, kR}, {kP}});
      }
      break;
    case OpType::LinearBackward:  // (grad_out, x, weight, bias) -> (grad_x, grad_weight[,
                                  // grad_bias])
      rows({2, 3}, {1, 2});
      s.push_back({{shard(r - 1), kR, shard(0), shard(0)}, {kP, shard(0), shard(0)}});
      if (!op.inputs[3].defined())
        s.push_back({{kR, shard(r - 1), shard(1), kR}, {shard(r - 1), shard(1)}});
      break;
    case OpType::Matmul:
      s.push_back({{shard(r - 2), kR}, {shard(r - 2)}});
      s.push_back({{kR, shard(r - 1)}, {shard(r - 1)}});
      s.push_back({{shard(r - 1), shard(r - 2)}, {kP}});
      if (r == 3) s.push_back(all(op, shard(0)));
      break;
    case OpType::MatmulBackward:  // (grad_out, a, b) -> (grad_a, grad_b)
      if (r == 3) s.push_back(all(op, shard(0)));
      s.push_back({{shard(r - 2), shard(r - 2), kR}, {shard(r - 2), kP}});
      s.push_back({{shard(r - 1), kR, shard(r - 1)}, {kP, shard(r - 1)}});
      s.push_back({{kR, shard(r - 1), shard(r - 2)}, {shard(r - 1), shard(r - 2)}});
      break;
    case OpType::Add:
    case OpType::Swiglu:
    case OpType::SwigluBackward:
      for (std::int64_t d = 0; d < r; ++d) s.push_back(all(op, shard(d)));
      if (op.type == OpType::Add) s.push_back(all(op, kP));
      break;
    case OpType::RmsNorm:  // (x, weight) -> (y, rstd)
      rows({1});
      break;
    case OpType::FusedResidualAddRmsNorm:  // (x, residual, weight) -> (y, r, rstd)
      rows({2});
      break;
    case OpType::RmsNormBackward:  // (grad_y, x, weight, rstd) -> (grad_x[, grad_weight])
      rows({2}, {1});
      break;
    case OpType::FusedResidualAddRmsNormBackward:
      // (grad_y, grad_r, r, weight, rstd) -> (grad_x, grad_residual[, grad_weight])
      rows({3}, {2});
      break;
    case OpType::Softmax:
    case OpType::SoftmaxBackward:
    case OpType::SwigluPacked:
    case OpType::SwigluPackedBackward:
      rows({});
      break;
    case OpType::CrossEntropy:  // (logits, labels) -> (loss, lse)
      s.push_back({{shard(1), kR}, {kR, kR}, true});
      if (op.loss.reduction == Reduction::Mean) break;
      s.push_back({{shard(0), shard(0)}, {none ? shard(0) : kP, shard(0)}});
      break;
    case OpType::CrossEntropyBackward:  // (grad_loss, logits, labels, lse) -> grad_logits
      s.push_back({{kR, shard(1), kR, kR}, {shard(1)}});
      if (op.loss.reduction == Reduction::Mean) break;
      s.push_back({{none ? shard(0) : kR, shard(0), shard(0), shard(0)}, {shard(0)}});
      break;
    case OpType::FusedLinearCrossEntropy: {
      // (x, weight, bias, labels, grad_loss) -> (loss[, grad_x, grad_weight[, grad_bias]])
      s.push_back({{kR, shard(0), shard(0), kR, kR}, {kR, kP, shard(0), shard(0)}, true});
      if (op.loss.reduction == Reduction::Mean) break;
      ShardingStrategy t = all(op, kP);
      t.inputs = {shard(0), kR, kR, shard(0), none ? shard(0) : kR};
      t.outputs[0] = none ? shard(0) : kP;
      if (t.outputs.size() > 1) t.outputs[1] = shard(0);
      s.push_back(t);
      break;
    }
  }
  // Strategies list every gradient an op can have; drop those this one lacks (no bias).
  for (ShardingStrategy& t : s) t.outputs.resize(op.outputs.size());
  return s;
}

}  // namespace meshfuse
