// CUDA softmax. A row is read from memory once where it fits on chip: split over a cluster of up
// to 8 blocks (one block when it fits), whose statistics combine through distributed shared
// memory in rank order.
//
// Forward: each block copies its part into shared memory with cp.async (16-byte accesses, all in
// flight), takes the block's max (16-bit pairs packed), sums the exps against it and, after the
// cluster's combine, writes its part from shared memory. A cluster takes up to kForwardRows rows
// in turn: a thread copies the next row's vector into each slot as soon as it has written that
// slot's outputs, so the next part loads while this one is written, in the same shared memory.
// The kernel is bound by instruction issue as much as by memory, so the packed max, the division
// in the exponent and block-level statistics (no per-thread rescaling) each take instructions out.
// Backward (dx = m * y * (dy - sum dy * y)): y and dy held in registers, up to 4 vectors of each
// per thread of 512-thread blocks, the fastest form measured; rows too long for 8 such blocks take
// the shared-memory version. The forms tried and their figures: docs/kernels/softmax.md.
//
// Rows too long for 8 blocks' shared memory, and rows that are not whole aligned 16-byte vectors,
// take a streamed kernel: one block per row, an online pass for the statistics, then a second
// read (from L2) to write.
#include <cuda_pipeline_primitives.h>

#include <algorithm>

#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/cuda_logsumexp.cuh"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

// Row parts held in shared memory: up to 64 KB per block lets three 512-thread blocks share an
// SM (one fills its part while the others compute); longer parts, up to the device's limit,
// still read the row once, with fewer blocks per SM. 8 blocks: the portable cluster size.
constexpr std::size_t kPartBytes = 64 * 1024;
constexpr int kMaxCluster = 8;
// Rows each forward cluster takes in turn at large batches (the header says why; 4 measured
// faster than 2 or 8: docs/kernels/softmax.md).
constexpr std::int64_t kForwardRows = 4;

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

// Combines v over the blocks of the cluster in rank order (every block gets the same bits), then
// signals that this block has read the others; cluster_wait() must follow before the block
// reduces again or exits, so that no block's shared memory goes while another reads it.
template <typename V, typename F>
__device__ V cluster_allreduce(V v, int cluster, F combine_fn) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) {
    __shared__ V slot;
    if (threadIdx.x == 0) slot = v;
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
    v = *static_cast<V*>(__cluster_map_shared_rank(&slot, 0));
    for (int r = 1; r < cluster; ++r)
      v = combine_fn(v, *static_cast<V*>(__cluster_map_shared_rank(&slot, r)));
    __cluster_barrier_arrive();
  }
#endif
  return v;
}

__device__ __forceinline__ void cluster_wait(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) __cluster_barrier_wait();
#endif
}

// The largest u = x * scale (units_scale) over this thread's vectors of a part. 16-bit pairs with a
// finite scale > 0 take their maximum packed (one max.bf16x2 / max.f16x2 per pair, no conversion)
// and are scaled once: the same value, since rounding x * scale is monotonic in x, and NaNs are
// skipped either way.
template <typename T, typename V>
__device__ __forceinline__ acc_t<T> thread_max(const V* xs, int count, acc_t<T> scale) {
  using A = acc_t<T>;
  if constexpr (V::kPaired) {
    if (scale > 0 && scale < std::numeric_limits<A>::infinity()) {
      constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
      using P = std::conditional_t<kBf16, __nv_bfloat162, __half2>;
      const unsigned neg_inf_pair = kBf16 ? 0xff80ff80u : 0xfc00fc00u;
      P m;
      std::memcpy(&m, &neg_inf_pair, sizeof(m));
#pragma unroll 4
      for (int j = threadIdx.x; j < count; j += blockDim.x) {
        const V v = xs[j];
#pragma unroll
        for (int i = 0; i < V::kWords; ++i) {
          P p;
          std::memcpy(&p, &v.w[i], sizeof(p));
          m = __hmax2(m, p);
        }
      }
      return fmax(__low2float(m), __high2float(m)) * scale;
    }
  }
  A max = neg_inf<A>();
#pragma unroll 4
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    const V v = xs[j];
#pragma unroll
    for (int i = 0; i < kVec16<T>; ++i) max = fmax(max, v[i] * scale);
  }
  return max;
}

// e / sum, given inv = 1 / sum. f32 and f64 rows: e * inv corrected once by its residual
// e - q * sum (exact in an fma), which gives the correctly rounded quotient as PyTorch's division
// does (Markstein), where e * inv alone is off by up to an ulp. 16-bit rows: e * inv, far below
// their output's rounding.
template <typename T, typename A>
__device__ __forceinline__ A divide(A e, A sum, A inv) {
  const A q = e * inv;
  if constexpr (kBase2<T>)
    return q;
  else
    return fma(fma(-q, sum, e), inv, q);
}

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// exp(v * scale - shift) for an output. f32 and f64 rows correct the rounding of the argument:
// rounding v * scale - shift moves it by up to half its ulp, which for values far below the max
// (|v * scale - shift| of 16 and more) is a relative error of 16 * 2^-24 in the exp and so in the
// output, the largest part of PyTorch's error. The exact residuals (the product's by an fma, the
// differences' by Knuth's TwoSum, TAOCP 4.2.2; the _rn intrinsics keep the compiler from fusing
// them) are added back into the argument d2, and what rounding d2 leaves, r, multiplies the exp by
// (1 + r): with a multiplier other than 1 the product's residual alone can reach half an ulp of a
// large v * scale, too large for that first-order factor. 16-bit rows: far below their output's
// rounding.
template <typename A>
__device__ __forceinline__ A two_sum_error(A a, A b, A s) {
  const A back = add_rn(s, -a);
  return add_rn(add_rn(a, -add_rn(s, -back)), add_rn(b, -back));
}

template <typename T, typename A>
__device__ __forceinline__ A exp_shifted(A v, A scale, A shift) {
  if constexpr (kBase2<T>) {
    return exp_units<T>(v * scale - shift);
  } else {
    const A p = mul_rn(v, scale), p_err = fma(v, scale, -p);
    const A d = add_rn(p, -shift);
    // An infinite or NaN argument (v or shift infinite, or a NaN) takes no correction: its
    // residuals are NaN, and its exp is 0, inf or NaN as it is.
    const A t = isfinite(d) ? add_rn(two_sum_error(p, -shift, d), p_err) : A(0);
    const A d2 = add_rn(d, t), r = two_sum_error(d, t, d2);
    const A e = exp_units<T>(d2);
    return isfinite(d2) ? fma(e, r, e) : e;
  }
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
  const auto max_fn = [](A a, A b) { return fmax(a, b); };
  const auto plus = [](A a, A b) { return a + b; };
  const std::int64_t step = gridDim.x / cluster;
  const auto part_of = [&](std::int64_t r) {
    return reinterpret_cast<const V*>(x + r * cols) + part.begin;
  };
  std::int64_t row = blockIdx.x / cluster;
  if (row < rows) fetch_own(xs, part_of(row), part.count);
  for (; row < rows; row += step) {
    fetch_wait();
    // The block's max first, then one exp per value against it: the part is at hand, and only
    // the cluster's few block sums need rescaling. f32 and f64 rows take the cluster's max first
    // (one cluster barrier more) and rescale nothing: a rescaled block sum carries its exp's
    // rounding (up to 2 ulp) into every output of the row.
    A max = block_allreduce(thread_max<T>(xs, part.count, scale), neg_inf<A>(), max_fn);
    if constexpr (!kBase2<T>) {
      max = cluster_allreduce(max, cluster, max_fn);
      cluster_wait(cluster);
    }
    const A sh = shift(max);
    A sum = 0;
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V v = xs[j];
#pragma unroll
      for (int i = 0; i < W; ++i) sum += exp_units<T>(v[i] * scale - sh);
    }
    RowStats<A> st{max, block_allreduce(sum, A(0), plus), A(0)};
    if constexpr (kBase2<T>)
      st = cluster_allreduce(
          st, cluster, [](const RowStats<A>& a, const RowStats<A>& b) { return combine<T>(a, b); });
    else
      st.sum = cluster_allreduce(st.sum, cluster, plus);
    // A row entirely -inf has max -inf: exp(-inf + inf) = NaN, as PyTorch.
    V* yr = reinterpret_cast<V*>(y + row * cols) + part.begin;
    // 16-bit outputs divide in the exponent, 2^(u - (max + log2 sum)): one multiply less per
    // value. Rounding max + log2 sum adds up to half an ulp of it to the exponent, as rounding u
    // itself does: a relative error of 2^-24 |max + log2 sum| ln 2, far below a 16-bit half ulp
    // for logits of the usual sizes (|u| < 2^8: under 2^-16). f32 and f64 divide (divide).
    const bool in_exponent = kBase2<T>;
    const A offset = in_exponent ? st.max + log2(st.sum) : st.max;
    const A inv = in_exponent ? A(1) : A(1) / st.sum;
    const V* next = row + step < rows ? part_of(row + step) : nullptr;
#pragma unroll 4
    for (int j = threadIdx.x; j < part.count; j += blockDim.x) {
      const V v = xs[j];
      A out[W];
#pragma unroll
      for (int i = 0; i < W; ++i) {
        out[i] = exp_shifted<T>(v[i], scale, offset);
        if (!in_exponent) out[i] = divide<T>(out[i], st.sum, inv);
      }
      yr[j] = V::from(out);
      // The slot is free: its value went into the store just issued.
      if (next) __pipeline_memcpy_async(xs + j, next + j, sizeof(V));
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

// A row split over a cluster of blocks, each thread holding up to P vectors of y and of dy of
// its block's part in registers (loaded at once).
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

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    forward_streamed_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t rows,
                            std::int64_t cols, acc_t<T> scale) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  const std::int64_t nv = cols / W, stride = blockDim.x;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const RowStats<A> st = block_stats<T>(thread_row_stats<T, W, false>(x + row * cols, nv, scale));
    const A inv = A(1) / st.sum;
    V* yr = reinterpret_cast<V*>(y + row * cols);
    stream_row(reinterpret_cast<const V*>(x + row * cols), nv,
               [&](const V(&v)[kU], std::int64_t base) {
#pragma unroll
                 for (int k = 0; k < kU; ++k)
                   if (base + k * stride < nv) {
                     A out[W];
#pragma unroll
                     for (int i = 0; i < W; ++i)
                       out[i] = divide<T>(exp_shifted<T>(v[k][i], scale, st.max), st.sum, inv);
                     yr[base + k * stride] = V::from(out);
                   }
               });
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    backward_streamed_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                             std::int64_t rows, std::int64_t cols, acc_t<T> m) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  constexpr int kUPair = kU / 2;  // vectors of each operand per step: as many bytes as kU of one
  const std::int64_t nv = cols / W, stride = blockDim.x;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const V* yr = reinterpret_cast<const V*>(y + row * cols);
    const V* dyr = reinterpret_cast<const V*>(dy + row * cols);
    V* dxr = reinterpret_cast<V*>(dx + row * cols);
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
    dot = block_allreduce(dot, A(0), [](A a, A b) { return a + b; });
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
  }
}

// A launch of a kernel that holds rows on chip: `cluster` blocks per row (0: the row does not
// fit), `threads` per block, `shared_bytes` of dynamic shared memory.
struct Plan {
  int cluster = 0, threads = 0;
  std::size_t shared_bytes = 0;
};

// What the current device allows `kernel`: blocks per cluster (clusters need sm_90 both in the
// device and in the kernel's compiled code) and dynamic shared memory per block.
struct Limits {
  int max_cluster;
  std::size_t shared_bytes;
};

template <typename Kernel>
Limits limits(Kernel* kernel) {
  return remembered(reinterpret_cast<const void*>(kernel), [&] {
    int device = 0, major = 0, optin = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute");
    cudaFuncAttributes attributes{};
    check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
    return Limits{major >= 9 && attributes.binaryVersion >= 90 ? kMaxCluster : 1,
                  static_cast<std::size_t>(optin) - attributes.sharedSizeBytes};
  });
}

// How a shared-memory kernel covers a row of nv vectors of `arrays` operands: the fewest blocks
// per row (a cluster) whose parts fit kPartBytes of shared memory, else the device's limit.
template <typename Kernel>
Plan plan_resident(Kernel* kernel, std::int64_t nv, int arrays) {
  const Limits l = limits(kernel);
  const std::size_t slot = sizeof(uint4) * static_cast<std::size_t>(arrays);
  for (const std::size_t limit : {kPartBytes, l.shared_bytes})
    for (int cluster = 1; cluster <= l.max_cluster; ++cluster) {
      const std::int64_t per = (nv + cluster - 1) / cluster;
      if (static_cast<std::size_t>(per) * slot <= limit)
        return {cluster, row_threads(per, 1), static_cast<std::size_t>(per) * slot};
    }
  return {};
}

// A launch of a row-resident kernel: its plan and how many of its clusters the GPU holds at a
// time (0 when there is no plan: cluster == 0; only the forward uses it, to spread its rows).
struct Launch {
  Plan plan;
  std::int64_t resident_clusters = 0;
};

// make_plan()'s plan for `kernel` on rows of nv vectors, worked out once per device, kernel and nv:
// the plan's limits, the shared-memory allowance and the occupancy are driver queries, each about
// a launch's host time, and a small softmax's call is mostly host time. The kernel is allowed all
// the dynamic shared memory the device has (past 48 KB it must be allowed first; each launch still
// asks for its plan's bytes only).
template <typename Kernel, typename MakePlan>
Launch launch_for(Kernel* kernel, std::int64_t nv, std::string_view op, MakePlan&& make_plan) {
  return remembered(std::pair{reinterpret_cast<const void*>(kernel), nv}, [&] {
    Launch l{make_plan()};
    if (l.plan.cluster == 0) return l;
    if (l.plan.shared_bytes > 0)
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(limits(kernel).shared_bytes)),
            op);
    int blocks = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, l.plan.threads,
                                                        l.plan.shared_bytes),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    l.resident_clusters =
        std::max<std::int64_t>(1, std::int64_t{sm_count()} * blocks / l.plan.cluster);
    return l;
  });
}

// One cluster of `plan.cluster` blocks per `rows_per_cluster` rows (rows beyond the grid loop).
// The plan comes from launch_for, which has allowed the kernel its shared memory.
template <typename... P, typename... Args>
void launch_resident(void (*kernel)(P...), const Plan& plan, std::int64_t rows,
                     std::int64_t rows_per_cluster, const Stream& stream, std::string_view op,
                     Args... args) {
  cudaLaunchConfig_t config{};
  const std::int64_t clusters = (rows + rows_per_cluster - 1) / rows_per_cluster;
  config.gridDim = dim3(row_blocks(std::min<std::int64_t>(clusters, std::int64_t{1} << 27)) *
                        static_cast<unsigned>(plan.cluster));
  config.blockDim = dim3(static_cast<unsigned>(plan.threads));
  config.dynamicSmemBytes = plan.shared_bytes;
  config.stream = native(stream);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = plan.cluster > 1 ? 1 : 0;
  check(cudaLaunchKernelEx(&config, kernel, args...), op);
}

// Vectors of y and of dy per thread in the backward's registers kernel.
constexpr int kRegistersPer = 4;

// The registers kernel's plan: the fewest blocks (<= 8, a cluster) of kMaxThreads threads
// holding kRegistersPer vectors each.
template <typename Kernel>
Plan plan_registers(Kernel* kernel, std::int64_t nv) {
  const int max_cluster = limits(kernel).max_cluster;
  for (int cluster = 1; cluster <= max_cluster; ++cluster) {
    const std::int64_t per = (nv + cluster - 1) / cluster;
    if (per <= std::int64_t{kRegistersPer} * kMaxThreads)
      return {cluster, row_threads(per, kRegistersPer), 0};
  }
  return {};
}

template <typename T>
void forward(const SoftmaxShape& s, const T* x, T* y, double multiplier, const Stream& stream) {
  using A = acc_t<T>;
  const A scale = static_cast<A>(units_scale<T>(multiplier));
  const int w = vector_width<T>(s.cols, {x, y});
  if (w > 1) {
    const auto kernel = forward_resident_kernel<T>;
    const std::int64_t nv = s.cols / w;
    const Launch l =
        launch_for(kernel, nv, "softmax", [&] { return plan_resident(kernel, nv, 1); });
    // kForwardRows rows per cluster once every cluster the GPU holds at a time gets that many;
    // fewer for smaller batches, which need all the clusters they can have.
    if (l.plan.cluster > 0)
      return launch_resident(
          kernel, l.plan, s.rows,
          std::clamp<std::int64_t>(s.rows / l.resident_clusters, 1, kForwardRows), stream,
          "softmax", x, y, s.rows, s.cols, l.plan.cluster, scale);
  }
  const auto launch = [&](auto kernel, int width) {
    kernel<<<row_blocks(s.rows), row_threads(s.cols / width, kU), 0, native(stream)>>>(
        x, y, s.rows, s.cols, scale);
  };
  if (w > 1)
    launch(forward_streamed_kernel<T, kVec16<T>>, w);
  else
    launch(forward_streamed_kernel<T, 1>, 1);
}

template <typename T>
void backward(const SoftmaxShape& s, const T* dy, const T* y, T* dx, double multiplier,
              const Stream& stream) {
  using A = acc_t<T>;
  const A m = static_cast<A>(multiplier);
  const int w = vector_width<T>(s.cols, {dy, y, dx});
  if (w > 1) {
    const auto registers = backward_registers_kernel<T, kRegistersPer>;
    const auto resident = backward_resident_kernel<T>;
    const std::int64_t nv = s.cols / w;
    const std::string_view op = "softmax_backward";
    Launch l = launch_for(registers, nv, op, [&] { return plan_registers(registers, nv); });
    if (l.plan.cluster > 0)
      return launch_resident(registers, l.plan, s.rows, 1, stream, op, dy, y, dx, s.rows, s.cols,
                             l.plan.cluster, m);
    l = launch_for(resident, nv, op, [&] { return plan_resident(resident, nv, 2); });
    if (l.plan.cluster > 0)
      return launch_resident(resident, l.plan, s.rows, 1, stream, op, dy, y, dx, s.rows, s.cols,
                             l.plan.cluster, m);
  }
  const auto launch = [&](auto kernel, int width) {
    kernel<<<row_blocks(s.rows), row_threads(s.cols / width, kU), 0, native(stream)>>>(
        dy, y, dx, s.rows, s.cols, m);
  };
  if (w > 1)
    launch(backward_streamed_kernel<T, kVec16<T>>, w);
  else
    launch(backward_streamed_kernel<T, 1>, 1);
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
