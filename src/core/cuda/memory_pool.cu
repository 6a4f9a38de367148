// meshfuse's memory pools (one per device) and their statistics for memory.h.
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda/cuda_utils.cuh"
#include "core/cuda/memory_pool.h"

namespace meshfuse::detail {
namespace {

std::int64_t attribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  std::uint64_t value = 0;
  cuda::check(cudaMemPoolGetAttribute(pool, attr, &value), "device_memory_stats");
  return static_cast<std::int64_t>(value);
}

}  // namespace

cudaMemPool_t memory_pool(int device_index) {
  // Never destroyed: tensors may outlive static destruction, and the CUDA runtime may be gone.
  static std::mutex mutex;
  static std::vector<cudaMemPool_t> pools;
  const std::lock_guard<std::mutex> lock(mutex);
  if (pools.size() <= static_cast<std::size_t>(device_index))
    pools.resize(static_cast<std::size_t>(device_index) + 1, nullptr);
  cudaMemPool_t& slot = pools[static_cast<std::size_t>(device_index)];
  if (slot == nullptr) {
    const std::string what = "creating the memory pool of cuda:" + std::to_string(device_index);
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_index;
    cudaMemPool_t pool = nullptr;
    cuda::check(cudaMemPoolCreate(&pool, &props), what);
    std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
    const cudaError_t status =
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    if (status != cudaSuccess) cudaMemPoolDestroy(pool);
    cuda::check(status, what);
    slot = pool;
  }
  return slot;
}

DeviceMemoryStats cuda_memory_stats(int device_index) {
  const cudaMemPool_t pool = memory_pool(device_index);
  return {attribute(pool, cudaMemPoolAttrUsedMemCurrent),
          attribute(pool, cudaMemPoolAttrUsedMemHigh),
          attribute(pool, cudaMemPoolAttrReservedMemCurrent),
          attribute(pool, cudaMemPoolAttrReservedMemHigh)};
}

void cuda_reset_peak_memory_stats(int device_index) {
  const cudaMemPool_t pool = memory_pool(device_index);
  std::uint64_t zero = 0;  // the only value these attributes take: reset to the current one
  for (cudaMemPoolAttr attr : {cudaMemPoolAttrUsedMemHigh, cudaMemPoolAttrReservedMemHigh})
    cuda::check(cudaMemPoolSetAttribute(pool, attr, &zero), "reset_peak_memory_stats");
}

void cuda_empty_cache(int device_index) {
  cuda::check(cudaMemPoolTrimTo(memory_pool(device_index), 0), "empty_cache");
}

}  // namespace meshfuse::detail
