#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::randn;

struct Grads {
  Tensor out, grad_gate, grad_up;
};

Grads run(const TensorView& gate, const TensorView& up, const TensorView& dy) {
  Grads g{Tensor(gate.shape(), gate.dtype()), Tensor(gate.shape(), gate.dtype()),
          Tensor(gate.shape(), gate.dtype())};
  swiglu(gate, up, g.out);
  swiglu_backward(dy, gate, up, g.grad_gate, g.grad_up);
  return g;
}

Grads run_reference(const TensorView& gate, const TensorView& up, const TensorView& dy) {
  ForceKernelBackend force(KernelBackend::Reference);
  return run(gate, up, dy);
}

void expect_matches_reference(const TensorView& gate, const TensorView& up,
                              const TensorView& dy) {
  const Grads cpu = run(gate, up, dy), ref = run_reference(gate, up, dy);
  expect_close(cpu.out, ref.out, "out");
  expect_close(cpu.grad_gate, ref.grad_gate, "grad_gate");
  expect_close(cpu.grad_up, ref.grad_up, "grad_up");
}

class SwigluTest : public ::testing::TestWithParam<DType> {};

TEST_P(SwigluTest, CpuMatchesReferenceAtOddWidths) {
  for (std::int64_t cols : {1, 7, 33, 1000}) {
    const Tensor g = randn({5, cols}, GetParam(), 1, 3.0), u = randn({5, cols}, GetParam(), 2),
                 dy = randn({5, cols}, GetParam(), 3);
    expect_matches_reference(g, u, dy);
  }
}

TEST_P(SwigluTest, OneRowAndThreeDimensionalInputs) {
  const Tensor g = randn({1, 129}, GetParam(), 4), u = randn({1, 129}, GetParam(), 5),
               dy = randn({1, 129}, GetParam(), 6);
  expect_matches_reference(g, u, dy);
  const Tensor g3 = randn({2, 3, 17}, GetParam(), 7), u3 = randn({2, 3, 17}, GetParam(), 8),
               dy3 = randn({2, 3, 17}, GetParam(), 9);
  expect_matches_reference(g3, u3, dy3);
}

TEST_P(SwigluTest, ZeroRowsGiveEmptyOutputs) {
  const Tensor g({0, 16}, GetParam()), u({0, 16}, GetParam()), dy({0, 16}, GetParam());
  const Grads r = run(g, u, dy);
  EXPECT_EQ(r.out.shape(), (Shape{0, 16}));
}

TEST_P(SwigluTest, NonContiguousInputsGiveTheContiguousResult) {
  const Tensor g = randn({6, 40}, GetParam(), 10), u = randn({6, 40}, GetParam(), 11),
               dy = randn({6, 40}, GetParam(), 12);
  const auto gt = test::non_contiguous(g), ut = test::non_contiguous(u),
             dyt = test::non_contiguous(dy);
  const Grads a = run(g, u, dy), b = run(gt.view, ut.view, dyt.view);
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out));
  EXPECT_TRUE(testing::bitwise_equal(a.grad_gate, b.grad_gate));
  EXPECT_TRUE(testing::bitwise_equal(a.grad_up, b.grad_up));
}

TEST_P(SwigluTest, PackedLayoutsEqualSeparateGateAndUp) {
  const std::int64_t rows = 3, cols = 21;
  const Tensor g = randn({rows, cols}, GetParam(), 13), u = randn({rows, cols}, GetParam(), 14),
               dy = randn({rows, cols}, GetParam(), 15);
  const Grads expected = run(g, u, dy);
  for (SwigluLayout layout : {SwigluLayout::Halves, SwigluLayout::Interleaved}) {
    Tensor x({rows, 2 * cols}, GetParam());
    const bool halves = layout == SwigluLayout::Halves;
    for (std::int64_t c = 0; c < cols; ++c) {  // pack column by column as the layout says
      copy(g.view().narrow(1, c, 1), x.view().narrow(1, halves ? c : 2 * c, 1));
      copy(u.view().narrow(1, c, 1), x.view().narrow(1, halves ? cols + c : 2 * c + 1, 1));
    }
    Tensor out({rows, cols}, GetParam()), grad_x({rows, 2 * cols}, GetParam());
    swiglu_packed(x, layout, out);
    swiglu_packed_backward(dy, x, layout, grad_x);
    EXPECT_TRUE(testing::bitwise_equal(out, expected.out));
    for (std::int64_t c = 0; c < cols; ++c) {
      EXPECT_TRUE(testing::bitwise_equal(grad_x.view().narrow(1, halves ? c : 2 * c, 1),
                                         expected.grad_gate.view().narrow(1, c, 1)));
      EXPECT_TRUE(testing::bitwise_equal(
          grad_x.view().narrow(1, halves ? cols + c : 2 * c + 1, 1),
          expected.grad_up.view().narrow(1, c, 1)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, SwigluTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

TEST(Swiglu, MatchesTorchSiluTimesUpOnKnownValues) {
  // torch.nn.functional.silu(g) * u for g = [0, 1, -2, 20], u = [3, 2, 1, 0.5].
  Tensor g({4}, DType::F64), u({4}, DType::F64), out({4}, DType::F64);
  const double gv[] = {0, 1, -2, 20}, uv[] = {3, 2, 1, 0.5};
  std::copy(gv, gv + 4, g.data_ptr<double>());
  std::copy(uv, uv + 4, u.data_ptr<double>());
  swiglu(g, u, out);
  const double expected[] = {0.0, 2 * 0.7310585786300049, -0.2384058440442351,
                             0.5 * 19.999999958776925};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out.data_ptr<double>()[i], expected[i], 1e-12);
}

TEST(Swiglu, NanAndInfPropagateLikeTorch) {
  const float inf = std::numeric_limits<float>::infinity();
  Tensor g({4}, DType::F32), u({4}, DType::F32), out({4}, DType::F32), ref({4}, DType::F32);
  const float gv[] = {std::nanf(""), inf, -inf, 1.0f}, uv[] = {1.0f, 1.0f, 1.0f, inf};
  std::copy(gv, gv + 4, g.data_ptr<float>());
  std::copy(uv, uv + 4, u.data_ptr<float>());
  swiglu(g, u, out);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    swiglu(g, u, ref);
  }
  // torch.nn.functional.silu gives nan, inf, nan (-inf / inf) for nan, inf, -inf; silu(1)*inf = inf.
  const float* o = out.data_ptr<float>();
  EXPECT_TRUE(std::isnan(o[0]));
  EXPECT_EQ(o[1], inf);
  EXPECT_TRUE(std::isnan(o[2]));
  EXPECT_EQ(o[3], inf);
  expect_close(out, ref, "non-finite");
}

// The cpu backend takes silu and its derivative of a 16-bit gate from tables of their 65536
// values: every one of them, times up = 1 and times random up (and dy), within one ulp of the
// type of the reference (which rounds once from double; one subnormal step near zero), NaN where
// the reference gives NaN; the interleaved layout (strided loops) gives the same bits.
TEST(Swiglu, EverySixteenBitGateValueMatchesTheReference) {
  constexpr std::int64_t kRows = 2, kCols = 32768;
  for (const DType dtype : {DType::BF16, DType::F16}) {
    Tensor g({kRows, kCols}, dtype);
    auto* bits = static_cast<std::uint16_t*>(g.view().data());
    for (std::uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<std::uint16_t>(i);
    const bool bf16 = dtype == DType::BF16;
    const double ulp = bf16 ? 0x1p-7 : 0x1p-10, smallest = bf16 ? 0x1p-133 : 0x1p-24;
    const Tensor dy = randn({kRows, kCols}, dtype, 20);
    for (const Tensor& u :
         {test::full({kRows, kCols}, dtype, 1.0), randn({kRows, kCols}, dtype, 19)}) {
      const Grads cpu = run(g, u, dy), ref = run_reference(g, u, dy);
      const std::string what = std::string(to_string(dtype)) + " every gate value: ";
      for (const auto& [name, a, e] : {std::tuple{"out", &cpu.out, &ref.out},
                                       std::tuple{"grad_gate", &cpu.grad_gate, &ref.grad_gate},
                                       std::tuple{"grad_up", &cpu.grad_up, &ref.grad_up}}) {
        const testing::Diff d = testing::compare(*a, *e, smallest, ulp);
        EXPECT_EQ(d.violations, 0) << what << name << ": max rel err " << d.max_rel_err
                                   << ", non-finite mismatches " << d.mismatched_nonfinite;
      }
      Tensor x({kRows, 2 * kCols}, dtype), out({kRows, kCols}, dtype),
          grad_x({kRows, 2 * kCols}, dtype);
      // The even (gate) or odd (up) columns of an interleaved (kRows, 2 kCols) tensor.
      const auto columns = [&](const Tensor& t, std::int64_t parity) {
        return TensorView(static_cast<char*>(t.view().data()) + parity * element_size(dtype), dtype,
                          {kRows, kCols}, {2 * kCols, 2});
      };
      copy(g, columns(x, 0));
      copy(u, columns(x, 1));
      swiglu_packed(x, SwigluLayout::Interleaved, out);
      swiglu_packed_backward(dy, x, SwigluLayout::Interleaved, grad_x);
      EXPECT_TRUE(testing::bitwise_equal(out, cpu.out)) << what << "interleaved out";
      EXPECT_TRUE(testing::bitwise_equal(columns(grad_x, 0), cpu.grad_gate))
          << what << "interleaved grad_gate";
      EXPECT_TRUE(testing::bitwise_equal(columns(grad_x, 1), cpu.grad_up))
          << what << "interleaved grad_up";
    }
  }
}

TEST(Swiglu, DeterministicRunToRun) {
  const Tensor g = randn({64, 513}, DType::BF16, 16), u = randn({64, 513}, DType::BF16, 17),
               dy = randn({64, 513}, DType::BF16, 18);
  const Grads a = run(g, u, dy), b = run(g, u, dy);
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out));
  EXPECT_TRUE(testing::bitwise_equal(a.grad_gate, b.grad_gate));
}

TEST(Swiglu, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor g = randn({2, 8}, DType::F32, 1), u16 = randn({2, 8}, DType::BF16, 2),
               u9 = randn({2, 9}, DType::F32, 3), out({2, 8}, DType::F32);
  test::expect_error([&] { swiglu(g, u16, out); }, ErrorCode::DTypeMismatch,
                     {"swiglu", "'up'", "f32", "bf16"});
  test::expect_error([&] { swiglu(g, u9, out); }, ErrorCode::ShapeMismatch,
                     {"swiglu", "'up'", "[2, 8]", "[2, 9]"});
  const Tensor odd = randn({2, 7}, DType::F32, 4);
  Tensor out3({2, 3}, DType::F32);
  test::expect_error([&] { swiglu_packed(odd, SwigluLayout::Halves, out3); },
                     ErrorCode::InvalidArgument, {"swiglu_packed", "even", "7"});
  const Tensor labels = Tensor::zeros({2, 8}, DType::I64);
  test::expect_error([&] { swiglu(labels, labels, out); }, ErrorCode::DTypeMismatch,
                     {"swiglu", "'gate'", "i64"});
  Tensor wide({8, 2}, DType::F32);
  test::expect_error([&] { swiglu(g, g, wide.view().transpose(0, 1)); },
                     ErrorCode::InvalidArgument, {"swiglu", "'out'", "contiguous"});
}

}  // namespace
}  // namespace meshfuse
