#include <cmath>
#include <limits>

#include "meshfuse/meshfuse.h"
#include "ops/softmax/softmax_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;

using test::expect_close;
using test::randn;

struct Result {
  Tensor y, grad_x;
};

Result run(const TensorView& x, const TensorView& dy, double m = 1.0) {
  Result r{Tensor(x.shape(), x.dtype()), Tensor(x.shape(), x.dtype())};
  softmax(x, r.y, m);
  softmax_backward(dy, r.y, r.grad_x, m);
  return r;
}

// The cpu backward runs on the reference forward's y, so the two backwards see the same input.
void expect_matches_reference(const TensorView& x, const TensorView& dy, double m = 1.0) {
  Result ref;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref = run(x, dy, m);
  }
  Tensor y(x.shape(), x.dtype()), grad_x(x.shape(), x.dtype());
  softmax(x, y, m);
  softmax_backward(dy, ref.y, grad_x, m);
  expect_close(y, ref.y, "y");
  expect_close(grad_x, ref.grad_x, "grad_x");
}

class SoftmaxTest : public ::testing::TestWithParam<DType> {};

TEST_P(SoftmaxTest, CpuMatchesReferenceAtWidthsAroundTheVectorSize) {
  for (std::int64_t cols : {1, 7, 16, 33, 1025, 3000}) {
    const Tensor x = randn({4, cols}, GetParam(), 1, 3.0), dy = randn({4, cols}, GetParam(), 2);
    expect_matches_reference(x, dy);
  }
}

TEST_P(SoftmaxTest, LogitsMultiplierScalesInputsAndGradients) {
  const Tensor x = randn({3, 2100}, GetParam(), 3, 4.0), dy = randn({3, 2100}, GetParam(), 4);
  for (double m : {0.5, -2.0, 0.0}) expect_matches_reference(x, dy, m);
}

TEST_P(SoftmaxTest, OneRowAndThreeDimensionalInputs) {
  const Tensor x = randn({1, 129}, GetParam(), 5), dy = randn({1, 129}, GetParam(), 6);
  expect_matches_reference(x, dy);
  const Tensor x3 = randn({2, 3, 17}, GetParam(), 7), dy3 = randn({2, 3, 17}, GetParam(), 8);
  expect_matches_reference(x3, dy3);
  const Tensor x1 = randn({40}, GetParam(), 9), dy1 = randn({40}, GetParam(), 10);
  expect_matches_reference(x1, dy1);
}

TEST_P(SoftmaxTest, ZeroRowsGiveEmptyOutputs) {
  const Tensor x({0, 16}, GetParam()), dy({0, 16}, GetParam());
  EXPECT_EQ(run(x, dy).y.shape(), (Shape{0, 16}));
}

TEST_P(SoftmaxTest, NonContiguousInputsGiveTheContiguousResult) {
  const Tensor x = randn({6, 40}, GetParam(), 11), dy = randn({6, 40}, GetParam(), 12);
  const auto xt = test::non_contiguous(x), dyt = test::non_contiguous(dy);
  const Result a = run(x, dy), b = run(xt.view, dyt.view);
  EXPECT_TRUE(testing::bitwise_equal(a.y, b.y));
  Tensor grad_x(x.shape(), x.dtype());
  softmax_backward(dyt.view, test::non_contiguous(a.y).view, grad_x);
  EXPECT_TRUE(testing::bitwise_equal(a.grad_x, grad_x));
}

TEST_P(SoftmaxTest, MinusInfRowsGiveNanAndNanOrPlusInfPoisonsItsRowOnly) {
  // Rows: all -inf; a NaN; a +inf; one -inf among finite values; finite (2000 wide, so the
  // special values sit at both ends and in the middle of a row).
  const double inf = std::numeric_limits<double>::infinity();
  Tensor x = randn({5, 2000}, GetParam(), 13);
  copy(test::full({1, 2000}, DType::F64, -inf), x.view().narrow(0, 0, 1));
  copy(test::full({1, 1}, DType::F64, NAN), x.view().narrow(0, 1, 1).narrow(1, 1500, 1));
  copy(test::full({1, 1}, DType::F64, inf), x.view().narrow(0, 2, 1).narrow(1, 1999, 1));
  copy(test::full({1, 1}, DType::F64, -inf), x.view().narrow(0, 3, 1).narrow(1, 0, 1));
  const Tensor dy = randn({5, 2000}, GetParam(), 14);
  const Result r = run(x, dy);
  const Tensor y = Tensor::copy_of(r.y), y64({5, 2000}, DType::F64);
  copy(y, y64);
  const double* v = y64.data_ptr<double>();
  for (std::int64_t row = 0; row < 3; ++row)
    for (std::int64_t c = 0; c < 2000; ++c) ASSERT_TRUE(std::isnan(v[row * 2000 + c])) << row;
  EXPECT_EQ(v[3 * 2000], 0.0);
  for (std::int64_t c = 1; c < 2000; ++c) ASSERT_TRUE(std::isfinite(v[3 * 2000 + c]));
  expect_matches_reference(x, dy);
}

TEST_P(SoftmaxTest, RowsReadAheadMatchTheReferenceWithNegativeAndSpecialValues) {
  // A thread takes each next row's max while it sums this row's exps (on 16-bit keys for bf16 and
  // f16 when m > 0): 130 rows give every thread several. Rows of negative values only, widths
  // around 32 lanes, and past row 0: all -inf (NaN), a negative NaN (NaN), all -0 (uniform), a
  // leading -inf, and zeros of both signs among negatives.
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t cols : {31, 32, 33, 100}) {
    Tensor x64 = randn({130, cols}, DType::F64, 17, 3.0);
    double* v = x64.data_ptr<double>();
    for (std::int64_t i = 0; i < 130 * cols; ++i) v[i] = -std::fabs(v[i]) - 2.0;
    for (std::int64_t c = 0; c < cols; ++c) {
      v[20 * cols + c] = -inf;
      v[22 * cols + c] = -0.0;
    }
    v[21 * cols + cols / 2] = -std::numeric_limits<double>::quiet_NaN();
    v[23 * cols] = -inf;
    v[24 * cols + 3] = 0.0;
    v[24 * cols + 5] = -0.0;
    Tensor x({130, cols}, GetParam());
    copy(x64, x);
    const Tensor dy = randn({130, cols}, GetParam(), 18);
    for (double m : {1.0, 0.5, -1.0}) expect_matches_reference(x, dy, m);
    const Tensor y64({130, cols}, DType::F64);
    copy(run(x, dy).y, y64);
    const double* y = y64.data_ptr<double>();
    for (std::int64_t c = 0; c < cols; ++c) {
      ASSERT_TRUE(std::isnan(y[20 * cols + c])) << cols;
      ASSERT_TRUE(std::isnan(y[21 * cols + c])) << cols;
      ASSERT_NEAR(y[22 * cols + c], 1.0 / static_cast<double>(cols),
                  1e-2 / static_cast<double>(cols));
    }
    EXPECT_EQ(y[23 * cols], 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, SoftmaxTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

TEST(Softmax, MatchesTorchOnKnownValues) {
  // torch.softmax(x * 0.5, -1) and its backward for dy, in float64.
  const Tensor x = from({2, 4}, DType::F64, {1, 2, 3, -1, 0.5, 0.5, -2, 10}),
               dy = from({2, 4}, DType::F64, {1, 0, -1, 2, 0.25, -0.5, 3, 1});
  const Tensor y = from({2, 4}, DType::F64,
                        {0.17437148764032928, 0.28748998067623538, 0.47399084625407806,
                         0.06414768542935739, 0.00848386615322327, 0.00848386615322327,
                         0.00243066834881827, 0.98060159934473512}),
               grad_x = from({2, 4}, DType::F64,
                             {0.10212275312682405, 0.02462696496453515, -0.19639242215722311,
                              0.06964270406586388, -0.00312109828937394, -0.00630254809683267,
                              0.00244795934824736, 0.00697568703795927});
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    const Result r = run(x, dy, 0.5);
    expect_close(r.y, y, 1e-14, "y");
    expect_close(r.grad_x, grad_x, 1e-14, "grad_x");
  }
}

TEST(Softmax, DeterministicRunToRun) {
  const Tensor x = randn({64, 3001}, DType::BF16, 15), dy = randn({64, 3001}, DType::BF16, 16);
  const Result a = run(x, dy), b = run(x, dy);
  EXPECT_TRUE(testing::bitwise_equal(a.y, b.y));
  EXPECT_TRUE(testing::bitwise_equal(a.grad_x, b.grad_x));
}

TEST(Softmax, RowOffsetsPast2To31AreExact) {
  // Row 70000 of a LLaMA-3 vocabulary (128256) starts at element 8'977'920'000 > 2^31.
  EXPECT_EQ(detail::row_offset(70000, 128256), std::int64_t{8'977'920'000});
  EXPECT_EQ(detail::row_offset(std::int64_t{1} << 32, 3), std::int64_t{3} << 32);
}

TEST(Softmax, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor x = randn({2, 8}, DType::F32, 1), y16({2, 8}, DType::BF16), y9({2, 9}, DType::F32),
               y({2, 8}, DType::F32);
  test::expect_error([&] { softmax(x, y16, 1.0); }, ErrorCode::DTypeMismatch,
                     {"softmax", "'y'", "f32", "bf16"});
  test::expect_error([&] { softmax(x, y9, 1.0); }, ErrorCode::ShapeMismatch,
                     {"softmax", "'y'", "[2, 8]", "[2, 9]"});
  const Tensor scalar({}, DType::F32);
  test::expect_error([&] { softmax(scalar, scalar, 1.0); }, ErrorCode::InvalidArgument,
                     {"softmax", "'x'", "0-d"});
  const Tensor labels = Tensor::zeros({2, 8}, DType::I64);
  test::expect_error([&] { softmax(labels, labels, 1.0); }, ErrorCode::DTypeMismatch,
                     {"softmax", "'x'", "i64"});
  test::expect_error([&] { softmax_backward(y9, y, x, 1.0); }, ErrorCode::ShapeMismatch,
                     {"softmax_backward", "'grad_y'", "[2, 8]", "[2, 9]"});
  Tensor wide({8, 2}, DType::F32);
  test::expect_error([&] { softmax(x, wide.view().transpose(0, 1), 1.0); },
                     ErrorCode::InvalidArgument, {"softmax", "'y'", "contiguous"});
}

}  // namespace
}  // namespace meshfuse
