// An execution stream. Ops run on the stream they are given and never synchronise the device.
#pragma once

#include "meshfuse/core/device.h"

namespace meshfuse {

// On the CPU a stream is only a device tag and ops run synchronously on the calling thread (with
// OpenMP workers). On CUDA, `native` is a cudaStream_t; nullptr is the default stream.
struct Stream {
  Device device{};
  void* native = nullptr;
};

}  // namespace meshfuse
