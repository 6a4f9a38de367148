#include "meshfuse/core/stream.h"

#include "meshfuse/core/error.h"

#ifdef MESHFUSE_WITH_CUDA
#include "core/cuda/runtime.h"
#endif

namespace meshfuse {

void synchronize(const Stream& stream) {
  if (stream.device.type != DeviceType::CUDA) return;
#ifdef MESHFUSE_WITH_CUDA
  detail::cuda_synchronize(stream);
#endif
}

#ifdef MESHFUSE_WITH_CUDA
CudaStream::CudaStream(int device_index) : stream_{Device{DeviceType::CUDA, device_index}} {
  detail::check_cuda_device(stream_.device, "CudaStream");
  stream_.native = detail::cuda_stream_create(device_index);
}

CudaStream::~CudaStream() { detail::cuda_stream_destroy(stream_.native, stream_.device.index); }
#else
CudaStream::CudaStream(int device_index) {
  fail(ErrorCode::BackendUnavailable,
       "CudaStream: cannot create a stream on cuda:{}: this build of meshfuse has no CUDA support",
       device_index);
}

CudaStream::~CudaStream() = default;
#endif

}  // namespace meshfuse
