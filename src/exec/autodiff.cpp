// grad(): the backward ops in reverse program order, each op's gradients from its outputs'.
#include "meshfuse/exec/autodiff.h"

#include <algorithm>

#include "meshfuse/core/error.h"

namespace meshfuse {

Program grad(const Program& program, Value loss, const std::vector<Value>& wrt) {
  const ValueInfo& loss_info = program.info(loss);
  MESHFUSE_CHECK(is_floating_point(loss_info.dtype), ErrorCode::InvalidArgument,
                 "grad: the loss {} must be floating", program.describe(loss));
  // Empty, the program would gain backward ops whose results nothing returns, and an input.
  MESHFUSE_CHECK(!wrt.empty(), ErrorCode::InvalidArgument,
                 "grad: wrt is empty: name the inputs whose gradients of the loss {} to compute",
                 program.describe(loss));
  const std::vector<Value>& inputs = program.inputs();
  for (std::size_t i = 0; i < wrt.size(); ++i) {
    MESHFUSE_CHECK(std::find(inputs.begin(), inputs.end(), wrt[i]) != inputs.end() &&
                       is_floating_point(program.info(wrt[i]).dtype),
                   ErrorCode::InvalidArgument, "grad: wrt[{}] ({}) must be a floating input", i,
                   program.describe(wrt[i]));
    MESHFUSE_CHECK(std::find(wrt.begin(), wrt.begin() + static_cast<std::ptrdiff_t>(i), wrt[i]) ==
                       wrt.begin() + static_cast<std::ptrdiff_t>(i),
                   ErrorCode::InvalidArgument, "grad: {} is listed twice in wrt",
                   program.describe(wrt[i]));
  }

  Program j = program;
  const Value grad_loss = j.define_tensor("grad_loss", loss_info.shape, loss_info.dtype);
  // The gradient of a sum's every term is the whole gradient: `v`'s Partial(sum) placements become
  // Replicate. Another reduction's terms have other gradients (each an avg's 1/n of it, a max's
  // all to the largest term): Unsupported.
  // `what` names v and how it is placed, for the error.
  const auto whole_where_partial = [&](const std::vector<Placement>& given, const auto& what) {
    std::vector<Placement> placed = given;
    for (Placement& p : placed) {
      const auto* partial = std::get_if<Partial>(&p);
      if (!partial) continue;
      MESHFUSE_CHECK(partial->op == ReduceOp::Sum, ErrorCode::Unsupported,
                     "grad: {} {}: of the Partial placements only Partial(sum) is differentiated",
                     what(), to_string(given));
      p = Replicate{};
    }
    return placed;
  };
  // grad_loss lies as the loss is output (e.g. per-token losses Shard(0)), else Replicate.
  const auto& outputs = program.outputs();
  if (const auto it = std::find(outputs.begin(), outputs.end(), loss);
      program.mesh() && it != outputs.end() &&
      !program.output_placements()[it - outputs.begin()].empty())
    j.set_placements(grad_loss,
                     whole_where_partial(program.output_placements()[it - outputs.begin()], [&] {
                       return "the loss " + program.describe(loss) + " is output as";
                     }));
  std::vector<Value> g(j.values().size());  // the gradient of each value, as far as summed
  const auto grad_of = [&](Value v) { return g[static_cast<std::size_t>(v.id)]; };
  const auto accumulate = [&](Value primal, Value d) {
    if (!primal.defined() || !d.defined()) return;
    if (g.size() < j.values().size()) g.resize(j.values().size());
    Value& sum = g[static_cast<std::size_t>(primal.id)];
    sum = sum.defined() ? j.add(sum, d) : d;
  };
  const auto shape_of = [&](Value v) { return program.info(v).shape; };
  const auto dtype_of = [&](Value v) { return program.info(v).dtype; };
  // Defines a backward op of `type` (options from `forward`) whose results are the gradients of
  // `primals` (absent ones skipped), and adds them up.
  const auto backward = [&](OpType type, const ProgramOp& forward, std::vector<Value> operands,
                            const std::vector<Value>& primals) {
    ProgramOp op = forward;
    op.type = type;
    op.inputs = std::move(operands);
    op.outputs.clear();
    std::vector<std::pair<Shape, DType>> results;
    std::vector<Value> wanted;
    for (Value p : primals)
      if (p.defined()) {
        results.emplace_back(shape_of(p), dtype_of(p));
        wanted.push_back(p);
      }
    const std::vector<Value> outs = j.define(std::move(op), results).outputs;
    for (std::size_t i = 0; i < outs.size(); ++i) accumulate(wanted[i], outs[i]);
  };

  g[static_cast<std::size_t>(loss.id)] = grad_loss;
  const std::vector<ProgramOp>& ops = program.ops();
  for (std::size_t k = ops.size(); k-- > 0;) {
    const ProgramOp& op = ops[k];
    const Value dy = grad_of(op.outputs[0]);
    const std::vector<Value>& in = op.inputs;
    if (op.type == OpType::FusedLinearCrossEntropy) {
      if (!dy.defined()) continue;
      MESHFUSE_CHECK(op.outputs[0] == loss, ErrorCode::Unsupported,
                     "grad: fused_linear_cross_entropy ({}) computes its gradients in its "
                     "forward, so its loss must be the loss differentiated ({})",
                     program.describe(op.outputs[0]), program.describe(loss));
      // The op itself takes the upstream gradient and returns the gradients.
      ProgramOp& fused = j.ops_[k];
      fused.inputs[4] = grad_loss;
      for (Value p : {in[0], in[1], in[2]}) {
        if (!p.defined()) continue;
        const Value d{static_cast<std::int64_t>(j.values_.size())};
        j.values_.push_back({"", shape_of(p), dtype_of(p), static_cast<std::int64_t>(k)});
        fused.outputs.push_back(d);
        accumulate(p, d);
      }
      continue;
    }
    switch (op.type) {
      case OpType::Linear:
        if (dy.defined()) backward(OpType::LinearBackward, op, {dy, in[0], in[1], in[2]}, in);
        break;
      case OpType::Matmul:
        if (dy.defined()) backward(OpType::MatmulBackward, op, {dy, in[0], in[1]}, in);
        break;
      case OpType::Add:
        accumulate(in[0], dy);
        accumulate(in[1], dy);
        break;
      case OpType::RmsNorm:
        if (dy.defined())
          backward(OpType::RmsNormBackward, op, {dy, in[0], in[1], op.outputs[1]}, {in[0], in[1]});
        break;
      case OpType::FusedResidualAddRmsNorm: {
        const Value dr = grad_of(op.outputs[1]);
        if (!dy.defined() && !dr.defined()) break;
        MESHFUSE_CHECK(dy.defined(), ErrorCode::Unsupported,
                       "grad: fused_residual_add_rmsnorm's y ({}) is unused while its r is: "
                       "not supported",
                       program.describe(op.outputs[0]));
        backward(OpType::FusedResidualAddRmsNormBackward, op,
                 {dy, dr, op.outputs[1], in[2], op.outputs[2]}, in);
        break;
      }
      case OpType::Swiglu:
        if (dy.defined()) backward(OpType::SwigluBackward, op, {dy, in[0], in[1]}, in);
        break;
      case OpType::SwigluPacked:
        if (dy.defined()) backward(OpType::SwigluPackedBackward, op, {dy, in[0]}, in);
        break;
      case OpType::Softmax:
        if (dy.defined()) backward(OpType::SoftmaxBackward, op, {dy, op.outputs[0]}, in);
        break;
      case OpType::CrossEntropy:
        if (dy.defined())
          backward(OpType::CrossEntropyBackward, op, {dy, in[0], in[1], op.outputs[1]}, {in[0]});
        break;
      default:
        fail(ErrorCode::Unsupported, "grad: {} has no backward here", to_string(op.type));
    }
  }

  for (Value w : wrt) {
    const Value d = g.size() > static_cast<std::size_t>(w.id) ? grad_of(w) : Value{};
    MESHFUSE_CHECK(d.defined(), ErrorCode::InvalidArgument,
                   "grad: the loss {} does not depend on {}", program.describe(loss),
                   program.describe(w));
    // The gradient lies as w does, Replicate where w is Partial (as DTensor's redistribute
    // backward has it).
    std::vector<Placement> placed = whole_where_partial(
        program.placements(w), [&] { return program.describe(w) + " is placed"; });
    if (placed.empty() && program.mesh())
      placed.assign(static_cast<std::size_t>(program.mesh()->ndim()), Replicate{});
    j.add_output(d, std::move(placed));
  }
  return j;
}

}  // namespace meshfuse
