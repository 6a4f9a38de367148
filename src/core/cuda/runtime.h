// The CUDA side of core (internal; implemented only in CUDA builds, in runtime.cu).
#pragma once

#include <cstddef>
#include <memory>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse::detail {

namespace cuda {

// Makes `device` current for the scope (kernels, copies and NCCL calls go to the current device).
// Throws Error(Internal) when CUDA cannot get or set the device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace cuda

int cuda_device_count();
// Throws Error(BackendUnavailable) naming `what` unless `device` is a CUDA device of this process.
void check_cuda_device(Device device, std::string_view what);
// From the device's meshfuse pool (memory_pool.h) on `stream`; the deleter frees with
// cudaFreeAsync on the same stream.
std::shared_ptr<void> cuda_allocate(Device device, std::size_t bytes, const Stream& stream);
// copy() when either side is on a CUDA device.
void cuda_copy(const TensorView& src, const TensorView& dst, const Stream& stream);
void cuda_synchronize(const Stream& stream);
// An event that can time (StreamTimer) or only order streams (timing false: cheaper).
void* cuda_event_create(int device_index, bool timing = true);
void cuda_event_destroy(void* event, int device_index);
void cuda_event_record(void* event, const Stream& stream);
// Later work on `stream` waits for the work `event` was recorded after.
void cuda_stream_wait_event(const Stream& stream, void* event);
// Queues a kernel that keeps `stream` busy for `microseconds` (device time), so that work the host
// queues meanwhile starts back to back.
void cuda_hold(const Stream& stream, unsigned microseconds);
// Waits for `end` and returns the milliseconds between the two recorded events.
double cuda_event_elapsed_ms(void* begin, void* end);
void* cuda_stream_create(int device_index);
void cuda_stream_destroy(void* stream, int device_index);

}  // namespace meshfuse::detail
