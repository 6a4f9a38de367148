// A Program: a small graph of meshfuse ops written once against global shapes, which the
// executor shards over a device mesh, lowers to per-rank compute and communications, and runs
// forward and backward (nvFuser's Fusion and FusionDefinition play this part there).
//
// Static single assignment: every value is defined once, by define_tensor (an input) or by the op
// that computes it, and a builder call returns it as a Value that later calls take. Each op checks
// the shapes and dtypes of its operands when it is added, so a program that builds is well typed:
// an error names the op, the argument, the value and what was expected, and leaves the program as
// it was. Values are in definition order, so the ops are in an order that runs.
//
// The ops, with the semantics of their kernels (include/meshfuse/ops/*.h); no broadcasting:
//   linear(x (..., K), weight (N, K), bias (N) or none)        -> (..., N)
//   matmul(a (M, K), b (K, N)) -> (M, N); a (L, M, K), b (L, K, N) -> (L, M, N)
//   add(a, b), same shape                                       -> like a
//   rmsnorm(x (..., H), weight (H) or none, eps)                -> y like x
//   fused_residual_add_rmsnorm(x, residual like x, weight, eps, multiplier)
//                                                               -> {y, r} like x (r = x m +
//                                                               residual)
//   swiglu(gate, up), same shape                                -> like gate
//   swiglu_packed(x (..., 2I), layout)                          -> (..., I)
//   softmax(x (..., V), logits_multiplier)                      -> like x
//   cross_entropy(logits (N, V), labels (N) i32/i64, options)   -> loss
//   fused_linear_cross_entropy(x (N, H), weight (V, H), bias (V) or none, labels (N), options)
//                                                               -> loss
// loss: () for mean and sum, (N,) for none; in the logits' (x's) dtype, or f32 for 16-bit ones
// when loss_dtype says so. Every floating operand of an op shares one dtype (f32, f64, bf16, f16).
// Three ops also define the statistic their backward reads, as a last result the builder does not
// return: rmsnorm and fused_residual_add_rmsnorm rstd (x's leading dims; f64 for f64 x, else f32),
// cross_entropy lse ((N,); f32 for 16-bit logits, else f64). fused_linear_cross_entropy's operands
// end with its upstream gradient, undefined unless grad() asks the op for its gradients (then also
// results).
//
// Multi-device: set_mesh() puts the program on a DeviceMesh, set_placements() says how an input
// lies on it (default: Replicate on every mesh dimension), and add_output() how an output is
// wanted (default: as propagated, with Partial made Replicate). Shapes stay global; the lowering
// (exec/lowering.h) derives each rank's part.
//
// Errors: InvalidArgument (a Value not of this program, an empty or repeated input name, a bad
// rank or option, an output added twice, placements of a value that is not an input, or without
// a mesh, or not one per mesh dimension, or a Shard outside the tensor), ShapeMismatch,
// DTypeMismatch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/device_mesh.h"
#include "meshfuse/exec/placement.h"
#include "meshfuse/ops/cross_entropy.h"
#include "meshfuse/ops/swiglu.h"

namespace meshfuse {

// A value of a Program: its index in Program::values(). Default-constructed: no value (an absent
// optional operand, such as a linear without bias).
struct Value {
  std::int64_t id = -1;
  bool defined() const { return id >= 0; }
  friend bool operator==(Value a, Value b) = default;
};

enum class OpType {
  Linear,
  Matmul,
  Add,
  RmsNorm,
  FusedResidualAddRmsNorm,
  Swiglu,
  SwigluPacked,
  Softmax,
  CrossEntropy,
  FusedLinearCrossEntropy,
  // The backward ops that grad() (autodiff.h) adds; each runs the op's backward kernel.
  LinearBackward,
  MatmulBackward,
  RmsNormBackward,
  FusedResidualAddRmsNormBackward,
  SwigluBackward,
  SwigluPackedBackward,
  SoftmaxBackward,
  CrossEntropyBackward,
};

// "linear", "matmul", ..., as the builder's methods are named.
std::string_view to_string(OpType type);

// What a Program knows of a value.
struct ValueInfo {
  std::string name;  // the input's name; "" for the values the ops define
  Shape shape;
  DType dtype;
  std::int64_t producer;  // index of the op in Program::ops() that defines it; -1 for an input
};

// One op of a Program: its operands in the kernel's argument order (undefined where an optional
// operand is absent), its results, and its options (those its type uses; the others keep their
// defaults).
struct ProgramOp {
  OpType type;
  std::vector<Value> inputs;
  std::vector<Value> outputs;
  double eps = 0.0;         // rmsnorm, fused_residual_add_rmsnorm
  double multiplier = 1.0;  // fused_residual_add_rmsnorm, softmax (logits multiplier)
  SwigluLayout layout = SwigluLayout::Halves;  // swiglu_packed
  CrossEntropyOptions loss;                    // cross_entropy, fused_linear_cross_entropy
};

class Program;
// Reverse mode over a Program (exec/autodiff.h).
Program grad(const Program& program, Value loss, const std::vector<Value>& wrt);

class Program {
 public:
  // An input of the program, bound by `name` when the program runs.
  Value define_tensor(std::string name, Shape shape, DType dtype);

  Value linear(Value x, Value weight, Value bias = {});
  Value matmul(Value a, Value b);
  Value add(Value a, Value b);
  Value rmsnorm(Value x, Value weight, double eps);
  // {y, r}.
  std::pair<Value, Value> fused_residual_add_rmsnorm(Value x, Value residual, Value weight,
                                                     double eps, double multiplier = 1.0);
  Value swiglu(Value gate, Value up);
  Value swiglu_packed(Value x, SwigluLayout layout = SwigluLayout::Halves);
  Value softmax(Value x, double logits_multiplier = 1.0);
  // loss_dtype: the logits' dtype when not given; f32 is allowed for 16-bit logits.
  Value cross_entropy(Value logits, Value labels, const CrossEntropyOptions& options = {},
                      std::optional<DType> loss_dtype = std::nullopt);
  Value fused_linear_cross_entropy(Value x, Value weight, Value bias, Value labels,
                                   const CrossEntropyOptions& options = {},
                                   std::optional<DType> loss_dtype = std::nullopt);

  // Marks a value as an output of the program, in the order the executor returns them; on a
  // mesh, `placements` (one per mesh dimension) says how it is wanted. A value may be marked
  // more than once (e.g. with two placements): each is its own tensor.
  void add_output(Value v, std::vector<Placement> placements = {});

  // The mesh the program runs on; placements set before stay and are checked against it.
  void set_mesh(DeviceMesh mesh);
  const std::optional<DeviceMesh>& mesh() const { return mesh_; }
  // How input `v` lies on the mesh: one placement per mesh dimension (needs set_mesh first).
  // Setting again replaces.
  void set_placements(Value v, std::vector<Placement> placements);
  // The placements set for input v; empty when none were.
  const std::vector<Placement>& placements(Value v) const;
  // The placements each output was added with (empty: as propagated), in outputs() order.
  const std::vector<std::vector<Placement>>& output_placements() const {
    return output_placements_;
  }

  // Whether v is one of this program's values.
  bool contains(Value v) const;
  // InvalidArgument unless contains(v).
  const ValueInfo& info(Value v) const;
  // v as errors and to_string() name it: "%1 'w' [16, 8] f32" (the name for inputs).
  std::string describe(Value v) const;
  const std::vector<ValueInfo>& values() const { return values_; }
  const std::vector<ProgramOp>& ops() const { return ops_; }
  const std::vector<Value>& inputs() const { return inputs_; }
  const std::vector<Value>& outputs() const { return outputs_; }

  // One line per input, op (its results, operands and options) and output, e.g.
  //   %0 'x' [4, 8] f32
  //   %1 'w' [16, 8] f32
  //   %2 [4, 16] f32 = linear(%0, %1, none)
  //   %3 [4, 16] f32 = rmsnorm(%2, none, eps=1e-05)
  //   output %3
  // and, on a mesh, a first line "mesh DeviceMesh([4], ranks [0, 1, 2, 3])" and each set
  // placement after its value ("%0 'x' [4, 8] f32 [Shard(0)]", "output %3 [Replicate()]").
  std::string to_string() const;

 private:
  friend Program grad(const Program& program, Value loss, const std::vector<Value>& wrt);

  std::vector<Placement> checked_placements(std::string_view op, Value v,
                                            std::vector<Placement> placements) const;
  // Appends `op` with a new value per result (shape, dtype), which become op.outputs.
  const ProgramOp& define(ProgramOp op, const std::vector<std::pair<Shape, DType>>& results);

  std::vector<ValueInfo> values_;
  std::vector<ProgramOp> ops_;
  std::vector<Value> inputs_, outputs_;
  std::optional<DeviceMesh> mesh_;
  std::vector<std::vector<Placement>> placements_;  // inputs' by value id; empty: not set
  std::vector<std::vector<Placement>> output_placements_;
};

}  // namespace meshfuse
