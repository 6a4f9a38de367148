// CUDA softmax. A row is read from memory once: it is split over a cluster of up to 8 blocks (one
// block when it fits), each block copies its part into shared memory with cp.async (16-byte
// accesses, all in flight), computes the part's (max, sum of exps), the blocks combine theirs
// through distributed shared memory in rank order, then each writes its part from shared memory.
// Rows too long for 8 blocks' shared memory, and rows that are not whole aligned 16-byte vectors,
// take a streamed kernel: one block per row, an online pass for the statistics, then a second
// read to write. The backward is built the same way around dot = sum dy * y.
#include <cuda_pipeline_primitives.h>

#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/softmax/cuda_logsumexp.cuh"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

// Row parts held in shared memory: up to 64 KB per block lets three 512-thread blocks share an
// SM (one fills its part while the others compute); longer parts, up to the device's limit,
// still read the row once, with fewer blocks per SM. 8 blocks: the portable cluster size.
constexpr std::size_t kPartBytes = 64 * 1024;
constexpr int kMaxCluster = 8;

// Copies this thread's vectors of a part into shared memory (cp.async: no registers, all in
// flight at once) and waits for them; a thread reads back only the vectors it copied, so no
// block barrier is needed.
template <typename V>
__device__ __forceinline__ void fetch_own(V* dst, const V* src, int count) {
  for (int j = threadIdx.x; j < count; j += blockDim.x)
    __pipeline_memcpy_async(dst + j, src + j, sizeof(V));
}

__device__ __forceinline__ void fetch_wait() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 3>)
    forward_resident_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t rows,
                            std::int64_t cols, int cluster, acc_t<T> scale) {
  using A = acc_t<T>;
  constexpr int W = kVec16<T>;
  using V = Chunk<T, W>;
  extern __shared__ uint4 shared_part[];
  V* xs = reinterpret_cast<V*>(shared_part);
  const Part part(cols / W, cluster);
  for (std::int64_t row = blockIdx.x / cluster; row < rows; row += gridDim.x / cluster) {
    fetch_own(xs, reinterpret_cast<const V*>(x + row * cols) + part.begin, part.count);
    fetch_wait();
    // Max first, then one exp per value: the part is at hand, no rescaling.
    A max = neg_inf<A>();
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V v = xs[j];
#pragma unroll
      for (int i = 0; i < W; ++i) max = fmax(max, v[i] * scale);
    }
    const A sh = shift(max);
    A sum = 0;
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V v = xs[j];
#pragma unroll
      for (int i = 0; i < W; ++i) sum += exp2a(v[i] * scale - sh);
    }
    RowStats<A> st = block_stats(RowStats<A>{max, sum, A(0)});
    st = cluster_allreduce(
        st, cluster, [](const RowStats<A>& a, const RowStats<A>& b) { return combine(a, b); });
    // A row entirely -inf has max -inf: 2^(-inf + inf) = NaN, as PyTorch.
    const A inv = A(1) / st.sum;
    V* yr = reinterpret_cast<V*>(y + row * cols) + part.begin;
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V v = xs[j];
      A out[W];
#pragma unroll
      for (int i = 0; i < W; ++i) out[i] = exp2a(v[i] * scale - st.max) * inv;
      yr[j] = V::from(out);
    }
    cluster_wait(cluster);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 3>)
    backward_resident_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                             std::int64_t rows, std::int64_t cols, int cluster, acc_t<T> m) {
  using A = acc_t<T>;
  constexpr int W = kVec16<T>;
  using V = Chunk<T, W>;
  extern __shared__ uint4 shared_part[];
  const Part part(cols / W, cluster);
  V* ys = reinterpret_cast<V*>(shared_part);
  V* dys = ys + part.count;
  const auto plus = [](A a, A b) { return a + b; };
  for (std::int64_t row = blockIdx.x / cluster; row < rows; row += gridDim.x / cluster) {
    const std::int64_t offset = row * cols;
    fetch_own(ys, reinterpret_cast<const V*>(y + offset) + part.begin, part.count);
    fetch_own(dys, reinterpret_cast<const V*>(dy + offset) + part.begin, part.count);
    fetch_wait();
    A dot = 0;
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V yv = ys[j], dv = dys[j];
#pragma unroll
      for (int i = 0; i < W; ++i) dot += dv[i] * yv[i];
    }
    dot = cluster_allreduce(block_allreduce(dot, A(0), plus), cluster, plus);
    V* dxr = reinterpret_cast<V*>(dx + offset) + part.begin;
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V yv = ys[j], dv = dys[j];
      A out[W];
#pragma unroll
      for (int i = 0; i < W; ++i) out[i] = m * yv[i] * (dv[i] - dot);
      dxr[j] = V::from(out);
    }
    cluster_wait(cluster);
  }
}

// A row split over a cluster of blocks, each thread holding up to P vectors of its block's part
// in registers (loaded at once), one exp per value: exps relative to the thread's own max,
// rescaled to the row's max when written.
template <typename T, int P>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    forward_registers_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t rows,
                             std::int64_t cols, int cluster, acc_t<T> scale) {
  using A = acc_t<T>;
  constexpr int W = kVec16<T>;
  using V = Chunk<T, W>;
  const Part part(cols / W, cluster);
  const auto live = [&](int k) {
    return static_cast<int>(threadIdx.x + k * blockDim.x) < part.count;
  };
  for (std::int64_t row = blockIdx.x / cluster; row < rows; row += gridDim.x / cluster) {
    const V* xr = reinterpret_cast<const V*>(x + row * cols) + part.begin;
    V v[P];
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (live(k)) v[k] = xr[threadIdx.x + k * blockDim.x];
    A max = neg_inf<A>();
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (live(k))
#pragma unroll
        for (int i = 0; i < W; ++i) max = fmax(max, v[k][i] * scale);
    const A sh = shift(max);
    A e[P][W], sum = 0;
#pragma unroll
    for (int k = 0; k < P; ++k)
#pragma unroll
      for (int i = 0; i < W; ++i) {
        e[k][i] = live(k) ? exp2a(v[k][i] * scale - sh) : A(0);
        sum += e[k][i];
      }
    RowStats<A> st = block_stats(RowStats<A>{max, sum, A(0)});
    st = cluster_allreduce(
        st, cluster, [](const RowStats<A>& a, const RowStats<A>& b) { return combine(a, b); });
    const A f = rescale(max, st.max) / st.sum;
    V* yr = reinterpret_cast<V*>(y + row * cols) + part.begin;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (live(k)) {
        A out[W];
#pragma unroll
        for (int i = 0; i < W; ++i) out[i] = e[k][i] * f;
        yr[threadIdx.x + k * blockDim.x] = V::from(out);
      }
    cluster_wait(cluster);
  }
}

// The backward's counterpart: y and dy of up to P vectors per thread in registers.
template <typename T, int P>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    backward_registers_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                              std::int64_t rows, std::int64_t cols, int cluster, acc_t<T> m) {
  using A = acc_t<T>;
  constexpr int W = kVec16<T>;
  using V = Chunk<T, W>;
  const Part part(cols / W, cluster);
  const auto live = [&](int k) {
    return static_cast<int>(threadIdx.x + k * blockDim.x) < part.count;
  };
  const auto plus = [](A a, A b) { return a + b; };
  for (std::int64_t row = blockIdx.x / cluster; row < rows; row += gridDim.x / cluster) {
    const std::int64_t offset = row * cols;
    const V* yr = reinterpret_cast<const V*>(y + offset) + part.begin;
    const V* dyr = reinterpret_cast<const V*>(dy + offset) + part.begin;
    V yv[P], dv[P];
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (live(k)) {
        yv[k] = yr[threadIdx.x + k * blockDim.x];
        dv[k] = dyr[threadIdx.x + k * blockDim.x];
      }
    A dot = 0;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (live(k))
#pragma unroll
        for (int i = 0; i < W; ++i) dot += dv[k][i] * yv[k][i];
    dot = cluster_allreduce(block_allreduce(dot, A(0), plus), cluster, plus);
    V* dxr = reinterpret_cast<V*>(dx + offset) + part.begin;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (live(k)) {
        A out[W];
#pragma unroll
        for (int i = 0; i < W; ++i) out[i] = m * yv[k][i] * (dv[k][i] - dot);
        dxr[threadIdx.x + k * blockDim.x] = V::from(out);
      }
    cluster_wait(cluster);
  }
}

// A row split over a cluster of `cluster` blocks (1: the whole row), each streaming its part: the
// part's statistics, combined over the cluster, then the part again (from L2) to write.
template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    forward_streamed_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t rows,
                            std::int64_t cols, int cluster, acc_t<T> scale) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  const Part part(cols / W, cluster);
  const std::int64_t nv = part.count, stride = blockDim.x;
  for (std::int64_t row = blockIdx.x / cluster; row < rows; row += gridDim.x / cluster) {
    const T* xr = x + row * cols + part.begin * W;
    RowStats<A> st = block_stats(thread_row_stats<T, W, false>(xr, nv, scale));
    st = cluster_allreduce(
        st, cluster, [](const RowStats<A>& a, const RowStats<A>& b) { return combine(a, b); });
    const A inv = A(1) / st.sum;
    V* yr = reinterpret_cast<V*>(y + row * cols) + part.begin;
    stream_row(reinterpret_cast<const V*>(xr), nv, [&](const V(&v)[kU], std::int64_t base) {
#pragma unroll
      for (int k = 0; k < kU; ++k)
        if (base + k * stride < nv) {
          A out[W];
#pragma unroll
          for (int i = 0; i < W; ++i) out[i] = exp2a(v[k][i] * scale - st.max) * inv;
          yr[base + k * stride] = V::from(out);
        }
    });
    cluster_wait(cluster);
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    backward_streamed_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                             std::int64_t rows, std::int64_t cols, int cluster, acc_t<T> m) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  constexpr int kUPair = kU / 2;  // vectors of each operand per step: as many bytes as kU of one
  const Part part(cols / W, cluster);
  const std::int64_t nv = part.count, stride = blockDim.x;
  const auto plus = [](A a, A b) { return a + b; };
  for (std::int64_t row = blockIdx.x / cluster; row < rows; row += gridDim.x / cluster) {
    const std::int64_t offset = row * cols + part.begin * W;
    const V* yr = reinterpret_cast<const V*>(y + offset);
    const V* dyr = reinterpret_cast<const V*>(dy + offset);
    V* dxr = reinterpret_cast<V*>(dx + offset);
    A dot = 0;
#pragma unroll 1
    for (std::int64_t base = threadIdx.x; base < nv; base += kUPair * stride) {
      V yv[kUPair], dv[kUPair];
#pragma unroll
      for (int k = 0; k < kUPair; ++k)
        if (base + k * stride < nv) {
          yv[k] = yr[base + k * stride];
          dv[k] = dyr[base + k * stride];
        }
#pragma unroll
      for (int k = 0; k < kUPair; ++k)
        if (base + k * stride < nv)
#pragma unroll
          for (int i = 0; i < W; ++i) dot += dv[k][i] * yv[k][i];
    }
    dot = cluster_allreduce(block_allreduce(dot, A(0), plus), cluster, plus);
#pragma unroll 1
    for (std::int64_t base = threadIdx.x; base < nv; base += kUPair * stride) {
      V yv[kUPair], dv[kUPair];
#pragma unroll
      for (int k = 0; k < kUPair; ++k)
        if (base + k * stride < nv) {
          yv[k] = yr[base + k * stride];
          dv[k] = dyr[base + k * stride];
        }
#pragma unroll
      for (int k = 0; k < kUPair; ++k)
        if (base + k * stride < nv) {
          A out[W];
#pragma unroll
          for (int i = 0; i < W; ++i) out[i] = m * yv[k][i] * (dv[k][i] - dot);
          dxr[base + k * stride] = V::from(out);
        }
    }
    cluster_wait(cluster);
  }
}

// How a resident kernel covers a row of nv vectors of `arrays` operands: the fewest blocks per
// row (a cluster) whose parts fit kPartBytes of shared memory, else the device's limit; cluster =
// 0 when the row does not fit in kMaxCluster blocks.
struct Plan {
  int cluster = 0, threads = 0;
  std::size_t shared_bytes = 0;
};

template <typename Kernel>
Plan plan_resident(Kernel* kernel, std::int64_t nv, int arrays, std::size_t part_bytes = kPartBytes,
                   int max_threads = kMaxThreads) {
  int device = 0, major = 0, optin = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute");
  cudaFuncAttributes attributes{};
  check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
  // Clusters need sm_90 both in the device and in the kernel's compiled code.
  const int max_cluster = major >= 9 && attributes.binaryVersion >= 90 ? kMaxCluster : 1;
  const std::size_t device_limit = static_cast<std::size_t>(optin) - attributes.sharedSizeBytes;
  const std::size_t slot = sizeof(uint4) * static_cast<std::size_t>(arrays);
  for (const std::size_t limit : {std::min(part_bytes, device_limit), device_limit})
    for (int cluster = 1; cluster <= max_cluster; ++cluster) {
      const std::int64_t per = (nv + cluster - 1) / cluster;
      if (static_cast<std::size_t>(per) * slot <= limit)
        return {cluster, std::min(max_threads, row_threads(per, 1)),
                static_cast<std::size_t>(per) * slot};
    }
  return {};
}

// One cluster of `plan.cluster` blocks per row (rows beyond the grid loop).
template <typename... P, typename... Args>
void launch_resident(void (*kernel)(P...), const Plan& plan, std::int64_t rows,
                     const Stream& stream, std::string_view op, Args... args) {
  launch_row_clusters(kernel, plan.cluster, plan.threads, plan.shared_bytes, rows, stream, op,
                      args...);
}

// TEMPORARY tuning variants (MESHFUSE_VARIANT_SOFTMAX_FWD / _BWD; removed after tuning): the
// resident kernel's part size and threads, or the streamed kernel over a cluster of blocks.
struct Variant {
  bool registers;  // the registers kernel, 4 vectors per thread, 512 threads (if the row fits)
  bool streamed;
  std::size_t part_bytes;  // resident
  int max_threads;         // resident
  int cluster;             // streamed: blocks per row (capped by the device)
};

constexpr Variant kForwardVariants[] = {
    {false, false, kPartBytes, kMaxThreads, 0},
    {false, false, 32 * 1024, kMaxThreads, 0},
    {false, false, 32 * 1024, 256, 0},
    {false, false, 96 * 1024, kMaxThreads, 0},
    {false, true, 0, 0, 4},
    {false, true, 0, 0, 8},
    {false, true, 0, 0, 1},
    {true, false, kPartBytes, kMaxThreads, 0},
};
constexpr Variant kBackwardVariants[] = {
    {false, false, kPartBytes, kMaxThreads, 0},
    {false, false, 96 * 1024, kMaxThreads, 0},
    {false, false, kPartBytes, 256, 0},
    {false, true, 0, 0, 4},
    {false, true, 0, 0, 8},
    {false, true, 0, 0, 1},
    {true, false, kPartBytes, kMaxThreads, 0},
};

constexpr int kRegistersPer = 4;

// The registers kernel's plan: the fewest blocks (<= 8, a cluster) of kMaxThreads threads
// holding kRegistersPer vectors each; cluster 0 when the row does not fit.
template <typename Kernel>
Plan plan_registers(Kernel* kernel, std::int64_t nv) {
  const int max_cluster = usable_cluster(kernel, kMaxCluster);
  for (int cluster = 1; cluster <= max_cluster; ++cluster) {
    const std::int64_t per = (nv + cluster - 1) / cluster;
    if (per <= std::int64_t{kRegistersPer} * kMaxThreads)
      return {cluster, row_threads(per, kRegistersPer), 0};
  }
  return {};
}

template <std::size_t K>
Variant pick(const Variant (&variants)[K], const char* name) {
  const int v = tuning_variant(name);
  return variants[v >= 0 && v < static_cast<int>(K) ? v : 0];
}

// The streamed kernel's plan: `cluster` blocks per row (1 without clusters), no shared memory.
template <typename Kernel>
Plan plan_streamed(Kernel* kernel, std::int64_t nv, int cluster) {
  cluster = static_cast<int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(usable_cluster(kernel, cluster), nv)));
  return {cluster, row_threads((nv + cluster - 1) / cluster, kU), 0};
}

template <typename T>
void forward(const SoftmaxShape& s, const T* x, T* y, double multiplier, const Stream& stream) {
  using A = acc_t<T>;
  const A scale = static_cast<A>(multiplier * kLog2e);
  const int w = vector_width<T>(s.cols, {x, y});
  const Variant v = pick(kForwardVariants, "MESHFUSE_VARIANT_SOFTMAX_FWD");
  if (w > 1 && v.registers) {
    const auto kernel = forward_registers_kernel<T, kRegistersPer>;
    const Plan plan = plan_registers(kernel, s.cols / w);
    if (plan.cluster > 0)
      return launch_resident(kernel, plan, s.rows, stream, "softmax", x, y, s.rows, s.cols,
                             plan.cluster, scale);
  }
  if (w > 1) {
    if (!v.streamed) {
      const Plan plan =
          plan_resident(forward_resident_kernel<T>, s.cols / w, 1, v.part_bytes, v.max_threads);
      if (plan.cluster > 0)
        return launch_resident(forward_resident_kernel<T>, plan, s.rows, stream, "softmax", x, y,
                               s.rows, s.cols, plan.cluster, scale);
    }
    const auto kernel = forward_streamed_kernel<T, kVec16<T>>;
    const Plan plan = plan_streamed(kernel, s.cols / w, v.streamed ? v.cluster : 1);
    return launch_resident(kernel, plan, s.rows, stream, "softmax", x, y, s.rows, s.cols,
                           plan.cluster, scale);
  }
  forward_streamed_kernel<T, 1><<<row_blocks(s.rows), row_threads(s.cols, kU), 0, native(stream)>>>(
      x, y, s.rows, s.cols, 1, scale);
}

template <typename T>
void backward(const SoftmaxShape& s, const T* dy, const T* y, T* dx, double multiplier,
              const Stream& stream) {
  using A = acc_t<T>;
  const A m = static_cast<A>(multiplier);
  const int w = vector_width<T>(s.cols, {dy, y, dx});
  const Variant v = pick(kBackwardVariants, "MESHFUSE_VARIANT_SOFTMAX_BWD");
  if (w > 1 && v.registers) {
    const auto kernel = backward_registers_kernel<T, kRegistersPer>;
    const Plan plan = plan_registers(kernel, s.cols / w);
    if (plan.cluster > 0)
      return launch_resident(kernel, plan, s.rows, stream, "softmax_backward", dy, y, dx, s.rows,
                             s.cols, plan.cluster, m);
  }
  if (w > 1) {
    if (!v.streamed) {
      const Plan plan =
          plan_resident(backward_resident_kernel<T>, s.cols / w, 2, v.part_bytes, v.max_threads);
      if (plan.cluster > 0)
        return launch_resident(backward_resident_kernel<T>, plan, s.rows, stream,
                               "softmax_backward", dy, y, dx, s.rows, s.cols, plan.cluster, m);
    }
    const auto kernel = backward_streamed_kernel<T, kVec16<T>>;
    const Plan plan = plan_streamed(kernel, s.cols / w, v.streamed ? v.cluster : 1);
    return launch_resident(kernel, plan, s.rows, stream, "softmax_backward", dy, y, dx, s.rows,
                           s.cols, plan.cluster, m);
  }
  backward_streamed_kernel<T, 1>
      <<<row_blocks(s.rows), row_threads(s.cols, kU), 0, native(stream)>>>(dy, y, dx, s.rows,
                                                                           s.cols, 1, m);
}

}  // namespace

void softmax_forward(const SoftmaxShape& s, const void* x, void* y, double multiplier,
                     const Stream& stream) {
  if (s.rows * s.cols == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "softmax", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    forward(s, static_cast<const T*>(x), static_cast<T*>(y), multiplier, stream);
  });
  check_launch("softmax");
}

void softmax_backward(const SoftmaxShape& s, const void* grad_y, const void* y, void* grad_x,
                      double multiplier, const Stream& stream) {
  if (s.rows * s.cols == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "softmax_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    backward(s, static_cast<const T*>(grad_y), static_cast<const T*>(y), static_cast<T*>(grad_x),
             multiplier, stream);
  });
  check_launch("softmax_backward");
}

}  // namespace meshfuse::detail::cuda
