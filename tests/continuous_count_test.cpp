// continuous_count on the CPU: torch.bincount on known values, the cpu backend against the
// reference, values out of range, the edges and the errors.
#include <gtest/gtest.h>

#include <limits>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::values;

const std::vector<KernelBackend> kBackends = {KernelBackend::Reference, KernelBackend::CPU};

// out filled with 7 first: every bin must be overwritten.
std::vector<double> count(const TensorView& x, std::int64_t bins) {
  Tensor out = test::full({bins}, DType::I64, 7);
  continuous_count(x, out);
  return values(out);
}

TEST(ContinuousCount, MatchesTorchBincountOnKnownValues) {
  for (KernelBackend backend : kBackends)
    for (DType dtype : {DType::I32, DType::I64}) {
      ForceKernelBackend force(backend);
      const Tensor x = from({13}, dtype, {3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 0, 7});
      // torch.bincount(x, minlength=10)
      EXPECT_EQ(count(x, 10), (std::vector<double>{2, 2, 1, 2, 1, 3, 1, 1, 0, 0}));
    }
}

TEST(ContinuousCount, ValuesOutsideTheBinsAreIgnored) {
  for (KernelBackend backend : kBackends) {
    ForceKernelBackend force(backend);
    const double i32_min = std::numeric_limits<std::int32_t>::min();
    const Tensor x32 = from({7}, DType::I32, {3, -1, 8, 9, i32_min, 0, 7});
    EXPECT_EQ(count(x32, 8), (std::vector<double>{1, 0, 0, 1, 0, 0, 0, 1}));
    // i64 values that wrap to in-range bins in 32 bits must not be counted.
    const Tensor x64 = from({5}, DType::I64, {4294967296.0 + 2, -4294967296.0, 2, -2, 5e9});
    EXPECT_EQ(count(x64, 4), (std::vector<double>{0, 0, 1, 0}));
  }
}

// 256k ids (several parts of the cpu backend), some out of range, over 8..256 bins and more bins
// than ids; and a strided x, counted as its contiguous copy.
TEST(ContinuousCount, CpuMatchesTheReferenceOnManyIds) {
  for (DType dtype : {DType::I32, DType::I64}) {
    Tensor x({1 << 18}, dtype);
    testing::fill_uniform_int(x, 1, -3, 260);
    for (std::int64_t bins : {8, 64, 256, 1 << 19}) {
      Tensor ref = Tensor::zeros({bins}, DType::I64), out = test::full({bins}, DType::I64, 7);
      {
        ForceKernelBackend force(KernelBackend::Reference);
        continuous_count(x, ref);
      }
      continuous_count(x, out);
      EXPECT_TRUE(testing::bitwise_equal(out, ref)) << bins << " bins";
    }
    const TensorView strided(x.view().data(), dtype, {1 << 17}, {2});
    Tensor a({64}, DType::I64), b({64}, DType::I64);
    continuous_count(strided, a);
    continuous_count(Tensor::copy_of(strided), b);
    EXPECT_TRUE(testing::bitwise_equal(a, b));
  }
}

TEST(ContinuousCount, EmptyInputCountsZeroAndZeroBinsIsFine) {
  for (KernelBackend backend : kBackends) {
    ForceKernelBackend force(backend);
    EXPECT_EQ(count(Tensor({0}, DType::I32), 3), (std::vector<double>{0, 0, 0}));
    EXPECT_EQ(count(from({2}, DType::I64, {0, 1}), 0), std::vector<double>{});
  }
}

TEST(ContinuousCount, BadArgumentsAreErrorsNamingTheArgument) {
  Tensor out({4}, DType::I64);
  test::expect_error([&] { continuous_count(Tensor({3}, DType::F32), out); },
                     ErrorCode::DTypeMismatch, {"continuous_count", "'x'", "i32 or i64", "f32"});
  test::expect_error(
      [&] {
        continuous_count(Tensor({2, 3}, DType::I32), out);
      },
      ErrorCode::InvalidArgument, {"'x'", "1 dimensions", "[2, 3]"});
  const Tensor x({3}, DType::I32);
  Tensor out32({4}, DType::I32), out2({2, 2}, DType::I64), wide({4, 2}, DType::I64);
  test::expect_error([&] { continuous_count(x, out32); }, ErrorCode::DTypeMismatch,
                     {"'out'", "i64", "i32"});
  test::expect_error([&] { continuous_count(x, out2); }, ErrorCode::InvalidArgument,
                     {"'out'", "1 dimensions"});
  const TensorView strided(wide.view().data(), DType::I64, {4}, {2});
  test::expect_error([&] { continuous_count(x, strided); }, ErrorCode::InvalidArgument,
                     {"'out' must be contiguous"});
}

}  // namespace
}  // namespace meshfuse
