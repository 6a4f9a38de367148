// device_memory_stats / reset_peak_memory_stats / empty_cache (meshfuse/core/memory.h). The CUDA
// tests are skipped without a GPU.
#include "meshfuse/core/memory.h"
#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;

TEST(MemoryStats, ACpuDeviceIsAnError) {
  test::expect_error([] { device_memory_stats(Device{}); }, ErrorCode::InvalidArgument,
                     {"device_memory_stats", "CUDA devices only", "cpu"});
  test::expect_error([] { reset_peak_memory_stats(Device{}); }, ErrorCode::InvalidArgument,
                     {"reset_peak_memory_stats", "cpu"});
  test::expect_error([] { empty_cache(Device{}); }, ErrorCode::InvalidArgument,
                     {"empty_cache", "cpu"});
}

TEST(MemoryStats, ACudaDeviceThisProcessLacksIsUnavailable) {
  const Device missing{DeviceType::CUDA, cuda_device_count()};
  test::expect_error([&] { device_memory_stats(missing); }, ErrorCode::BackendUnavailable,
                     {"device_memory_stats", missing.str()});
  test::expect_error([&] { empty_cache(missing); }, ErrorCode::BackendUnavailable,
                     {"empty_cache", missing.str()});
}

TEST(MemoryStats, TensorsCountWhileAliveAndThePeakKeepsTheMostAtOnceUntilReset) {
  MESHFUSE_REQUIRE_CUDA();
  constexpr std::int64_t kBytes = std::int64_t{64} << 20;
  synchronize(Stream{kCuda});
  reset_peak_memory_stats(kCuda);
  const DeviceMemoryStats before = device_memory_stats(kCuda);
  EXPECT_EQ(before.peak_allocated, before.allocated);
  {
    const Tensor a({kBytes}, DType::U8, kCuda);
    synchronize(Stream{kCuda});
    const DeviceMemoryStats during = device_memory_stats(kCuda);
    EXPECT_GE(during.allocated - before.allocated, kBytes);
    EXPECT_GE(during.reserved, during.allocated);
  }
  synchronize(Stream{kCuda});
  const DeviceMemoryStats after = device_memory_stats(kCuda);
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_GE(after.peak_allocated - before.allocated, kBytes);  // the tensor's bytes, gone now
  EXPECT_LT(after.peak_allocated - before.allocated, 2 * kBytes);
  reset_peak_memory_stats(kCuda);
  EXPECT_EQ(device_memory_stats(kCuda).peak_allocated, after.allocated);
}

// Freed memory stays reserved across a synchronisation (the next allocation reuses it without the
// driver) until empty_cache hands it back.
TEST(MemoryStats, FreedMemoryStaysCachedUntilEmptyCache) {
  MESHFUSE_REQUIRE_CUDA();
  constexpr std::int64_t kBytes = std::int64_t{256} << 20;
  const Stream stream{kCuda};
  synchronize(stream);
  empty_cache(kCuda);
  const std::int64_t base = device_memory_stats(kCuda).reserved;
  { const Tensor a({kBytes}, DType::U8, kCuda, stream); }
  synchronize(stream);
  const DeviceMemoryStats cached = device_memory_stats(kCuda);
  EXPECT_GE(cached.reserved - base, kBytes);
  EXPECT_LT(cached.allocated, kBytes);                     // nothing else of this size is alive
  { const Tensor b({kBytes}, DType::U8, kCuda, stream); }  // served from the cache
  synchronize(stream);
  EXPECT_EQ(device_memory_stats(kCuda).reserved, cached.reserved);
  empty_cache(kCuda);
  EXPECT_LT(device_memory_stats(kCuda).reserved - base, kBytes);
}

// An allocation no device can hold fails after the retry (synchronise, trim the cache) with an
// out-of-memory error naming the size and device, and leaves the pool usable.
TEST(MemoryStats, AnAllocationLargerThanTheDeviceIsOutOfMemoryAndThePoolStaysUsable) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{kCuda};
  { const Tensor cached({std::int64_t{64} << 20}, DType::U8, kCuda, stream); }
  synchronize(stream);
  const std::int64_t reserved = device_memory_stats(kCuda).reserved;  // the 64 MiB included
  constexpr std::int64_t kPetabyte = std::int64_t{1} << 50;
  test::expect_error([&] { Tensor({kPetabyte}, DType::U8, kCuda, stream); }, ErrorCode::OutOfMemory,
                     {"Tensor", std::to_string(kPetabyte) + " bytes", kCuda.str()});
  synchronize(stream);
  // The retry handed the cached block back before failing.
  EXPECT_LE(device_memory_stats(kCuda).reserved, reserved - (std::int64_t{64} << 20));
  const Tensor after = Tensor::zeros({3}, DType::F32, kCuda, stream);
  EXPECT_EQ(test::values(test::to_cpu(after, stream)), std::vector<double>(3, 0.0));
}

}  // namespace
}  // namespace meshfuse
