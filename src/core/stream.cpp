#include "meshfuse/core/stream.h"

#include <chrono>

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

StreamEvent::~StreamEvent() {
#ifdef MESHFUSE_WITH_CUDA
  if (event_ != nullptr) detail::cuda_event_destroy(event_, device_.index);
#endif
}

void StreamEvent::record(const Stream& stream) {
  if (stream.device.type != DeviceType::CUDA) return;
#ifdef MESHFUSE_WITH_CUDA
  if (event_ == nullptr) {
    detail::check_cuda_device(stream.device, "StreamEvent.record");
    device_ = stream.device;
    event_ = detail::cuda_event_create(device_.index, false);
  }
  MESHFUSE_CHECK(stream.device == device_, ErrorCode::DeviceMismatch,
                 "StreamEvent.record: the event is on {}, the stream on {}", device_.str(),
                 stream.device.str());
  detail::cuda_event_record(event_, stream);
#endif
}

void StreamEvent::wait([[maybe_unused]] const Stream& stream) const {
  if (event_ == nullptr) return;
#ifdef MESHFUSE_WITH_CUDA
  MESHFUSE_CHECK(stream.device == device_, ErrorCode::DeviceMismatch,
                 "StreamEvent.wait: the event is on {}, the stream on {}", device_.str(),
                 stream.device.str());
  detail::cuda_stream_wait_event(stream, event_);
#endif
}

void wait_stream(const Stream& waiter, const Stream& waited) {
  if (waiter.device.type != DeviceType::CUDA && waited.device.type != DeviceType::CUDA) return;
  if (waiter.device == waited.device && waiter.native == waited.native) return;
  StreamEvent event;
  event.record(waited);
  event.wait(waiter);
}

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

StreamTimer::StreamTimer(const Stream& stream) : stream_(stream) {
  if (stream_.device.type != DeviceType::CUDA) return;
#ifdef MESHFUSE_WITH_CUDA
  detail::check_cuda_device(stream_.device, "StreamTimer");
  begin_ = detail::cuda_event_create(stream_.device.index);
  end_ = detail::cuda_event_create(stream_.device.index);
#else
  fail(ErrorCode::BackendUnavailable,
       "StreamTimer: cannot time {}: this build of meshfuse has no CUDA support",
       stream_.device.str());
#endif
}

StreamTimer::~StreamTimer() {
#ifdef MESHFUSE_WITH_CUDA
  if (begin_ != nullptr) detail::cuda_event_destroy(begin_, stream_.device.index);
  if (end_ != nullptr) detail::cuda_event_destroy(end_, stream_.device.index);
#endif
}

void StreamTimer::start() {
#ifdef MESHFUSE_WITH_CUDA
  if (begin_ != nullptr) {
    // On an idle stream the start event would fire at once and the first timed kernel only once
    // the host had launched it (tens of microseconds of Python and launch time): held for longer
    // than that, the stream starts the timed work back to back with the event.
    detail::cuda_hold(stream_, kHoldMicroseconds);
    return detail::cuda_event_record(begin_, stream_);
  }
#endif
  host_start_ = now_seconds();
}

double StreamTimer::stop() {
#ifdef MESHFUSE_WITH_CUDA
  if (end_ != nullptr) {
    detail::cuda_event_record(end_, stream_);
    return detail::cuda_event_elapsed_ms(begin_, end_);
  }
#endif
  return (now_seconds() - host_start_) * 1e3;
}

}  // namespace meshfuse
