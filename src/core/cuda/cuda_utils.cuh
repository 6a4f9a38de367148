// Helpers for the .cu files (internal).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>
#include <type_traits>
#include <utility>

#include "core/cuda/runtime.h"
#include "core/numeric.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/stream.h"

namespace meshfuse::detail::cuda {

// Throws Error(Internal / OutOfMemory) naming `what` and the CUDA error.
void check(cudaError_t status, std::string_view what);

// Checks the launch that was just queued (configuration errors surface here, not later).
inline void check_launch(std::string_view op) { check(cudaGetLastError(), op); }

// query() for `key` on the current device, asked once per process and then remembered: a driver
// query (function attributes, occupancy) costs about a launch's host time, and a small op's call
// is mostly host time (bench/python_overhead.py). One table per call site (the query's type); a
// query that throws stores nothing.
template <typename Key, typename Query>
auto remembered(const Key& key, Query&& query) {
  static std::mutex mutex;
  static std::map<std::pair<int, Key>, std::invoke_result_t<Query&>> table;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard lock(mutex);
  auto it = table.find({device, key});
  if (it == table.end()) it = table.emplace(std::pair{device, key}, query()).first;
  return it->second;
}

inline cudaStream_t native(const Stream& stream) {
  return static_cast<cudaStream_t>(stream.native);
}

// Whether `stream` is being captured into a CUDA graph (torch.cuda.graph, torch.compile's
// "reduce-overhead"): nothing may then wait on the host for the device, or allocate outside the
// stream's order.
inline bool capturing(const Stream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(native(stream), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

// The CUDA element type of a meshfuse element type.
template <typename T>
struct CudaType {
  using type = T;
};
template <>
struct CudaType<bfloat16> {
  using type = __nv_bfloat16;
};
template <>
struct CudaType<float16> {
  using type = __half;
};
template <typename T>
using cuda_t = typename CudaType<T>::type;

// Load as the accumulation type (float; double for double) and store rounded once (RNE).
__device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float load(__half x) { return __half2float(x); }
__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ double load(double x) { return x; }

template <typename T>
__device__ __forceinline__ T store(float x);
template <>
__device__ __forceinline__ float store<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 store<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half store<__half>(float x) { return __float2half_rn(x); }
template <typename T>
__device__ __forceinline__ T store(double x) {
  return static_cast<T>(x);
}

inline unsigned ceil_div(std::int64_t a, std::int64_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

}  // namespace meshfuse::detail::cuda

namespace meshfuse::detail::cuda {

// N elements of T moved as one aligned access (16 bytes for 8 x bf16 or 4 x f32).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements of T per 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Blocks for a grid-stride loop over `work` items: enough to fill the device, no more.
unsigned grid_size(std::int64_t work, int threads);

// The current device's SM count.
int sm_count();

}  // namespace meshfuse::detail::cuda
