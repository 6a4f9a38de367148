// An execution stream. Ops run on the stream they are given and never synchronise the device.
#pragma once

#include "meshfuse/core/device.h"

namespace meshfuse {

// On the CPU a stream is only a device tag and ops run synchronously on the calling thread (with
// OpenMP workers). On CUDA, `native` is a cudaStream_t; nullptr is the legacy default stream.
struct Stream {
  Device device{};
  void* native = nullptr;
};

// Blocks until all work queued on `stream` has finished; a no-op for CPU streams.
void synchronize(const Stream& stream);

// A CUDA stream (non-blocking with respect to the default stream) created on a device and
// destroyed with this object. Throws Error(BackendUnavailable) in builds without CUDA or when the
// device does not exist.
class CudaStream {
 public:
  explicit CudaStream(int device_index = 0);
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  const Stream& stream() const { return stream_; }
  operator const Stream&() const { return stream_; }  // NOLINT: usable where a Stream is taken

 private:
  Stream stream_;
};

}  // namespace meshfuse
