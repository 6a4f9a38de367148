// The device memory that meshfuse allocates on CUDA devices: statistics and the cache
// (torch.cuda naming).
#pragma once

#include <cstdint>

#include "meshfuse/core/device.h"

namespace meshfuse {

// Each CUDA device has one stream-ordered memory pool of meshfuse's own (cudaMemPoolCreate,
// cudaMallocFromPoolAsync), which meshfuse::Tensor allocates from: tensors, and every op's scratch
// memory (ops allocate it as Tensors on their stream, cuBLASLt workspaces included). Nothing else
// in the process uses it. Freed memory stays reserved in the pool and serves later allocations,
// as in PyTorch's caching allocator, until empty_cache() hands it back (torch.cuda.empty_cache
// does not reach it), or until an allocation finds the device full: meshfuse then synchronises
// the device, hands the pool's unused memory back and tries once more.
// Read after synchronising the streams that allocate.
struct DeviceMemoryStats {
  std::int64_t allocated = 0;       // bytes allocated now (cudaMemPoolAttrUsedMemCurrent)
  std::int64_t peak_allocated = 0;  // most bytes allocated at once since the last reset
                                    // (cudaMemPoolAttrUsedMemHigh)
  std::int64_t reserved = 0;        // bytes the pool holds from the device, allocated or cached
                                    // (cudaMemPoolAttrReservedMemCurrent)
  std::int64_t peak_reserved = 0;   // cudaMemPoolAttrReservedMemHigh
};

// Throws InvalidArgument for a CPU device, BackendUnavailable in a build without CUDA or for a
// CUDA device this process does not have.
DeviceMemoryStats device_memory_stats(Device device);

// Sets the two peaks to the current values, so that the next peak_allocated minus the allocated
// value read now is the most extra memory allocated at once in between. Errors as above.
void reset_peak_memory_stats(Device device);

// Hands the pool's unused memory back to the device (cudaMemPoolTrimTo), as torch.cuda.empty_cache:
// reserved drops to about allocated. Memory freed on a stream counts as unused once the stream's
// work before the free has run; synchronise first to release all of it. Errors as above.
void empty_cache(Device device);

}  // namespace meshfuse
