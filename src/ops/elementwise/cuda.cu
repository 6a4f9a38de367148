// CUDA elementwise ops: one grid-stride kernel. When every input is laid out as out and every
// pointer is 16-byte aligned, a thread moves 16 bytes of each operand per step (Vec) and the last
// numel % N elements go one to a thread; otherwise a thread takes one element per step and finds
// each input's through its strides (element_offset: 64-bit divisions, the fallback's cost). All
// indices are 64-bit. The fma and the product are __fma*_rn / __*mul_rn: the roundings
// elementwise.h documents, whatever nvcc's --fmad does with a * b + c.
#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/elementwise/elementwise_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <typename A>
struct Add {
  A alpha;
  __device__ A operator()(A a, A b) const { return fma_rn(alpha, b, a); }
};
template <typename A>
struct Mul {
  A scalar;
  __device__ A operator()(A a) const { return mul_rn(a, scalar); }
};

// A kernel argument holding K inputs by value.
template <int K>
struct Inputs {
  ElementwiseInput in[K];
};

template <int K, typename F, typename A>
__device__ __forceinline__ A call(F f, const A (&v)[K]) {
  if constexpr (K == 1)
    return f(v[0]);
  else
    return f(v[0], v[1]);
}

// out may be an input's own data (in place): each element (or vector) is loaded by the thread
// that stores it, before it stores it, so out is not __restrict__.
template <typename T, int N, int K, bool kStrided, typename F>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(ElementwiseShape s, Inputs<K> in, T* out, F f) {
  using A = decltype(load(T{}));
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const auto one = [&](std::int64_t i) {
    A v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const std::int64_t at = kStrided ? element_offset(s, in.in[k], i) : i;
      v[k] = load(static_cast<const T*>(in.in[k].data)[at]);
    }
    out[i] = store<T>(call<K>(f, v));
  };
  if constexpr (kStrided || N == 1) {
    for (std::int64_t i = first; i < s.numel; i += step) one(i);
  } else {
    const std::int64_t vectors = s.numel / N;
    for (std::int64_t j = first; j < vectors; j += step) {
      Vec<T, N> x[K];
#pragma unroll
      for (int k = 0; k < K; ++k) x[k] = static_cast<const Vec<T, N>*>(in.in[k].data)[j];
      Vec<T, N> y;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        A v[K];
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = load(x[k].v[e]);
        y.v[e] = store<T>(call<K>(f, v));
      }
      reinterpret_cast<Vec<T, N>*>(out)[j] = y;
    }
    if (const std::int64_t i = vectors * N + first; i < s.numel) one(i);  // numel % N < N left
  }
}

// The 16-byte vector kernel when every input is linear and every pointer 16-byte aligned, else
// one element per step (contiguous, or through the strides).
template <typename T, int K, typename F>
void launch(const ElementwiseShape& s, const ElementwiseInput (&inputs)[K], void* out, F f,
            const Stream& stream) {
  Inputs<K> in;
  bool linear = true, aligned = aligned16(out);
  for (int k = 0; k < K; ++k) {
    in.in[k] = inputs[k];
    linear = linear && inputs[k].linear;
    aligned = aligned && aligned16(inputs[k].data);
  }
  T* o = static_cast<T*>(out);
  constexpr int N = kVec16<T>;
  if (!linear)
    elementwise_kernel<T, 1, K, true>
        <<<grid_size(s.numel, kThreads), kThreads, 0, native(stream)>>>(s, in, o, f);
  else if (aligned)
    elementwise_kernel<T, N, K, false>
        <<<grid_size((s.numel + N - 1) / N, kThreads), kThreads, 0, native(stream)>>>(s, in, o, f);
  else
    elementwise_kernel<T, 1, K, false>
        <<<grid_size(s.numel, kThreads), kThreads, 0, native(stream)>>>(s, in, o, f);
}

}  // namespace

void elementwise_add(const ElementwiseShape& s, ElementwiseInput a, ElementwiseInput b, void* out,
                     double alpha, const Stream& stream) {
  if (s.numel == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "add", [&](auto tag) {
    using A = acc_t<decltype(tag)>;
    const ElementwiseInput in[2] = {a, b};
    launch<cuda_t<decltype(tag)>>(s, in, out, Add<A>{static_cast<A>(alpha)}, stream);
  });
  check_launch("add");
}

void elementwise_mul(const ElementwiseShape& s, ElementwiseInput a, void* out, double scalar,
                     const Stream& stream) {
  if (s.numel == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "mul", [&](auto tag) {
    using A = acc_t<decltype(tag)>;
    const ElementwiseInput in[1] = {a};
    launch<cuda_t<decltype(tag)>>(s, in, out, Mul<A>{static_cast<A>(scalar)}, stream);
  });
  check_launch("mul");
}

}  // namespace meshfuse::detail::cuda
