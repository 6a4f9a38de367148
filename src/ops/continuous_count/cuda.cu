// CUDA continuous_count: each block counts its grid-stride share of x into histograms in shared
// memory (one per warp while they fit, so that only the lanes of one warp contend for a counter),
// then adds its totals to out with one 64-bit atomic per bin. Histograms too large for shared
// memory count straight into out. Integer atomics are exact: the counts are the same run to run.
#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/continuous_count/continuous_count_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kPerThread = 8;                    // loads in flight per thread before its atomics
constexpr std::int64_t kSharedBytes = 48 << 10;  // without the opt-in for more
// A block counts at most this many values, so that its 32-bit shared counters cannot overflow.
constexpr std::int64_t kMaxPerBlock = std::int64_t{1} << 30;

using Counter = unsigned long long;  // out, i64 counts, as atomicAdd's 64-bit type

// Calls add(bin) for each value of the thread's grid-stride share of x that lies in [0, bins).
template <typename I, typename F>
__device__ __forceinline__ void for_each_in_range(const I* __restrict__ x, std::int64_t n,
                                                  std::int64_t bins, F&& add) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t base = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       base < n; base += stride * kPerThread) {
    I v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const std::int64_t i = base + k * stride;
      v[k] = i < n ? x[i] : I(-1);
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      // Negative values wrap past any bin count.
      const auto u = static_cast<std::uint64_t>(static_cast<std::int64_t>(v[k]));
      if (u < static_cast<std::uint64_t>(bins)) add(u);
    }
  }
}

template <typename I>
__global__ void __launch_bounds__(kThreads)
    count_shared(const I* __restrict__ x, std::int64_t n, std::int64_t bins, int copies,
                 Counter* out) {
  extern __shared__ unsigned hist[];
  for (std::int64_t i = threadIdx.x; i < copies * bins; i += kThreads) hist[i] = 0;
  __syncthreads();
  unsigned* mine = hist + (threadIdx.x / 32 % copies) * bins;
  for_each_in_range(x, n, bins, [&](std::uint64_t b) { atomicAdd(mine + b, 1u); });
  __syncthreads();
  for (std::int64_t b = threadIdx.x; b < bins; b += kThreads) {
    Counter sum = 0;
    for (int c = 0; c < copies; ++c) sum += hist[c * bins + b];
    if (sum != 0) atomicAdd(out + b, sum);
  }
}

template <typename I>
__global__ void __launch_bounds__(kThreads)
    count_global(const I* __restrict__ x, std::int64_t n, std::int64_t bins, Counter* out) {
  for_each_in_range(x, n, bins, [&](std::uint64_t b) { atomicAdd(out + b, Counter{1}); });
}

}  // namespace

void continuous_count(const CountShape& s, const void* x, std::int64_t* out, const Stream& stream) {
  if (s.bins == 0) return;
  DeviceGuard guard(stream.device.index);
  check(cudaMemsetAsync(out, 0, s.bins * sizeof(std::int64_t), native(stream)),
        "continuous_count: cudaMemsetAsync");
  if (s.n == 0) return;
  const unsigned blocks = std::max<unsigned>(
      grid_size((s.n + kPerThread - 1) / kPerThread, kThreads), ceil_div(s.n, kMaxPerBlock));
  const std::int64_t copies =
      std::min<std::int64_t>(kWarps, kSharedBytes / (s.bins * std::int64_t{sizeof(unsigned)}));
  auto* counts = reinterpret_cast<Counter*>(out);
  dispatch_index(s.dtype, "continuous_count", [&](auto tag) {
    using I = decltype(tag);
    const I* v = static_cast<const I*>(x);
    if (copies > 0)
      count_shared<I><<<blocks, kThreads, copies * s.bins * sizeof(unsigned), native(stream)>>>(
          v, s.n, s.bins, static_cast<int>(copies), counts);
    else
      count_global<I><<<blocks, kThreads, 0, native(stream)>>>(v, s.n, s.bins, counts);
  });
  check_launch("continuous_count");
}

}  // namespace meshfuse::detail::cuda
