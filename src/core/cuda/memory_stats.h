// The CUDA side of memory.h (internal; implemented only in CUDA builds, in memory_stats.cu).
#pragma once

#include "meshfuse/core/memory.h"

namespace meshfuse::detail {

// The attributes of the device's current memory pool (cudaDeviceGetMemPool).
DeviceMemoryStats cuda_memory_stats(int device_index);
// Sets the pool's UsedMemHigh and ReservedMemHigh to their current values (by writing 0).
void cuda_reset_peak_memory_stats(int device_index);

}  // namespace meshfuse::detail
