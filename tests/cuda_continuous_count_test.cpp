// continuous_count on CUDA tensors against the reference backend. Skipped without a GPU.
#include <optional>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::to_cpu;
using test::to_cuda;
using test::values;

Tensor reference_counts(const TensorView& x, std::int64_t bins) {
  Tensor out({bins}, DType::I64);
  ForceKernelBackend force(KernelBackend::Reference);
  continuous_count(x, out);
  return out;
}

// Counts on the GPU into an output holding 7s (every bin must be overwritten).
Tensor gpu_counts(const TensorView& x, std::int64_t bins, const Stream& stream = {}) {
  Tensor out = to_cuda(test::full({bins}, DType::I64, 7), stream);
  continuous_count(x, out, stream);
  return to_cpu(out, stream);
}

// 1M ids, some out of range, over bin counts around each of the kernel's regimes: one shared
// histogram per warp (up to 1536 bins), fewer copies, one per block (12288), none (global
// atomics).
TEST(CudaContinuousCount, MatchesTheReferenceFromEightBinsToHistogramsPastSharedMemory) {
  MESHFUSE_REQUIRE_CUDA();
  for (DType dtype : {DType::I32, DType::I64})
    for (std::int64_t bins : {1, 8, 64, 256, 1536, 2000, 12288, 12289, 100000}) {
      Tensor x({(1 << 20) + 3}, dtype);
      testing::fill_uniform_int(x, static_cast<std::uint64_t>(bins), -3, bins + 5);
      EXPECT_TRUE(testing::bitwise_equal(gpu_counts(to_cuda(x), bins), reference_counts(x, bins)))
          << bins << " bins, " << to_string(dtype);
    }
}

TEST(CudaContinuousCount, KnownValuesAndValuesOutsideTheBinsAreIgnored) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor x = test::from({13}, DType::I32, {3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 0, 7});
  EXPECT_EQ(values(gpu_counts(to_cuda(x), 10)),
            (std::vector<double>{2, 2, 1, 2, 1, 3, 1, 1, 0, 0}));  // torch.bincount
  const Tensor x64 = test::from({5}, DType::I64, {4294967296.0 + 2, -4294967296.0, 2, -2, 5e9});
  EXPECT_EQ(values(gpu_counts(to_cuda(x64), 4)), (std::vector<double>{0, 0, 1, 0}));
}

TEST(CudaContinuousCount, EmptyInputZeroBinsStridedInputAndForcedReference) {
  MESHFUSE_REQUIRE_CUDA();
  EXPECT_EQ(values(gpu_counts(to_cuda(Tensor({0}, DType::I64)), 3)),
            (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(gpu_counts(to_cuda(test::from({2}, DType::I32, {0, 1})), 0).shape(), (Shape{0}));
  Tensor x({4001}, DType::I32);
  testing::fill_uniform_int(x, 3, 0, 16);
  const Tensor gx = to_cuda(x);
  const TensorView strided(gx.view().data(), DType::I32, {2001}, {2}, kCuda);
  const Tensor expected = reference_counts(Tensor::copy_of(to_cpu(strided)), 16);
  EXPECT_TRUE(testing::bitwise_equal(gpu_counts(strided, 16), expected));
  Tensor out({16}, DType::I64, kCuda);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    continuous_count(strided, out);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(out), expected));
}

TEST(CudaContinuousCount, DeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  Tensor x({16 * 4096 * 8}, DType::I32);
  testing::fill_uniform_int(x, 4, 0, 64);
  const Tensor gx = to_cuda(x, stream);
  EXPECT_TRUE(testing::bitwise_equal(gpu_counts(gx, 64, stream), gpu_counts(gx, 64, stream)));
}

// 2^31 + 5 i32 values (8 GiB): indices and counts past 2^31.
TEST(CudaContinuousCount, MoreThan2To31ValuesAreIndexedAndCountedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const std::int64_t n = (std::int64_t{1} << 31) + 5;
  std::optional<Tensor> x;
  try {
    x.emplace(Tensor::zeros({n}, DType::I32, kCuda));
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  copy(test::from({3}, DType::I32, {1, 2, 1}), x->view().narrow(0, n - 3, 3));
  EXPECT_EQ(values(gpu_counts(*x, 3)), (std::vector<double>{static_cast<double>(n - 3), 2, 1}));
}

}  // namespace
}  // namespace meshfuse
