// An execution stream. Ops run on the stream they are given and never synchronise the device.
#pragma once

#include "meshfuse/core/device.h"

namespace meshfuse {

// A stream belongs to one device, fixed when it is made: Stream{device} is that device's default
// stream, Stream{device, native} a given one, and Stream{} the CPU's. On the CPU a stream is only
// a device tag and ops run synchronously on the calling thread (with OpenMP workers). On CUDA,
// `native` is a cudaStream_t; nullptr is the legacy default stream.
//
// The contract: an op runs on the stream it is given, which must be on the device of its tensors;
// a stream of another device, the CPU's included, is Error(DeviceMismatch) naming the op, the
// stream's device and the tensors' device. Nothing relabels a stream, so a caller with CUDA
// tensors passes a stream of their device (at least Stream{tensor.device()}). The Python bindings
// build theirs from the device of the call's tensors and the caller's handle (0: the default).
// Tensor allocation and copy() (tensor.h) take the CPU's stream too: their CUDA work then goes on
// the legacy default stream of the CUDA device involved, for set-up code that orders nothing.
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

// A point in a stream's work that other streams can be ordered after (torch.cuda.Event without
// timing): record() marks the work queued on a stream so far, wait() makes later work on another
// stream wait for it, without blocking the host. On CPU streams both do nothing (CPU ops run
// synchronously). Mixing devices is Error(DeviceMismatch).
class StreamEvent {
 public:
  StreamEvent() = default;
  ~StreamEvent();
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;

  void record(const Stream& stream);
  // Before any record(), nothing to wait for.
  void wait(const Stream& stream) const;

 private:
  Device device_{};
  void* event_ = nullptr;  // cudaEvent_t, made at the first record on a CUDA stream
};

// Later work on `waiter` waits for the work queued on `waited` so far (torch's
// Stream.wait_stream); nothing on the CPU.
void wait_stream(const Stream& waiter, const Stream& waited);

// Times the work queued on a stream between start() and stop(): with CUDA events recorded on the
// stream for CUDA streams (device time: the host's launch and synchronisation latency is left
// out; start() first holds the stream for kHoldMicroseconds, so that the work the host queues
// next runs from the start event without a gap), with a steady clock on the CPU.
class StreamTimer {
 public:
  explicit StreamTimer(const Stream& stream);
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;

  static constexpr unsigned kHoldMicroseconds = 100;

  void start();
  // Waits for the work queued since start() and returns its duration in milliseconds.
  double stop();

 private:
  Stream stream_;
  void* begin_ = nullptr;  // cudaEvent_t pair on CUDA streams
  void* end_ = nullptr;
  double host_start_ = 0;  // seconds on the steady clock, CPU streams
};

}  // namespace meshfuse
