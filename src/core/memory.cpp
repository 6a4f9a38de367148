#include "meshfuse/core/memory.h"

#include <string_view>

#include "meshfuse/core/error.h"

#ifdef MESHFUSE_WITH_CUDA
#include "core/cuda/memory_pool.h"
#include "core/cuda/runtime.h"
#endif

namespace meshfuse {
namespace {

void check_device(std::string_view what, Device device) {
  MESHFUSE_CHECK(device.type == DeviceType::CUDA, ErrorCode::InvalidArgument,
                 "{}: meshfuse keeps memory pools on CUDA devices only, got {}", what,
                 device.str());
#ifdef MESHFUSE_WITH_CUDA
  detail::check_cuda_device(device, what);
#else
  fail(ErrorCode::BackendUnavailable, "{}: {}: this build of meshfuse has no CUDA support", what,
       device.str());
#endif
}

}  // namespace

DeviceMemoryStats device_memory_stats(Device device) {
  check_device("device_memory_stats", device);
#ifdef MESHFUSE_WITH_CUDA
  return detail::cuda_memory_stats(device.index);
#else
  return {};
#endif
}

void reset_peak_memory_stats(Device device) {
  check_device("reset_peak_memory_stats", device);
#ifdef MESHFUSE_WITH_CUDA
  detail::cuda_reset_peak_memory_stats(device.index);
#endif
}

void empty_cache(Device device) {
  check_device("empty_cache", device);
#ifdef MESHFUSE_WITH_CUDA
  detail::cuda_empty_cache(device.index);
#endif
}

}  // namespace meshfuse
