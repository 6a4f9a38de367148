// continuous_count on every backend: torch.bincount on known values, the cpu and cuda backends
// against the reference, values out of range, the edges and the errors. CUDA cases skip without a
// GPU.
#include <gtest/gtest.h>

#include <limits>
#include <optional>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::on;
using test::to_cpu;
using test::values;

const std::vector<DType> kIdDTypes = {DType::I32, DType::I64};

// Counts of x (on any device) into an output on x's device holding 7s first (every bin must be
// overwritten), brought back to the CPU.
Tensor counts(const TensorView& x, std::int64_t bins, const Stream& stream) {
  Tensor out = on(test::full({bins}, DType::I64, 7), x.device(), stream);
  continuous_count(x, out, stream);
  return to_cpu(out, stream);
}

Tensor reference_counts(const TensorView& x, std::int64_t bins) {
  ForceKernelBackend force(KernelBackend::Reference);
  return counts(x, bins, {});
}

// The counts of the CPU ids x on the target.
std::vector<double> count_on(const test::Target& target, const Tensor& x, std::int64_t bins) {
  const Stream stream{target.device};
  const Tensor dev_x = on(x, target.device, stream);
  ForceKernelBackend force(target.backend);
  return values(counts(dev_x, bins, stream));
}

// Every backend, the reference included (on the CPU and on CUDA tensors through host copies).
class ContinuousCountEveryBackend : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(ContinuousCountEveryBackend, MatchesTorchBincountOnKnownValues) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Tensor x = from({13}, dtype, {3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 0, 7});
  // torch.bincount(x, minlength=10)
  EXPECT_EQ(count_on(target, x, 10), (std::vector<double>{2, 2, 1, 2, 1, 3, 1, 1, 0, 0}));
}

TEST_P(ContinuousCountEveryBackend, EmptyInputCountsZeroAndZeroBinsIsFine) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  EXPECT_EQ(count_on(target, Tensor({0}, dtype), 3), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(count_on(target, from({2}, dtype, {0, 1}), 0), std::vector<double>{});
}

// A strided x is counted as its contiguous copy.
TEST_P(ContinuousCountEveryBackend, StridedInputCountsAsItsContiguousCopy) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const struct { std::int64_t ids, bins, high; } cases[] = {{1 << 18, 64, 260}, {4001, 16, 16}};
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.ids << " ids, " << c.bins << " bins");
    Tensor x({c.ids}, dtype);
    testing::fill_uniform_int(x, 3, -3, c.high);
    const Tensor dev_x = on(x, target.device, stream);
    const TensorView strided(dev_x.view().data(), dtype, {(c.ids + 1) / 2}, {2}, target.device);
    const Tensor expected = reference_counts(
        Tensor::copy_of(TensorView(x.view().data(), dtype, strided.shape(), {2})), c.bins);
    ForceKernelBackend force(target.backend);
    EXPECT_TRUE(testing::bitwise_equal(counts(strided, c.bins, stream), expected));
  }
}

INSTANTIATE_TEST_SUITE_P(, ContinuousCountEveryBackend,
                         ::testing::ValuesIn(test::op_cases(test::all_targets(), kIdDTypes)),
                         test::op_case_name);

class ContinuousCountTargets : public ::testing::TestWithParam<test::Target> {};

TEST_P(ContinuousCountTargets, ValuesOutsideTheBinsAreIgnored) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const double i32_min = std::numeric_limits<std::int32_t>::min();
  const Tensor x32 = from({7}, DType::I32, {3, -1, 8, 9, i32_min, 0, 7});
  EXPECT_EQ(count_on(target, x32, 8), (std::vector<double>{1, 0, 0, 1, 0, 0, 0, 1}));
  // i64 values that wrap to in-range bins in 32 bits must not be counted.
  const Tensor x64 = from({5}, DType::I64, {4294967296.0 + 2, -4294967296.0, 2, -2, 5e9});
  EXPECT_EQ(count_on(target, x64, 4), (std::vector<double>{0, 0, 1, 0}));
}

INSTANTIATE_TEST_SUITE_P(, ContinuousCountTargets, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

// The optimised backends (cpu, cuda) against the reference on the CPU.
class ContinuousCountBackends : public ::testing::TestWithParam<test::OpCase> {};

// 256k ids (several parts of the cpu backend) in [-3, 260) over 8..256 bins and more bins than
// ids; 1M ids, some out of range, over bin counts around each of the CUDA kernel's regimes: one
// shared histogram per warp (up to 1536 bins), fewer copies, one per block (12288), none (global
// atomics).
TEST_P(ContinuousCountBackends, MatchesTheReferenceFromOneBinToHistogramsPastSharedMemory) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  struct Case {
    std::int64_t ids, bins, high;
  };
  std::vector<Case> cases;
  for (std::int64_t bins : {8, 64, 256, 1 << 19}) cases.push_back({1 << 18, bins, 260});
  for (std::int64_t bins : {1, 8, 64, 256, 1536, 2000, 12288, 12289, 100000})
    cases.push_back({(1 << 20) + 3, bins, bins + 5});
  const Stream stream{target.device};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.ids << " ids, " << c.bins << " bins");
    Tensor x({c.ids}, dtype);
    testing::fill_uniform_int(x, static_cast<std::uint64_t>(c.bins), -3, c.high);
    const Tensor dev_x = on(x, target.device, stream);
    ForceKernelBackend force(target.backend);
    EXPECT_TRUE(testing::bitwise_equal(counts(dev_x, c.bins, stream), reference_counts(x, c.bins)));
  }
}

TEST_P(ContinuousCountBackends, DeterministicRunToRun) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking, as in training); declared before the tensors that
  // it must outlive.
  std::optional<CudaStream> cuda_stream;
  if (target.device.type == DeviceType::CUDA) cuda_stream.emplace(target.device.index);
  const Stream stream = cuda_stream ? cuda_stream->stream() : Stream{target.device};
  Tensor x({16 * 4096 * 8}, dtype);
  testing::fill_uniform_int(x, 4, 0, 64);
  const Tensor dev_x = on(x, target.device, stream);
  ForceKernelBackend force(target.backend);
  EXPECT_TRUE(testing::bitwise_equal(counts(dev_x, 64, stream), counts(dev_x, 64, stream)));
}

INSTANTIATE_TEST_SUITE_P(, ContinuousCountBackends,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets(), kIdDTypes)),
                         test::op_case_name);

TEST(ContinuousCount, BadArgumentsAreErrorsNamingTheArgument) {
  Tensor out({4}, DType::I64);
  test::expect_error([&] { continuous_count(Tensor({3}, DType::F32), out); },
                     ErrorCode::DTypeMismatch, {"continuous_count", "'x'", "i32 or i64", "f32"});
  test::expect_error(
      [&] {
        continuous_count(Tensor({2, 3}, DType::I32), out);
      },
      ErrorCode::InvalidArgument, {"'x'", "1 dimension,", "[2, 3]"});
  const Tensor x({3}, DType::I32);
  Tensor out32({4}, DType::I32), out2({2, 2}, DType::I64), wide({4, 2}, DType::I64);
  test::expect_error([&] { continuous_count(x, out32); }, ErrorCode::DTypeMismatch,
                     {"'out'", "i64", "i32"});
  test::expect_error([&] { continuous_count(x, out2); }, ErrorCode::InvalidArgument,
                     {"'out'", "1 dimension,"});
  const TensorView strided(wide.view().data(), DType::I64, {4}, {2});
  test::expect_error([&] { continuous_count(x, strided); }, ErrorCode::InvalidArgument,
                     {"'out' must be contiguous"});
}

// 2^31 + 5 i32 values (8 GiB): indices and counts past 2^31.
TEST(CudaContinuousCount, MoreThan2To31ValuesAreIndexedAndCountedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  const std::int64_t n = (std::int64_t{1} << 31) + 5;
  std::optional<Tensor> x;
  try {
    x.emplace(Tensor::zeros({n}, DType::I32, test::kCuda, stream));
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  copy(from({3}, DType::I32, {1, 2, 1}), x->view().narrow(0, n - 3, 3), stream);
  EXPECT_EQ(values(counts(*x, 3, stream)), (std::vector<double>{static_cast<double>(n - 3), 2, 1}));
}

}  // namespace
}  // namespace meshfuse
