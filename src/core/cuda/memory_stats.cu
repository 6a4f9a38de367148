// Memory pool statistics for memory.h.
#include "core/cuda/cuda_utils.cuh"
#include "core/cuda/memory_stats.h"

namespace meshfuse::detail {
namespace {

cudaMemPool_t current_pool(int device_index, const char* what) {
  cudaMemPool_t pool = nullptr;
  cuda::check(cudaDeviceGetMemPool(&pool, device_index), what);
  return pool;
}

std::int64_t attribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  std::uint64_t value = 0;
  cuda::check(cudaMemPoolGetAttribute(pool, attr, &value), "device_memory_stats");
  return static_cast<std::int64_t>(value);
}

}  // namespace

DeviceMemoryStats cuda_memory_stats(int device_index) {
  const cudaMemPool_t pool = current_pool(device_index, "device_memory_stats");
  return {attribute(pool, cudaMemPoolAttrUsedMemCurrent),
          attribute(pool, cudaMemPoolAttrUsedMemHigh),
          attribute(pool, cudaMemPoolAttrReservedMemCurrent),
          attribute(pool, cudaMemPoolAttrReservedMemHigh)};
}

void cuda_reset_peak_memory_stats(int device_index) {
  const cudaMemPool_t pool = current_pool(device_index, "reset_peak_memory_stats");
  std::uint64_t zero = 0;  // the only value these attributes take: reset to the current one
  for (cudaMemPoolAttr attr : {cudaMemPoolAttrUsedMemHigh, cudaMemPoolAttrReservedMemHigh})
    cuda::check(cudaMemPoolSetAttribute(pool, attr, &zero), "reset_peak_memory_stats");
}

}  // namespace meshfuse::detail
