// Statistics of the device memory that meshfuse allocates on CUDA devices (torch.cuda naming).
#pragma once

#include <cstdint>

#include "meshfuse/core/device.h"

namespace meshfuse {

// A CUDA device's current stream-ordered memory pool, which meshfuse::Tensor allocates from
// (cudaMallocAsync): tensors, and every op's scratch memory (ops allocate it as Tensors on their
// stream, cuBLASLt workspaces included). Other users of the same pool in the process count too;
// PyTorch's caching allocator does not use it (unless configured with backend:cudaMallocAsync).
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

}  // namespace meshfuse
