// softmax on CUDA tensors against the reference backend on the CPU. Skipped without a GPU.
#include <cmath>
#include <limits>
#include <optional>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::to_cpu;
using test::to_cuda;

struct Result {
  Tensor y, grad_x;
};

// The reference on the CPU: y = softmax(x), grad_x = softmax_backward(dy, y).
Result reference(const TensorView& x, const TensorView& dy, double m) {
  ForceKernelBackend force(KernelBackend::Reference);
  Result r{Tensor(x.shape(), x.dtype()), Tensor(x.shape(), x.dtype())};
  softmax(x, r.y, m);
  softmax_backward(dy, r.y, r.grad_x, m);
  return r;
}

// The cuda forward on x, and the cuda backward on the reference's y (both see the same inputs).
void expect_matches_reference(const TensorView& x, const TensorView& dy, double m,
                              const std::string& what) {
  const Result ref = reference(x, dy, m);
  Tensor y(x.shape(), x.dtype(), kCuda), grad_x(x.shape(), x.dtype(), kCuda);
  softmax(to_cuda(x), y, m);
  softmax_backward(to_cuda(dy), to_cuda(ref.y), grad_x, m);
  test::expect_close(to_cpu(y), ref.y, what + " y");
  test::expect_close(to_cpu(grad_x), ref.grad_x, what + " grad_x");
}

class CudaSoftmaxTest : public ::testing::TestWithParam<DType> {};

TEST_P(CudaSoftmaxTest, MatchesTheReferenceFromOneColumnTo262144) {
  MESHFUSE_REQUIRE_CUDA();
  // Odd widths take the scalar path; 1000 and 4104 one block; 128256 (LLaMA-3) a cluster for
  // 16-bit rows; 262144 a cluster of 8 or, for the wide dtypes, the streamed kernels.
  for (const auto& [cols, rows] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 5}, {7, 5}, {33, 4}, {1000, 3}, {4104, 3}, {128256, 2}, {262144, 1}}) {
    const Tensor x = test::randn({rows, cols}, GetParam(), 1, 3.0),
                 dy = test::randn({rows, cols}, GetParam(), 2);
    expect_matches_reference(x, dy, 1.0, "V=" + std::to_string(cols));
  }
}

TEST(CudaSoftmax, ForwardClustersTakeSeveralRowsAtLargeBatches) {
  MESHFUSE_REQUIRE_CUDA();
  // Past as many rows as the GPU holds clusters at once, a forward cluster takes up to 4 rows in
  // turn, loading the next while it writes one. 8449 rows of 1000 (one-block clusters) and 401 of
  // 128256 (4-block clusters, 99 at a time on an H200) give 4 rows to some clusters and 3 to
  // others.
  for (const auto& [cols, rows] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{1000, 8449}, {128256, 401}}) {
    const Tensor x = test::randn({rows, cols}, DType::BF16, 15, 3.0),
                 dy = test::randn({rows, cols}, DType::BF16, 16);
    expect_matches_reference(x, dy, 1.0, "V=" + std::to_string(cols));
  }
}

TEST_P(CudaSoftmaxTest, LogitsMultiplierScalesInputsAndGradients) {
  MESHFUSE_REQUIRE_CUDA();
  for (std::int64_t cols : {7, 2048}) {
    const Tensor x = test::randn({3, cols}, GetParam(), 3, 4.0),
                 dy = test::randn({3, cols}, GetParam(), 4);
    for (double m : {0.5, -2.0, 0.0})
      expect_matches_reference(x, dy, m, "V=" + std::to_string(cols) + " m=" + std::to_string(m));
  }
}

TEST_P(CudaSoftmaxTest, MinusInfRowsGiveNanAndNanOrPlusInfPoisonsItsRowOnly) {
  MESHFUSE_REQUIRE_CUDA();
  // Rows: all -inf; a NaN; a +inf; one -inf among finite values; finite. 2000 columns (one
  // block, vectors), 2001 (the scalar streamed kernel) and 40000 (a cluster for 16-bit types).
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t v : {2000, 2001, 40000}) {
    Tensor x = test::randn({5, v}, GetParam(), 13);
    const auto set = [&](std::int64_t row, std::int64_t col, std::int64_t len, double value) {
      copy(test::full({1, len}, DType::F64, value), x.view().narrow(0, row, 1).narrow(1, col, len));
    };
    set(0, 0, v, -inf);
    set(1, v - 500, 1, NAN);
    set(2, v - 1, 1, inf);
    set(3, 0, 1, -inf);
    const Tensor dy = test::randn({5, v}, GetParam(), 14);
    Tensor y(x.shape(), x.dtype(), kCuda);
    softmax(to_cuda(x), y);
    const Tensor y64({5, v}, DType::F64);
    copy(to_cpu(y), y64);
    const double* p = y64.data_ptr<double>();
    for (std::int64_t row = 0; row < 3; ++row)
      for (std::int64_t c = 0; c < v; ++c)
        ASSERT_TRUE(std::isnan(p[row * v + c])) << v << " " << row;
    EXPECT_EQ(p[3 * v], 0.0);
    for (std::int64_t c = 1; c < v; ++c) ASSERT_TRUE(std::isfinite(p[3 * v + c])) << v;
    expect_matches_reference(x, dy, 1.0, "non-finite V=" + std::to_string(v));
  }
}

TEST_P(CudaSoftmaxTest, ThreeDimensionalAndMisalignedInputsMatchTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor x3 = test::randn({2, 3, 136}, GetParam(), 5),
               dy3 = test::randn({2, 3, 136}, GetParam(), 6);
  expect_matches_reference(x3, dy3, 1.0, "3-d");
  // A contiguous view one element into its buffer: rows are not 16-byte aligned.
  const Tensor x = test::randn({3, 1024}, GetParam(), 7),
               dy = test::randn({3, 1024}, GetParam(), 8);
  const Result ref = reference(x, dy, 1.0);
  Tensor xb({3 * 1024 + 1}, GetParam(), kCuda), yb({3 * 1024 + 1}, GetParam(), kCuda),
      gb({3 * 1024 + 1}, GetParam(), kCuda), dyb({3 * 1024 + 1}, GetParam(), kCuda);
  const auto shifted = [](const Tensor& t) {
    return t.view().narrow(0, 1, 3 * 1024).reshape({3, 1024});
  };
  copy(x, shifted(xb));
  copy(dy, shifted(dyb));
  copy(ref.y, shifted(yb));
  Tensor y(x.shape(), x.dtype(), kCuda);
  softmax(shifted(xb), y);
  softmax_backward(shifted(dyb), shifted(yb), shifted(gb));
  test::expect_close(to_cpu(y), ref.y, "misaligned y");
  test::expect_close(to_cpu(shifted(gb)), ref.grad_x, "misaligned grad_x");
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaSoftmaxTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

TEST(CudaSoftmax, ZeroRowsNonContiguousAndForcedReferenceOnCudaTensors) {
  MESHFUSE_REQUIRE_CUDA();
  Tensor empty_y({0, 8}, DType::BF16, kCuda);
  const Tensor empty = to_cuda(Tensor({0, 8}, DType::BF16));
  softmax(empty, empty_y);
  softmax_backward(empty, empty, empty_y);

  // A transposed view is copied to contiguous first: bitwise the contiguous result.
  const Tensor x = test::randn({24, 40}, DType::F32, 9), dy = test::randn({24, 40}, DType::F32, 10);
  const Tensor gx = to_cuda(x), gdy = to_cuda(dy);
  const Tensor xt = to_cuda(Tensor::copy_of(x.view().transpose(0, 1)));
  const Tensor dyt = to_cuda(Tensor::copy_of(dy.view().transpose(0, 1)));
  Tensor a(x.shape(), DType::F32, kCuda), b(x.shape(), DType::F32, kCuda);
  softmax(gx, a);
  softmax(xt.view().transpose(0, 1), b);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a), to_cpu(b)));
  Tensor ga(x.shape(), DType::F32, kCuda), gb(x.shape(), DType::F32, kCuda);
  softmax_backward(gdy, a, ga);
  softmax_backward(dyt.view().transpose(0, 1), a, gb);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga), to_cpu(gb)));

  // The reference forced on CUDA tensors runs on host copies: bitwise the CPU reference.
  const Result ref = reference(x, dy, 0.5);
  Tensor ry(x.shape(), DType::F32, kCuda), rg(x.shape(), DType::F32, kCuda);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    softmax(gx, ry, 0.5);
    softmax_backward(gdy, ry, rg, 0.5);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ry), ref.y));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(rg), ref.grad_x));
}

TEST(CudaSoftmax, DeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  for (std::int64_t cols : {3001, 128256}) {
    const Tensor x = to_cuda(test::randn({16, cols}, DType::BF16, 11), stream),
                 dy = to_cuda(test::randn({16, cols}, DType::BF16, 12), stream);
    Tensor y1(x.shape(), DType::BF16, kCuda, stream), y2(x.shape(), DType::BF16, kCuda, stream),
        g1(x.shape(), DType::BF16, kCuda, stream), g2(x.shape(), DType::BF16, kCuda, stream);
    softmax(x, y1, 1.0, stream);
    softmax(x, y2, 1.0, stream);
    softmax_backward(dy, y1, g1, 1.0, stream);
    softmax_backward(dy, y1, g2, 1.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(y1, stream), to_cpu(y2, stream))) << cols;
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(g1, stream), to_cpu(g2, stream))) << cols;
  }
}

TEST(CudaSoftmax, RowsPastElement2To31AreAddressedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  // 16745 LLaMA-3 rows: the last starts at element 2'147'518'464 > 2^31. Only the last row is
  // given values (the others hold whatever the allocator had) and checked.
  const std::int64_t rows = 16745, cols = 128256;
  std::optional<Tensor> x, y, grad_x;
  try {
    x.emplace(Shape{rows, cols}, DType::BF16, kCuda);
    y.emplace(Shape{rows, cols}, DType::BF16, kCuda);
    grad_x.emplace(Shape{rows, cols}, DType::BF16, kCuda);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::OutOfMemory) GTEST_SKIP() << "needs 13 GB of device memory";
    throw;
  }
  const Tensor last = test::randn({1, cols}, DType::BF16, 13, 3.0),
               dy_last = test::randn({1, cols}, DType::BF16, 14);
  const auto last_row = [&](const Tensor& t) { return t.view().narrow(0, rows - 1, 1); };
  copy(last, last_row(*x));
  softmax(*x, *y);
  // The backward reads grad_y from x's buffer: its last row holds dy.
  copy(dy_last, last_row(*x));
  softmax_backward(*x, *y, *grad_x);
  const Result ref = reference(last, dy_last, 1.0);
  test::expect_close(to_cpu(last_row(*y)), ref.y, "y");
  Tensor ref_grad(last.shape(), DType::BF16);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    softmax_backward(dy_last, to_cpu(last_row(*y)), ref_grad);
  }
  test::expect_close(to_cpu(last_row(*grad_x)), ref_grad, "grad_x");
}

}  // namespace
}  // namespace meshfuse
