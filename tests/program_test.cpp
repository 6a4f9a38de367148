// Program: the builder's shapes, dtypes and errors, and the text form.
#include <string>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_error;

// llama-3.2-1b's MLP block and head at 8 tokens (H 2048, I 8192, V 128256): the values a
// tensor-parallel plan starts from.
struct Block {
  Program p;
  Value x, norm_weight, gate_weight, up_weight, down_weight, head_weight, labels;
  Value y, loss;
};

Block llama_block(DType dtype) {
  Block b;
  Program& p = b.p;
  b.x = p.define_tensor("x", {8, 2048}, dtype);
  b.norm_weight = p.define_tensor("norm_weight", {2048}, dtype);
  b.gate_weight = p.define_tensor("gate_weight", {8192, 2048}, dtype);
  b.up_weight = p.define_tensor("up_weight", {8192, 2048}, dtype);
  b.down_weight = p.define_tensor("down_weight", {2048, 8192}, dtype);
  b.head_weight = p.define_tensor("head_weight", {128256, 2048}, dtype);
  b.labels = p.define_tensor("labels", {8}, DType::I64);
  const Value h = p.rmsnorm(b.x, b.norm_weight, 1e-5);
  const Value a = p.swiglu(p.linear(h, b.gate_weight), p.linear(h, b.up_weight));
  b.y = p.add(b.x, p.linear(a, b.down_weight));
  b.loss =
      p.fused_linear_cross_entropy(b.y, b.head_weight, {}, b.labels, {},
                                   dtype == DType::F32 ? std::nullopt : std::optional(DType::F32));
  p.add_output(b.y);
  p.add_output(b.loss);
  return b;
}

TEST(Program, TheMlpBlockAndHeadHaveTheShapesAndDtypesOfTheirOps) {
  const Block b = llama_block(DType::BF16);
  const Program& p = b.p;
  EXPECT_EQ(p.inputs().size(), 7u);
  ASSERT_EQ(p.ops().size(), 7u);
  EXPECT_EQ(p.info(b.y).shape, (Shape{8, 2048}));
  EXPECT_EQ(p.info(b.y).dtype, DType::BF16);
  EXPECT_EQ(p.info(b.loss).shape, Shape{});
  EXPECT_EQ(p.info(b.loss).dtype, DType::F32);
  // SSA in definition order: every operand is defined before the op that takes it.
  for (std::size_t i = 0; i < p.ops().size(); ++i)
    for (Value in : p.ops()[i].inputs)
      if (in.defined()) {
        EXPECT_LT(p.info(in).producer, static_cast<std::int64_t>(i));
      }
  EXPECT_EQ(p.ops()[1].type, OpType::Linear);
  EXPECT_EQ(p.info(p.ops()[1].outputs[0]).shape, (Shape{8, 8192}));
  EXPECT_EQ(p.outputs(), (std::vector<Value>{b.y, b.loss}));
}

TEST(Program, PrintsEveryInputOpWithItsOptionsAndOutput) {
  Program p;
  const Value x = p.define_tensor("x", {4, 8}, DType::F32);
  const Value w = p.define_tensor("w", {16, 8}, DType::F32);
  const Value labels = p.define_tensor("labels", {4}, DType::I32);
  const Value h = p.rmsnorm(p.linear(x, w), {}, 1e-5);
  const auto [y, r] = p.fused_residual_add_rmsnorm(h, h, {}, 1e-6, 0.5);
  const Value loss = p.cross_entropy(p.softmax(y, 2.0), labels,
                                     {.reduction = Reduction::None,
                                      .label_smoothing = 0.1,
                                      .label_check = LabelCheck::DeviceAssert});
  p.add_output(loss);
  p.add_output(r);
  EXPECT_EQ(p.to_string(),
            "%0 'x' [4, 8] f32\n"
            "%1 'w' [16, 8] f32\n"
            "%2 'labels' [4] i32\n"
            "%3 [4, 16] f32 = linear(%0, %1, none)\n"
            "%4 [4, 16] f32, %5 [4] f32 = rmsnorm(%3, none, eps=1e-05)\n"
            "%6 [4, 16] f32, %7 [4, 16] f32, %8 [4] f32 = fused_residual_add_rmsnorm(%4, %4, "
            "none, eps=1e-06, multiplier=0.5)\n"
            "%9 [4, 16] f32 = softmax(%6, logits_multiplier=2)\n"
            "%10 [4] f32, %11 [4] f64 = cross_entropy(%9, %2, reduction=none, "
            "ignore_index=-100, label_smoothing=0.1, label_check=device_assert)\n"
            "output %10\n"
            "output %7\n");
}

TEST(Program, MatmulTakesMatricesOrBatchesAndSwigluPackedHalvesTheWidth) {
  Program p;
  const Value a = p.define_tensor("a", {3, 5, 7}, DType::F16);
  const Value b = p.define_tensor("b", {3, 7, 2}, DType::F16);
  EXPECT_EQ(p.info(p.matmul(a, b)).shape, (Shape{3, 5, 2}));
  const Value m = p.define_tensor("m", {5, 7}, DType::F16);
  const Value n = p.define_tensor("n", {7, 4}, DType::F16);
  EXPECT_EQ(p.info(p.matmul(m, n)).shape, (Shape{5, 4}));
  const Value packed = p.define_tensor("packed", {2, 6, 10}, DType::F16);
  const Value out = p.swiglu_packed(packed, SwigluLayout::Interleaved);
  EXPECT_EQ(p.info(out).shape, (Shape{2, 6, 5}));
  EXPECT_EQ(p.ops().back().layout, SwigluLayout::Interleaved);
}

TEST(Program, EachOpNamesItselfTheArgumentAndTheValueInItsErrors) {
  Program p;
  const Value x = p.define_tensor("x", {4, 8}, DType::F32);
  const Value w = p.define_tensor("w", {16, 9}, DType::F32);
  const Value h = p.define_tensor("h", {4, 8}, DType::BF16);
  const Value labels = p.define_tensor("labels", {4}, DType::F32);
  expect_error([&] { p.linear(x, w); }, ErrorCode::ShapeMismatch,
               {"Program.linear", "'weight'", "%1 'w' [16, 9] f32", "[16, 8]", "(N, K)"});
  expect_error([&] { p.add(x, h); }, ErrorCode::DTypeMismatch,
               {"Program.add", "'b'", "%2 'h'", "dtype of 'a' (f32)"});
  expect_error(
      [&] {
        p.add(x, p.define_tensor("x2", {4, 9}, DType::F32));
      },
      ErrorCode::ShapeMismatch, {"Program.add", "'b'", "[4, 8]", "does not broadcast"});
  expect_error([&] { p.matmul(x, x); }, ErrorCode::ShapeMismatch,
               {"Program.matmul", "'b'", "[8, 8]"});
  const Value ints = p.define_tensor("ints", {4, 8}, DType::I32);
  expect_error([&] { p.rmsnorm(ints, {}, 1e-5); }, ErrorCode::DTypeMismatch,
               {"Program.rmsnorm", "'x'", "%5 'ints'", "f32, f64, bf16 or f16"});
  expect_error([&] { p.rmsnorm(x, x, 1e-5); }, ErrorCode::InvalidArgument,
               {"Program.rmsnorm", "'weight'", "1 dimension,", "got 2"});
  expect_error([&] { p.rmsnorm(x, {}, -1); }, ErrorCode::InvalidArgument, {"eps", "-1"});
  expect_error(
      [&] {
        p.swiglu_packed(p.define_tensor("odd", {4, 7}, DType::F32));
      },
      ErrorCode::InvalidArgument, {"Program.swiglu_packed", "even"});
  expect_error([&] { p.cross_entropy(x, labels); }, ErrorCode::DTypeMismatch,
               {"Program.cross_entropy", "'labels'", "i32 or i64"});
  const Value y = p.define_tensor("y", {5}, DType::I64);
  expect_error([&] { p.cross_entropy(x, y); }, ErrorCode::ShapeMismatch,
               {"Program.cross_entropy", "'labels'", "[4]", "one label per row"});
  const Value l4 = p.define_tensor("l4", {4}, DType::I64);
  expect_error([&] { p.cross_entropy(x, l4, {}, DType::F64); }, ErrorCode::DTypeMismatch,
               {"loss_dtype", "'logits' (f32)", "got f64"});
  expect_error([&] { p.cross_entropy(h, l4, {.label_smoothing = 2}); }, ErrorCode::InvalidArgument,
               {"label_smoothing", "2"});
  // Set by the lowering on a vocabulary shard; set here they made every rank's loss a shard's.
  const CrossEntropyOptions shard{.vocab_start = 4, .vocab_size = 16};
  const Value head = p.define_tensor("head", {16, 8}, DType::BF16);
  expect_error([&] { p.cross_entropy(h, l4, shard); }, ErrorCode::InvalidArgument,
               {"Program.cross_entropy", "vocab_start and vocab_size must be 0", "got 4 and 16"});
  expect_error([&] { p.fused_linear_cross_entropy(h, head, {}, l4, shard); },
               ErrorCode::InvalidArgument,
               {"Program.fused_linear_cross_entropy", "vocab_start and vocab_size must be 0"});
  expect_error([&] { p.fused_linear_cross_entropy(x, w, {}, l4); }, ErrorCode::ShapeMismatch,
               {"Program.fused_linear_cross_entropy", "'weight'", "(V, H)"});
  // A failed call leaves the program as it was.
  EXPECT_EQ(p.ops().size(), 0u);
  EXPECT_EQ(p.info(p.cross_entropy(h, l4, {}, DType::F32)).dtype, DType::F32);
}

TEST(Program, ValuesOfAnotherProgramInputNamesAndOutputsAreChecked) {
  Program p, other;
  const Value x = p.define_tensor("x", {2, 3}, DType::F32);
  other.define_tensor("a", {2, 3}, DType::F32);
  const Value foreign = other.define_tensor("b", {2, 3}, DType::F32);
  expect_error([&] { p.add(x, foreign); }, ErrorCode::InvalidArgument,
               {"Program.add", "'b'", "a value of this program", "%1"});
  expect_error([&] { p.softmax(Value{}); }, ErrorCode::InvalidArgument,
               {"Program.softmax", "'x'", "%-1"});
  expect_error([&] { p.define_tensor("x", {1}, DType::F32); }, ErrorCode::InvalidArgument,
               {"'x' is already an input", "%0 'x' [2, 3] f32"});
  expect_error([&] { p.define_tensor("", {1}, DType::F32); }, ErrorCode::InvalidArgument, {"name"});
  expect_error(
      [&] {
        p.define_tensor("neg", {2, -1}, DType::F32);
      },
      ErrorCode::InvalidArgument, {"'neg'", "[2, -1]"});
  p.add_output(x);
  p.add_output(x);  // a value may be an output twice (e.g. with two placements)
  EXPECT_EQ(p.outputs().size(), 2u);
  expect_error([&] { p.info(Value{9}); }, ErrorCode::InvalidArgument, {"%9"});
}

}  // namespace
}  // namespace meshfuse
