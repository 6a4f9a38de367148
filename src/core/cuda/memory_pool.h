// meshfuse's stream-ordered memory pools and the CUDA side of memory.h (internal; implemented
// only in CUDA builds, in memory_pool.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "meshfuse/core/memory.h"

namespace meshfuse::detail {

// meshfuse's pool on a device, created at first use: every Tensor and op scratch allocation on
// the device comes from it (cudaMallocFromPoolAsync). Freed memory stays in the pool for reuse
// (release threshold: unlimited) until empty_cache, or until an allocation fails (cuda_allocate
// then synchronises the device, trims the pool and tries once more): with the CUDA default of 0,
// every synchronisation handed it back to the driver, and the next allocation mapped it anew
// (host time in front of every GEMM, for its cuBLASLt workspace).
cudaMemPool_t memory_pool(int device_index);

DeviceMemoryStats cuda_memory_stats(int device_index);
// Sets the pool's UsedMemHigh and ReservedMemHigh to their current values (by writing 0).
void cuda_reset_peak_memory_stats(int device_index);
// cudaMemPoolTrimTo(pool, 0).
void cuda_empty_cache(int device_index);

}  // namespace meshfuse::detail
