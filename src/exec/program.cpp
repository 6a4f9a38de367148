// Program: the builder's checks (those of the ops' front-ends, on shapes and dtypes alone) and the
// text form.
#include "meshfuse/exec/program.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshfuse/core/error.h"
#include "meshfuse/ops/rmsnorm.h"
#include "ops/common.h"

namespace meshfuse {
namespace {

using detail::with_last;

// The shape of a per-row statistic (rmsnorm's rstd) of a tensor of `shape`: its leading dims.
Shape rows_of(Shape shape) {
  shape.pop_back();
  return shape;
}

// OpCheck's upper bound on an operand's rank when any rank will do.
constexpr std::int64_t kAnyRank = std::int64_t{1} << 30;

ProgramOp op_of(OpType type, std::vector<Value> inputs) {
  ProgramOp op;
  op.type = type;
  op.inputs = std::move(inputs);
  return op;
}

std::string rank_text(std::int64_t lo, std::int64_t hi) {
  return lo == hi         ? fmt::format("{}", lo)
         : hi == kAnyRank ? fmt::format("at least {}", lo)
                          : fmt::format("{} to {}", lo, hi);
}

// The checks of one builder call. Each error names the op, the argument and the value; none
// changes the program, so a call that throws leaves it as it was.
class OpCheck {
 public:
  OpCheck(const Program& p, std::string_view op) : p_(p), op_(op) {}

  // A value of this program (undefined is allowed when `optional`) with `lo` to `hi` dimensions.
  void operand(std::string_view arg, Value v, std::int64_t lo = 0, std::int64_t hi = kAnyRank,
               bool optional = false) {
    if (optional && !v.defined()) return;
    MESHFUSE_CHECK(p_.contains(v), ErrorCode::InvalidArgument,
                   "Program.{}: '{}' must be a value of this program (%0 to %{}), got %{}", op_,
                   arg, static_cast<std::int64_t>(p_.values().size()) - 1, v.id);
    const auto r = static_cast<std::int64_t>(p_.info(v).shape.size());
    MESHFUSE_CHECK(r >= lo && r <= hi, ErrorCode::InvalidArgument,
                   "Program.{}: '{}' ({}) must have {} dimension{}, got {}", op_, arg,
                   p_.describe(v), rank_text(lo, hi), lo == 1 && hi == 1 ? "" : "s", r);
  }

  // A floating operand (optional ones when defined) of the dtype of the first one, which sets it.
  void floating(std::string_view arg, Value v, std::int64_t lo = 0, std::int64_t hi = kAnyRank,
                bool optional = false) {
    operand(arg, v, lo, hi, optional);
    if (optional && !v.defined()) return;
    const DType d = p_.info(v).dtype;
    if (!dtype_) {
      MESHFUSE_CHECK(is_floating_point(d), ErrorCode::DTypeMismatch,
                     "Program.{}: '{}' ({}) must be f32, f64, bf16 or f16", op_, arg,
                     p_.describe(v));
      dtype_ = d;
      dtype_from_ = arg;
      return;
    }
    MESHFUSE_CHECK(d == *dtype_, ErrorCode::DTypeMismatch,
                   "Program.{}: '{}' ({}) must have the dtype of '{}' ({})", op_, arg,
                   p_.describe(v), dtype_from_, to_string(*dtype_));
  }

  void shape(std::string_view arg, Value v, const Shape& expected, std::string_view why) {
    if (!v.defined()) return;
    MESHFUSE_CHECK(p_.info(v).shape == expected, ErrorCode::ShapeMismatch,
                   "Program.{}: '{}' ({}) must be {} ({})", op_, arg, p_.describe(v),
                   shape_str(expected), why);
  }

  // Labels: i32 or i64, one per row.
  void labels(std::string_view arg, Value v, std::int64_t rows) {
    operand(arg, v, 1, 1);
    const DType d = p_.info(v).dtype;
    MESHFUSE_CHECK(d == DType::I32 || d == DType::I64, ErrorCode::DTypeMismatch,
                   "Program.{}: '{}' ({}) must be i32 or i64", op_, arg, p_.describe(v));
    shape(arg, v, {rows}, "one label per row");
  }

  // The loss's dtype: that of the floating operands, or f32 for 16-bit ones.
  DType loss_dtype(std::optional<DType> asked) const {
    const DType d = asked.value_or(*dtype_);
    MESHFUSE_CHECK(
        d == *dtype_ || (d == DType::F32 && is_sixteen_bit(*dtype_)), ErrorCode::DTypeMismatch,
        "Program.{}: loss_dtype must be the dtype of '{}' ({}){}, got {}", op_, dtype_from_,
        to_string(*dtype_), is_sixteen_bit(*dtype_) ? " or f32" : "", to_string(d));
    return d;
  }

  DType dtype() const { return *dtype_; }
  const Shape& shape_of(Value v) const { return p_.info(v).shape; }

 private:
  const Program& p_;
  std::string_view op_;
  std::optional<DType> dtype_;
  std::string_view dtype_from_;
};

}  // namespace

std::string_view to_string(OpType type) {
  switch (type) {
    case OpType::Linear:
      return "linear";
    case OpType::Matmul:
      return "matmul";
    case OpType::Add:
      return "add";
    case OpType::RmsNorm:
      return "rmsnorm";
    case OpType::FusedResidualAddRmsNorm:
      return "fused_residual_add_rmsnorm";
    case OpType::Swiglu:
      return "swiglu";
    case OpType::SwigluPacked:
      return "swiglu_packed";
    case OpType::Softmax:
      return "softmax";
    case OpType::CrossEntropy:
      return "cross_entropy";
    case OpType::FusedLinearCrossEntropy:
      return "fused_linear_cross_entropy";
    case OpType::LinearBackward:
      return "linear_backward";
    case OpType::MatmulBackward:
      return "matmul_backward";
    case OpType::RmsNormBackward:
      return "rmsnorm_backward";
    case OpType::FusedResidualAddRmsNormBackward:
      return "fused_residual_add_rmsnorm_backward";
    case OpType::SwigluBackward:
      return "swiglu_backward";
    case OpType::SwigluPackedBackward:
      return "swiglu_packed_backward";
    case OpType::SoftmaxBackward:
      return "softmax_backward";
    case OpType::CrossEntropyBackward:
      return "cross_entropy_backward";
  }
  return "?";
}

bool Program::contains(Value v) const {
  return v.id >= 0 && v.id < static_cast<std::int64_t>(values_.size());
}

const ValueInfo& Program::info(Value v) const {
  MESHFUSE_CHECK(contains(v), ErrorCode::InvalidArgument,
                 "Program: %{} is not a value of this program (%0 to %{})", v.id,
                 static_cast<std::int64_t>(values_.size()) - 1);
  return values_[static_cast<std::size_t>(v.id)];
}

std::string Program::describe(Value v) const {
  const ValueInfo& i = info(v);
  return fmt::format("%{}{} {} {}", v.id, i.name.empty() ? "" : " '" + i.name + "'",
                     shape_str(i.shape), meshfuse::to_string(i.dtype));
}

const ProgramOp& Program::define(ProgramOp op,
                                 const std::vector<std::pair<Shape, DType>>& results) {
  for (const auto& [shape, dtype] : results) {
    op.outputs.push_back(Value{static_cast<std::int64_t>(values_.size())});
    values_.push_back({"", shape, dtype, static_cast<std::int64_t>(ops_.size())});
  }
  ops_.push_back(std::move(op));
  return ops_.back();
}

Value Program::define_tensor(std::string name, Shape shape, DType dtype) {
  MESHFUSE_CHECK(!name.empty(), ErrorCode::InvalidArgument,
                 "Program.define_tensor: the name must not be empty");
  for (Value in : inputs_)
    MESHFUSE_CHECK(info(in).name != name, ErrorCode::InvalidArgument,
                   "Program.define_tensor: '{}' is already an input ({})", name, describe(in));
  MESHFUSE_CHECK(std::all_of(shape.begin(), shape.end(), [](std::int64_t d) { return d >= 0; }),
                 ErrorCode::InvalidArgument,
                 "Program.define_tensor: '{}' must have sizes >= 0, got {}", name,
                 shape_str(shape));
  const Value v{static_cast<std::int64_t>(values_.size())};
  values_.push_back({std::move(name), std::move(shape), dtype, -1});
  inputs_.push_back(v);
  return v;
}

Value Program::linear(Value x, Value weight, Value bias) {
  OpCheck c(*this, "linear");
  c.floating("x", x, 1);
  c.floating("weight", weight, 2, 2);
  c.floating("bias", bias, 1, 1, true);
  const std::int64_t k = c.shape_of(x).back(), n = c.shape_of(weight)[0];
  c.shape("weight", weight, {n, k}, "(N, K) with K the last dim of 'x'");
  c.shape("bias", bias, {n}, "(N) with N the rows of 'weight'");
  return define(op_of(OpType::Linear, {x, weight, bias}),
                {{with_last(c.shape_of(x), n), c.dtype()}})
      .outputs[0];
}

Value Program::matmul(Value a, Value b) {
  OpCheck c(*this, "matmul");
  c.floating("a", a, 2, 3);
  c.floating("b", b, 2, 3);
  const Shape& sa = c.shape_of(a);
  Shape expected = sa;  // b: (..., K, N) with the batch of a
  expected[sa.size() - 2] = sa.back();
  expected.back() = c.shape_of(b).back();
  c.shape("b", b, expected, "(K, N) or (L, K, N), with K the last dim and L the batch of 'a'");
  Shape out = sa;
  out.back() = expected.back();
  return define(op_of(OpType::Matmul, {a, b}), {{out, c.dtype()}}).outputs[0];
}

Value Program::add(Value a, Value b) {
  OpCheck c(*this, "add");
  c.floating("a", a);
  c.floating("b", b);
  c.shape("b", b, c.shape_of(a), "the shape of 'a': add does not broadcast");
  return define(op_of(OpType::Add, {a, b}), {{c.shape_of(a), c.dtype()}}).outputs[0];
}

Value Program::rmsnorm(Value x, Value weight, double eps) {
  OpCheck c(*this, "rmsnorm");
  c.floating("x", x, 1);
  c.floating("weight", weight, 1, 1, true);
  c.shape("weight", weight, {c.shape_of(x).back()}, "(H) with H the last dim of 'x'");
  MESHFUSE_CHECK(eps >= 0, ErrorCode::InvalidArgument, "Program.rmsnorm: eps must be >= 0, got {}",
                 eps);
  ProgramOp op = op_of(OpType::RmsNorm, {x, weight});
  op.eps = eps;
  return define(std::move(op), {{c.shape_of(x), c.dtype()},
                                {rows_of(c.shape_of(x)), rmsnorm_rstd_dtype(c.dtype())}})
      .outputs[0];
}

std::pair<Value, Value> Program::fused_residual_add_rmsnorm(Value x, Value residual, Value weight,
                                                            double eps, double multiplier) {
  OpCheck c(*this, "fused_residual_add_rmsnorm");
  c.floating("x", x, 1);
  c.floating("residual", residual);
  c.floating("weight", weight, 1, 1, true);
  c.shape("residual", residual, c.shape_of(x), "the shape of 'x'");
  c.shape("weight", weight, {c.shape_of(x).back()}, "(H) with H the last dim of 'x'");
  MESHFUSE_CHECK(eps >= 0, ErrorCode::InvalidArgument,
                 "Program.fused_residual_add_rmsnorm: eps must be >= 0, got {}", eps);
  ProgramOp op = op_of(OpType::FusedResidualAddRmsNorm, {x, residual, weight});
  op.eps = eps;
  op.multiplier = multiplier;
  const ProgramOp& d =
      define(std::move(op), {{c.shape_of(x), c.dtype()},
                             {c.shape_of(x), c.dtype()},
                             {rows_of(c.shape_of(x)), rmsnorm_rstd_dtype(c.dtype())}});
  return {d.outputs[0], d.outputs[1]};
}

Value Program::swiglu(Value gate, Value up) {
  OpCheck c(*this, "swiglu");
  c.floating("gate", gate);
  c.floating("up", up);
  c.shape("up", up, c.shape_of(gate), "the shape of 'gate'");
  return define(op_of(OpType::Swiglu, {gate, up}), {{c.shape_of(gate), c.dtype()}}).outputs[0];
}

Value Program::swiglu_packed(Value x, SwigluLayout layout) {
  OpCheck c(*this, "swiglu_packed");
  c.floating("x", x, 1);
  const std::int64_t width = c.shape_of(x).back();
  MESHFUSE_CHECK(width % 2 == 0, ErrorCode::InvalidArgument,
                 "Program.swiglu_packed: 'x' ({}) must have an even last dim (gate and up)",
                 describe(x));
  ProgramOp op = op_of(OpType::SwigluPacked, {x});
  op.layout = layout;
  return define(std::move(op), {{with_last(c.shape_of(x), width / 2), c.dtype()}}).outputs[0];
}

Value Program::softmax(Value x, double logits_multiplier) {
  OpCheck c(*this, "softmax");
  c.floating("x", x, 1);
  ProgramOp op = op_of(OpType::Softmax, {x});
  op.multiplier = logits_multiplier;
  return define(std::move(op), {{c.shape_of(x), c.dtype()}}).outputs[0];
}

namespace {

void check_loss_options(std::string_view op, const CrossEntropyOptions& o) {
  MESHFUSE_CHECK(o.label_smoothing >= 0 && o.label_smoothing <= 1, ErrorCode::InvalidArgument,
                 "Program.{}: label_smoothing must be in [0, 1], got {}", op, o.label_smoothing);
  // The lowering sets them on a vocabulary shard; a program's loss is over the whole vocabulary
  // (set here, they would have made every rank's loss that of a shard, without an error).
  MESHFUSE_CHECK(o.vocab_start == 0 && o.vocab_size == 0, ErrorCode::InvalidArgument,
                 "Program.{}: vocab_start and vocab_size must be 0 (the lowering sets them where "
                 "the vocabulary is sharded), got {} and {}",
                 op, o.vocab_start, o.vocab_size);
}

Shape loss_shape(std::int64_t rows, Reduction r) {
  return r == Reduction::None ? Shape{rows} : Shape{};
}

}  // namespace

Value Program::cross_entropy(Value logits, Value labels, const CrossEntropyOptions& options,
                             std::optional<DType> loss_dtype) {
  OpCheck c(*this, "cross_entropy");
  c.floating("logits", logits, 2, 2);
  const std::int64_t rows = c.shape_of(logits)[0];
  c.labels("labels", labels, rows);
  check_loss_options("cross_entropy", options);
  ProgramOp op = op_of(OpType::CrossEntropy, {logits, labels});
  op.loss = options;
  return define(std::move(op), {{loss_shape(rows, options.reduction), c.loss_dtype(loss_dtype)},
                                {{rows}, cross_entropy_lse_dtype(c.dtype())}})
      .outputs[0];
}

Value Program::fused_linear_cross_entropy(Value x, Value weight, Value bias, Value labels,
                                          const CrossEntropyOptions& options,
                                          std::optional<DType> loss_dtype) {
  OpCheck c(*this, "fused_linear_cross_entropy");
  c.floating("x", x, 2, 2);
  c.floating("weight", weight, 2, 2);
  c.floating("bias", bias, 1, 1, true);
  const std::int64_t rows = c.shape_of(x)[0], vocab = c.shape_of(weight)[0];
  c.shape("weight", weight, {vocab, c.shape_of(x)[1]}, "(V, H) with H the last dim of 'x'");
  c.shape("bias", bias, {vocab}, "(V) with V the rows of 'weight'");
  c.labels("labels", labels, rows);
  check_loss_options("fused_linear_cross_entropy", options);
  ProgramOp op = op_of(OpType::FusedLinearCrossEntropy, {x, weight, bias, labels, Value{}});
  op.loss = options;
  return define(std::move(op), {{loss_shape(rows, options.reduction), c.loss_dtype(loss_dtype)}})
      .outputs[0];
}

void Program::set_mesh(DeviceMesh mesh) {
  const auto check = [&](const std::vector<Placement>& pl, std::string_view what) {
    MESHFUSE_CHECK(pl.empty() || static_cast<std::int64_t>(pl.size()) == mesh.ndim(),
                   ErrorCode::InvalidArgument,
                   "Program.set_mesh: {} has {} placements, {} has {} dimensions", what, pl.size(),
                   mesh.to_string(), mesh.ndim());
  };
  for (std::size_t id = 0; id < placements_.size(); ++id)
    check(placements_[id], describe(Value{static_cast<std::int64_t>(id)}));
  for (std::size_t i = 0; i < outputs_.size(); ++i)
    check(output_placements_[i], fmt::format("output %{}", outputs_[i].id));
  mesh_ = std::move(mesh);
}

// Placements of v, one per mesh dimension, with Shard dims made non-negative.
std::vector<Placement> Program::checked_placements(std::string_view op, Value v,
                                                   std::vector<Placement> placements) const {
  MESHFUSE_CHECK(mesh_.has_value(), ErrorCode::InvalidArgument,
                 "Program.{}: {}: the program has no mesh (call set_mesh first)", op, describe(v));
  MESHFUSE_CHECK(static_cast<std::int64_t>(placements.size()) == mesh_->ndim(),
                 ErrorCode::InvalidArgument,
                 "Program.{}: {}: want one placement per dimension of {}, got {}", op, describe(v),
                 mesh_->to_string(), placements.size());
  const auto r = static_cast<std::int64_t>(info(v).shape.size());
  for (Placement& pl : placements)
    if (auto* s = std::get_if<Shard>(&pl)) {
      MESHFUSE_CHECK(s->dim >= -r && s->dim < r, ErrorCode::InvalidArgument,
                     "Program.{}: {} has no dimension {} to shard", op, describe(v), s->dim);
      if (s->dim < 0) s->dim += r;
    }
  check_partials(fmt::format("Program.{}: {}", op, describe(v)), info(v).dtype, placements);
  return placements;
}

void Program::set_placements(Value v, std::vector<Placement> placements) {
  OpCheck(*this, "set_placements").operand("v", v);
  MESHFUSE_CHECK(std::find(inputs_.begin(), inputs_.end(), v) != inputs_.end(),
                 ErrorCode::InvalidArgument,
                 "Program.set_placements: {} is not an input (an output's placements are "
                 "given to add_output)",
                 describe(v));
  placements = checked_placements("set_placements", v, std::move(placements));
  placements_.resize(values_.size());
  placements_[static_cast<std::size_t>(v.id)] = std::move(placements);
}

const std::vector<Placement>& Program::placements(Value v) const {
  static const std::vector<Placement> none;
  info(v);
  const auto id = static_cast<std::size_t>(v.id);
  return id < placements_.size() ? placements_[id] : none;
}

void Program::add_output(Value v, std::vector<Placement> placements) {
  OpCheck(*this, "add_output").operand("v", v);
  if (!placements.empty()) placements = checked_placements("add_output", v, std::move(placements));
  outputs_.push_back(v);
  output_placements_.push_back(std::move(placements));
}

namespace {

// The options of `op` that its type uses, as to_string() lists them after the operands.
std::vector<std::string> options_text(const ProgramOp& op) {
  const auto loss = [](const CrossEntropyOptions& o) {
    std::vector<std::string> t{fmt::format("reduction={}", to_string(o.reduction)),
                               fmt::format("ignore_index={}", o.ignore_index)};
    if (o.label_smoothing != 0) t.push_back(fmt::format("label_smoothing={}", o.label_smoothing));
    if (o.logits_multiplier != 1)
      t.push_back(fmt::format("logits_multiplier={}", o.logits_multiplier));
    if (o.z_loss_scale != 0) t.push_back(fmt::format("z_loss_scale={}", o.z_loss_scale));
    if (o.label_check != LabelCheck::Raise)
      t.push_back(fmt::format("label_check={}", to_string(o.label_check)));
    return t;
  };
  switch (op.type) {
    case OpType::RmsNorm:
      return {fmt::format("eps={}", op.eps)};
    case OpType::FusedResidualAddRmsNorm:
    case OpType::FusedResidualAddRmsNormBackward:
      return {fmt::format("eps={}", op.eps), fmt::format("multiplier={}", op.multiplier)};
    case OpType::SwigluPacked:
    case OpType::SwigluPackedBackward:
      return {op.layout == SwigluLayout::Halves ? "layout=halves" : "layout=interleaved"};
    case OpType::Softmax:
    case OpType::SoftmaxBackward:
      return {fmt::format("logits_multiplier={}", op.multiplier)};
    case OpType::CrossEntropy:
    case OpType::CrossEntropyBackward:
    case OpType::FusedLinearCrossEntropy:
      return loss(op.loss);
    default:
      return {};
  }
}

}  // namespace

std::string Program::to_string() const {
  const auto placed = [&](const std::vector<Placement>& pl) {
    return pl.empty() ? std::string() : " " + meshfuse::to_string(pl);
  };
  std::string text;
  if (mesh_) text += fmt::format("mesh {}\n", mesh_->to_string());
  for (Value in : inputs_) text += fmt::format("{}{}\n", describe(in), placed(placements(in)));
  for (const ProgramOp& op : ops_) {
    std::vector<std::string> results, args;
    for (Value out : op.outputs) results.push_back(describe(out));
    for (Value in : op.inputs) args.push_back(in.defined() ? fmt::format("%{}", in.id) : "none");
    for (std::string& option : options_text(op)) args.push_back(std::move(option));
    text += fmt::format("{} = {}({})\n", fmt::join(results, ", "), meshfuse::to_string(op.type),
                        fmt::join(args, ", "));
  }
  for (std::size_t i = 0; i < outputs_.size(); ++i)
    text += fmt::format("output %{}{}\n", outputs_[i].id, placed(output_placements_[i]));
  return text;
}

}  // namespace meshfuse
