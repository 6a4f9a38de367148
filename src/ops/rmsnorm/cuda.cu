// CUDA RMSNorm.
// Forward: one block per row, each thread holding up to kForwardPer 16-byte vectors of the row (x
// and residual as stored; 256 threads x 2 vectors at bf16 H = 4096) across the block reduction of
// sum(r^2), then writing y and r: every row is read once.
// Backward: each block walks a fixed range of rows with one 16-byte vector per thread per row (512
// threads at bf16 H = 4096), the next row's loads in flight while the current row is reduced and
// written. Each thread sums dy * n for its columns in registers and writes the block's partial
// row once; a second kernel adds the partial rows in a fixed order. No float atomics, and
// dweight's bits depend on the shape only (not on the vector width or the device).
// Rows too wide for registers take the "streaming" variants, which read the row again after the
// reduction (from L2). Widths that are not a multiple of the vector, or rows that are not 16-byte
// aligned, use one element per vector.
#include <cuda_pipeline_primitives.h>

#include <algorithm>

#include "core/cuda/cuda_utils.cuh"
#include "meshfuse/core/tensor.h"
#include "ops/common.h"
#include "ops/rmsnorm/rmsnorm_kernels.h"
#include "ops/softmax/cuda_logsumexp.cuh"

namespace meshfuse::detail::cuda {
namespace {

constexpr int kForwardPer = 2;  // rows up to 2048 vectors (bf16 H = 16384) stay in registers
constexpr int kForwardThreads = 1024;
constexpr int kBackwardThreads = 1024;  // one vector per thread: bf16 rows up to 8192 in registers
constexpr int kReduceLanes = 32;        // partial rows summed in parallel per column in dweight

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const void* base, std::int64_t off) {
  return *reinterpret_cast<const Vec<T, N>*>(static_cast<const T*>(base) + off);
}

// Stored elements stay packed (16-bit pairs in 32-bit words) until used: half the registers.
template <typename T, int N>
__device__ __forceinline__ Chunk<T, N> load_chunk(const void* base, std::int64_t off) {
  return *reinterpret_cast<const Chunk<T, N>*>(static_cast<const T*>(base) + off);
}

template <typename T, int N, typename A>
__device__ __forceinline__ void store_vec(void* base, std::int64_t off, const A (&v)[N]) {
  Vec<T, N> out;
#pragma unroll
  for (int k = 0; k < N; ++k) out.v[k] = store<T>(v[k]);
  *reinterpret_cast<Vec<T, N>*>(static_cast<T*>(base) + off) = out;
}

// The weight at columns c.. as stored; ones when absent (multiplying by 1 is exact).
template <typename T, int N>
__device__ __forceinline__ Chunk<T, N> weight_vec(const void* weight, std::int64_t c) {
  if (weight) return load_chunk<T, N>(weight, c);
  acc_t<T> ones[N];
#pragma unroll
  for (int k = 0; k < N; ++k) ones[k] = 1;
  return Chunk<T, N>::from(ones);
}

// Sum of v over the block (blockDim.x a multiple of 32), in a fixed order; every thread gets it.
// `scratch` holds one value per warp.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  if (warps == 1) return v;
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : A(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A>
__device__ __forceinline__ A inverse_rms(A sum_sq, std::int64_t cols, A eps) {
  return A(1) / sqrt(sum_sq / A(cols) + eps);
}

// ---- forward ----

// r = x * multiplier + residual from the stored vectors.
template <typename T, int N, typename A>
__device__ __forceinline__ void pre_norm(const Chunk<T, N>& x, const Chunk<T, N>& res,
                                         bool residual, A m, A (&r)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) r[k] = x[k] * m + (residual ? res[k] : A(0));
}

// Writes r (when the op outputs it) and y = r * rstd * weight at element offset off.
template <typename T, int N, typename A>
__device__ __forceinline__ void write_out(const RmsNormForwardArgs& a, std::int64_t off,
                                          const A (&r)[N], A rstd, const Chunk<T, N>& w) {
  if (a.r) store_vec<T, N>(a.r, off, r);
  A y[N];
#pragma unroll
  for (int k = 0; k < N; ++k) y[k] = r[k] * rstd * w[k];
  store_vec<T, N>(a.y, off, y);
}

template <typename T, int N>
__global__ void __launch_bounds__(kForwardThreads)
    forward_kernel(RmsNormShape s, RmsNormForwardArgs a) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const A m = static_cast<A>(a.multiplier), eps = static_cast<A>(a.eps);
  // Resident rows are short: 32-bit column offsets.
  const int cols = static_cast<int>(s.cols);
  const auto col = [&](int i) { return static_cast<int>((threadIdx.x + i * blockDim.x) * N); };
  for (std::int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const std::int64_t base = row * s.cols;
    const T* x_row = static_cast<const T*>(a.x) + base;
    const T* res_row = a.residual ? static_cast<const T*>(a.residual) + base : nullptr;
    // The row stays in registers as stored (half the registers of fp32 for 16-bit types); r is
    // formed from it twice, with the same operations, so y and r see the same unrounded r.
    Chunk<T, N> x[kForwardPer], res[kForwardPer];
#pragma unroll
    for (int i = 0; i < kForwardPer; ++i)
      if (col(i) < cols) {
        x[i] = load_chunk<T, N>(x_row, col(i));
        if (res_row) res[i] = load_chunk<T, N>(res_row, col(i));
      }
    A sum_sq = 0;
#pragma unroll
    for (int i = 0; i < kForwardPer; ++i)
      if (col(i) < cols) {
        A r[N];
        pre_norm<T, N>(x[i], res[i], a.residual != nullptr, m, r);
#pragma unroll
        for (int k = 0; k < N; ++k) sum_sq += r[k] * r[k];
      }
    const A rstd = inverse_rms(block_sum(sum_sq, scratch), s.cols, eps);
    if (a.rstd && threadIdx.x == 0) a.rstd[row] = static_cast<float>(rstd);
#pragma unroll
    for (int i = 0; i < kForwardPer; ++i)
      if (col(i) < cols) {
        A r[N];
        pre_norm<T, N>(x[i], res[i], a.residual != nullptr, m, r);
        write_out<T, N>(a, base + col(i), r, rstd, weight_vec<T, N>(a.weight, col(i)));
      }
  }
}

// Rows wider than kForwardThreads * kForwardPer vectors: read once for the sum, once more to write.
template <typename T, int N>
__global__ void __launch_bounds__(kForwardThreads)
    forward_streaming_kernel(RmsNormShape s, RmsNormForwardArgs a) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const A m = static_cast<A>(a.multiplier), eps = static_cast<A>(a.eps);
  const std::int64_t first = std::int64_t{threadIdx.x} * N, step = std::int64_t{blockDim.x} * N;
  const Chunk<T, N> none{};
  const auto load_r = [&](std::int64_t off, A(&r)[N]) {
    pre_norm<T, N>(load_chunk<T, N>(a.x, off),
                   a.residual ? load_chunk<T, N>(a.residual, off) : none, a.residual != nullptr, m,
                   r);
  };
  for (std::int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const std::int64_t base = row * s.cols;
    A sum_sq = 0;
    for (std::int64_t c = first; c < s.cols; c += step) {
      A r[N];
      load_r(base + c, r);
#pragma unroll
      for (int k = 0; k < N; ++k) sum_sq += r[k] * r[k];
    }
    const A rstd = inverse_rms(block_sum(sum_sq, scratch), s.cols, eps);
    if (a.rstd && threadIdx.x == 0) a.rstd[row] = static_cast<float>(rstd);
    for (std::int64_t c = first; c < s.cols; c += step) {
      A r[N];
      load_r(base + c, r);
      write_out<T, N>(a, base + c, r, rstd, weight_vec<T, N>(a.weight, c));
    }
  }
}

// ---- backward ----

// One thread's N columns of one row as stored, and the row's rstd.
template <typename T, int N>
struct Slice {
  Chunk<T, N> dy, in, gr;
  float rstd;
};

template <typename T, int N>
__device__ __forceinline__ Slice<T, N> load_slice(const RmsNormBackwardArgs& a, std::int64_t row,
                                                  std::int64_t off) {
  Slice<T, N> v{};
  v.rstd = a.rstd[row];
  v.dy = load_chunk<T, N>(a.grad_y, off);
  v.in = load_chunk<T, N>(a.input, off);
  if (a.grad_r) v.gr = load_chunk<T, N>(a.grad_r, off);
  return v;
}

// The slice's share of sum(dn * n), with n = input * input_scale * rstd and dn = dy * weight.
template <typename T, int N, typename A>
__device__ __forceinline__ A dot_share(const Slice<T, N>& v, const Chunk<T, N>& w, A scale) {
  A dot = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) dot += v.dy[k] * w[k] * (v.in[k] * scale);
  return dot;
}

// dr = rstd * (dn - n * mean) + grad_r; writes dx = dr * multiplier and dresidual = dr, and adds
// dy * n to acc (an explicit fma, so every kernel rounds dweight's terms alike).
template <typename T, int N, typename A>
__device__ __forceinline__ void write_grads(const RmsNormBackwardArgs& a, std::int64_t off,
                                            const Slice<T, N>& v, const Chunk<T, N>& w, A scale,
                                            A mean, A (&acc)[N]) {
  const A rstd = v.rstd, m = static_cast<A>(a.multiplier);
  A dr[N], dx[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const A g = v.dy[k], n = v.in[k] * scale;
    dr[k] = rstd * (g * w[k] - n * mean) + (a.grad_r ? v.gr[k] : A(0));
    dx[k] = dr[k] * m;
    acc[k] = fma(g, n, acc[k]);
  }
  store_vec<T, N>(a.dx, off, dx);
  if (a.dresidual) store_vec<T, N>(a.dresidual, off, dr);
}

// Block b handles rows [b * rows_per_block, (b + 1) * rows_per_block) and, when partials is not
// null, writes their sum of dy * n to partials row b.
template <typename T, int N>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_kernel(RmsNormShape s, RmsNormBackwardArgs a, std::int64_t rows_per_block,
                    acc_t<T>* partials) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const std::int64_t c = std::int64_t{threadIdx.x} * N;
  const bool active = c < s.cols;
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t end = std::min(s.rows, first + rows_per_block);
  const Chunk<T, N> w = active ? weight_vec<T, N>(a.weight, c) : Chunk<T, N>{};
  A acc[N] = {};
  Slice<T, N> cur{};
  if (active) cur = load_slice<T, N>(a, first, first * s.cols + c);
  for (std::int64_t row = first; row < end; ++row) {
    // The next row's loads are in flight while this row is reduced and written.
    Slice<T, N> next{};
    if (active && row + 1 < end) next = load_slice<T, N>(a, row + 1, (row + 1) * s.cols + c);
    const A scale = static_cast<A>(a.input_scale) * A(cur.rstd);
    const A mean = block_sum(active ? dot_share(cur, w, scale) : A(0), scratch) / A(s.cols);
    if (active) write_grads<T, N>(a, row * s.cols + c, cur, w, scale, mean, acc);
    cur = next;
  }
  if (partials && active) store_vec<A, N>(partials, blockIdx.x * s.cols + c, acc);
}

// Rows wider than kBackwardThreads vectors: the same rows per block and the same dweight terms in
// the same order (so the same bits), with the row read again after the reduction and the partial
// sums kept in the partials row itself.
template <typename T, int N>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_streaming_kernel(RmsNormShape s, RmsNormBackwardArgs a, std::int64_t rows_per_block,
                              acc_t<T>* partials) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const std::int64_t start = std::int64_t{threadIdx.x} * N, step = std::int64_t{blockDim.x} * N;
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t end = std::min(s.rows, first + rows_per_block);
  A* partial = partials ? partials + blockIdx.x * s.cols : nullptr;
  for (std::int64_t row = first; row < end; ++row) {
    const std::int64_t base = row * s.cols;
    const A scale = static_cast<A>(a.input_scale) * A(a.rstd[row]);
    A dot = 0;
    for (std::int64_t c = start; c < s.cols; c += step) {
      dot += dot_share(load_slice<T, N>(a, row, base + c), weight_vec<T, N>(a.weight, c), scale);
    }
    const A mean = block_sum(dot, scratch) / A(s.cols);
    for (std::int64_t c = start; c < s.cols; c += step) {
      A acc[N] = {};
      if (partial && row > first) {
        const Vec<A, N> p = load_vec<A, N>(partial, c);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = p.v[k];
      }
      write_grads<T, N>(a, base + c, load_slice<T, N>(a, row, base + c),
                        weight_vec<T, N>(a.weight, c), scale, mean, acc);
      if (partial) store_vec<A, N>(partial, c, acc);
    }
  }
}

// dweight[c] = sum over b of partials[b][c]: lane y of a block adds the rows b = y (mod
// kReduceLanes) in order (8 loads in flight at a time), then lane 0 adds the lanes in order. A
// function of the shape only.
template <typename T>
__global__ void __launch_bounds__(32 * kReduceLanes)
    dweight_kernel(const acc_t<T>* __restrict__ partials, std::int64_t blocks, std::int64_t cols,
                   T* __restrict__ dweight) {
  using A = acc_t<T>;
  constexpr int kBatch = 8;
  __shared__ A lanes[kReduceLanes][32];
  const std::int64_t c = std::int64_t{blockIdx.x} * 32 + threadIdx.x;
  A sum = 0;
  if (c < cols) {
    std::int64_t b = threadIdx.y;
    for (; b + (kBatch - 1) * kReduceLanes < blocks; b += kBatch * kReduceLanes) {
      A v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) v[u] = partials[(b + u * kReduceLanes) * cols + c];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) sum += v[u];
    }
    for (; b < blocks; b += kReduceLanes) sum += partials[b * cols + c];
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  A total = 0;
#pragma unroll
  for (int y = 0; y < kReduceLanes; ++y) total += lanes[y][threadIdx.x];
  dweight[c] = store<T>(total);
}

// ---- TEMPORARY tuning variants (MESHFUSE_VARIANT_RMSNORM_FWD / _BWD; removed after tuning) ----


// Sum of v over a group of g threads (g / 32 warps, consecutive), one barrier: warp sums go to
// scratch[parity] (callers alternate parity from one reduction to the next, so a slow reader of
// the previous one is never overwritten), then every thread adds its group's warps in order.
template <typename A>
__device__ __forceinline__ A group_sum(A v, A (*scratch)[32], int g, int parity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (g == 32) return v;
  const int warp = threadIdx.x / 32, first = warp - (threadIdx.x % g) / 32;
  if (threadIdx.x % 32 == 0) scratch[parity][warp] = v;
  __syncthreads();
  A total = 0;
  for (int w = 0; w < g / 32; ++w) total += scratch[parity][first + w];
  return total;
}

// Forward: groups of G threads per row (B / G rows per block), P vectors per thread; one
// barrier (none for G = 32).
template <typename T, int N, int G, int P, int B>
__global__ void __launch_bounds__(B) forward_group_kernel(RmsNormShape s, RmsNormForwardArgs a) {
  using A = acc_t<T>;
  __shared__ A scratch[1][32];
  const A m = static_cast<A>(a.multiplier), eps = static_cast<A>(a.eps);
  const int cols = static_cast<int>(s.cols), t = threadIdx.x % G;
  const std::int64_t row = std::int64_t{blockIdx.x} * (B / G) + threadIdx.x / G;
  const bool live = row < s.rows;
  const auto col = [&](int i) { return (t + i * G) * N; };
  const std::int64_t base = live ? row * s.cols : 0;
  const T* x_row = static_cast<const T*>(a.x) + base;
  const T* res_row = a.residual ? static_cast<const T*>(a.residual) + base : nullptr;
  Chunk<T, N> x[P], res[P];
#pragma unroll
  for (int i = 0; i < P; ++i)
    if (live && col(i) < cols) {
      x[i] = load_chunk<T, N>(x_row, col(i));
      if (res_row) res[i] = load_chunk<T, N>(res_row, col(i));
    }
  A sum_sq = 0;
#pragma unroll
  for (int i = 0; i < P; ++i)
    if (live && col(i) < cols) {
      A r[N];
      pre_norm<T, N>(x[i], res[i], a.residual != nullptr, m, r);
#pragma unroll
      for (int k = 0; k < N; ++k) sum_sq += r[k] * r[k];
    }
  const A rstd = inverse_rms(group_sum(sum_sq, scratch, G, 0), s.cols, eps);
  if (!live) return;
  if (a.rstd && t == 0) a.rstd[row] = static_cast<float>(rstd);
#pragma unroll
  for (int i = 0; i < P; ++i)
    if (col(i) < cols) {
      A r[N];
      pre_norm<T, N>(x[i], res[i], a.residual != nullptr, m, r);
      write_out<T, N>(a, base + col(i), r, rstd, weight_vec<T, N>(a.weight, col(i)));
    }
}

// One thread's P vectors of one row.
template <typename T, int N, int P>
struct SliceP {
  Slice<T, N> v[P];
};

// Backward: one block of blockDim.x threads per range of rows (as backward_kernel, so dweight
// gets the same bits for the same rows per block), P vectors per thread, the loads of the next
// D rows in flight, one barrier per row.
template <typename T, int N, int P, int D>
__global__ void __launch_bounds__(512 / P)
    backward_group_kernel(RmsNormShape s, RmsNormBackwardArgs a, std::int64_t rows_per_block,
                          acc_t<T>* partials) {
  using A = acc_t<T>;
  __shared__ A scratch[2][32];
  const int cols = static_cast<int>(s.cols);
  const auto col = [&](int i) { return static_cast<int>((threadIdx.x + i * blockDim.x) * N); };
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t end = std::min(s.rows, first + rows_per_block);
  Chunk<T, N> w[P];
#pragma unroll
  for (int i = 0; i < P; ++i)
    w[i] = col(i) < cols ? weight_vec<T, N>(a.weight, col(i)) : Chunk<T, N>{};
  A acc[P][N] = {};
  const auto fetch = [&](std::int64_t row, SliceP<T, N, P>& sl) {
    if (row >= end) return;
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (col(i) < cols) sl.v[i] = load_slice<T, N>(a, row, row * s.cols + col(i));
  };
  SliceP<T, N, P> ring[D + 1];
#pragma unroll
  for (int k = 0; k < D; ++k) fetch(first + k, ring[k]);
  for (std::int64_t row = first; row < end; row += D + 1) {
#pragma unroll
    for (int k = 0; k <= D; ++k) {
      const std::int64_t r = row + k;
      if (r >= end) break;
      fetch(r + D, ring[(k + D) % (D + 1)]);
      const SliceP<T, N, P>& cur = ring[k];
      const A scale = static_cast<A>(a.input_scale) * A(cur.v[0].rstd);
      A dot = 0;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (col(i) < cols) dot += dot_share(cur.v[i], w[i], scale);
      const A mean =
          group_sum(dot, scratch, blockDim.x, static_cast<int>((r - first) & 1)) / A(s.cols);
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (col(i) < cols)
          write_grads<T, N>(a, r * s.cols + col(i), cur.v[i], w[i], scale, mean, acc[i]);
    }
  }
  if (partials)
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (col(i) < cols) store_vec<A, N>(partials, blockIdx.x * s.cols + col(i), acc[i]);
}

// Backward with the next S - 1 rows in flight through cp.async into a ring of S row slots in
// shared memory (no registers held by loads in flight); a thread reads back only what it copied,
// so the data needs no barrier. Slot: [arrays][P][threads] vectors, then [threads] rstd copies.
template <typename T, int N, int P, int S>
__global__ void __launch_bounds__(512 / P)
    backward_async_kernel(RmsNormShape s, RmsNormBackwardArgs a, std::int64_t rows_per_block,
                          acc_t<T>* partials) {
  using A = acc_t<T>;
  using C = Chunk<T, N>;
  extern __shared__ uint4 ring_raw[];
  __shared__ A scratch[2][32];
  const int g = blockDim.x, t = threadIdx.x, arrays = a.grad_r ? 3 : 2;
  const std::size_t slot_bytes =
      static_cast<std::size_t>(arrays) * P * g * sizeof(C) + g * sizeof(float);
  char* ring = reinterpret_cast<char*>(ring_raw);
  const int cols = static_cast<int>(s.cols);
  const auto col = [&](int i) { return (t + i * g) * N; };
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t end = std::min(s.rows, first + rows_per_block);
  Chunk<T, N> w[P];
#pragma unroll
  for (int i = 0; i < P; ++i) w[i] = col(i) < cols ? weight_vec<T, N>(a.weight, col(i)) : C{};
  A acc[P][N] = {};
  const auto issue = [&](std::int64_t row) {
    if (row < end) {
      char* slot = ring + ((row - first) % S) * slot_bytes;
      C* c = reinterpret_cast<C*>(slot);
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (col(i) < cols) {
          const std::int64_t off = row * s.cols + col(i);
          __pipeline_memcpy_async(&c[i * g + t], static_cast<const T*>(a.grad_y) + off, sizeof(C));
          __pipeline_memcpy_async(&c[(P + i) * g + t], static_cast<const T*>(a.input) + off,
                                  sizeof(C));
          if (a.grad_r)
            __pipeline_memcpy_async(&c[(2 * P + i) * g + t], static_cast<const T*>(a.grad_r) + off,
                                    sizeof(C));
        }
      float* rs = reinterpret_cast<float*>(slot + arrays * P * g * sizeof(C));
      __pipeline_memcpy_async(&rs[t], a.rstd + row, sizeof(float));
    }
    __pipeline_commit();
  };
#pragma unroll
  for (int k = 0; k < S - 1; ++k) issue(first + k);
  for (std::int64_t row = first; row < end; ++row) {
    issue(row + S - 1);
    __pipeline_wait_prior(S - 1);
    const char* slot = ring + ((row - first) % S) * slot_bytes;
    const C* c = reinterpret_cast<const C*>(slot);
    const float rstd = reinterpret_cast<const float*>(slot + arrays * P * g * sizeof(C))[t];
    Slice<T, N> cur[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      cur[i].rstd = rstd;
      if (col(i) < cols) {
        cur[i].dy = c[i * g + t];
        cur[i].in = c[(P + i) * g + t];
        if (a.grad_r) cur[i].gr = c[(2 * P + i) * g + t];
      }
    }
    const A scale = static_cast<A>(a.input_scale) * A(rstd);
    A dot = 0;
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (col(i) < cols) dot += dot_share(cur[i], w[i], scale);
    const A mean = group_sum(dot, scratch, g, static_cast<int>((row - first) & 1)) / A(s.cols);
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (col(i) < cols)
        write_grads<T, N>(a, row * s.cols + col(i), cur[i], w[i], scale, mean, acc[i]);
  }
  if (partials)
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (col(i) < cols) store_vec<A, N>(partials, blockIdx.x * s.cols + col(i), acc[i]);
}

struct BackwardVariant {
  int per;          // vectors per thread (0: the original kernels)
  int depth;        // rows in flight (register prefetch) or ring slots (async)
  bool async;       // cp.async ring in shared memory
  int max_threads;  // per block
  int log2_blocks;  // about 2^log2_blocks / H blocks (shape only)
};

constexpr BackwardVariant kBackwardVariants[] = {
    {0, 1, false, 1024, 20}, {2, 1, false, 256, 21}, {1, 3, true, 512, 20},
    {1, 4, true, 512, 20},   {2, 3, true, 256, 20},  {2, 4, true, 256, 20},
};

// ---- launch ----

// Calls f(integral_constant<int, n>) for n = 1 or kVec16<T> (the only widths instantiated).
template <typename T, typename F>
void with_width(int n, F&& f) {
  if (n == 1)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, kVec16<T>>{});
}

struct Plan {
  int width;    // elements per vector
  int threads;  // per block
  bool resident;
};

// 16-byte vectors when the width allows them and every row start is 16-byte aligned; enough
// threads (a multiple of a warp) for `per` vectors each, else the streaming kernel at max_threads.
template <typename T>
Plan plan(std::int64_t cols, int per, int max_threads, std::initializer_list<const void*> rows) {
  int width = kVec16<T>;
  if (cols % width != 0) width = 1;
  for (const void* p : rows)
    if (p && !aligned16(p)) width = 1;
  const std::int64_t threads = ((cols / width + per - 1) / per + 31) / 32 * 32;
  if (threads <= max_threads)
    return {width, static_cast<int>(std::max<std::int64_t>(threads, 32)), true};
  return {width, max_threads, false};
}

// Rows per backward block. dweight's bits depend on this grouping, so it depends on the shape
// only: about 2^log2_blocks / H blocks (2^20 / H: at H = 4096, 256 blocks of 512 threads fill an
// H100/H200), at least 2^(log2_blocks - 12) and at most 4 times that, so that the partial rows
// (written and read once, 8 bytes per element) stay a few percent of the traffic.
std::int64_t rows_per_block(const RmsNormShape& s, int log2_blocks = 20) {
  const std::int64_t lo = std::int64_t{1} << (log2_blocks - 12);
  const std::int64_t blocks = std::clamp<std::int64_t>(
      (std::int64_t{1} << log2_blocks) / std::max<std::int64_t>(s.cols, 1), lo, 4 * lo);
  return std::max<std::int64_t>(1, (s.rows + blocks - 1) / blocks);
}

// TEMPORARY: the forward variant's kernel, or null when it does not apply (then the original).
template <typename T, int N>
void (*forward_variant(int v, std::int64_t cols, int& rows_per_block_out,
                       int& threads_out))(RmsNormShape, RmsNormForwardArgs) {
  struct Choice {
    void (*kernel)(RmsNormShape, RmsNormForwardArgs);
    int g, p, b;
  };
  const Choice choices[] = {
      {nullptr, 0, 0, 0},
      {forward_group_kernel<T, N, 32, 16, 128>, 32, 16, 128},
      {forward_group_kernel<T, N, 64, 8, 128>, 64, 8, 128},
      {forward_group_kernel<T, N, 128, 4, 128>, 128, 4, 128},
      {forward_group_kernel<T, N, 256, 2, 256>, 256, 2, 256},
      {forward_group_kernel<T, N, 32, 16, 256>, 32, 16, 256},
  };
  if (v <= 0 || v >= static_cast<int>(std::size(choices))) return nullptr;
  const Choice& c = choices[v];
  if (cols > std::int64_t{c.g} * c.p * N) return nullptr;
  rows_per_block_out = c.b / c.g;
  threads_out = c.b;
  return c.kernel;
}

}  // namespace

void rmsnorm_forward(const RmsNormShape& s, const RmsNormForwardArgs& a, const Stream& stream) {
  if (s.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  const int variant = tuning_variant("MESHFUSE_VARIANT_RMSNORM_FWD");
  dispatch_float(s.dtype, "rmsnorm", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    const Plan p =
        plan<T>(s.cols, kForwardPer, kForwardThreads, {a.x, a.residual, a.weight, a.y, a.r});
    with_width<T>(p.width, [&](auto width) {
      constexpr int N = decltype(width)::value;
      if constexpr (N > 1) {
        int rows = 0, threads = 0;
        if (const auto k = forward_variant<T, N>(variant, s.cols, rows, threads)) {
          k<<<static_cast<unsigned>((s.rows + rows - 1) / rows), threads, 0, native(stream)>>>(s,
                                                                                               a);
          return;
        }
      }
      const auto kernel = p.resident ? forward_kernel<T, N> : forward_streaming_kernel<T, N>;
      kernel<<<row_blocks(s.rows), p.threads, 0, native(stream)>>>(s, a);
    });
  });
  check_launch("rmsnorm");
}

void rmsnorm_backward(const RmsNormShape& s, const RmsNormBackwardArgs& a, const Stream& stream) {
  if (s.rows == 0 && !a.dweight) return;
  DeviceGuard guard(stream.device.index);
  int variant = tuning_variant("MESHFUSE_VARIANT_RMSNORM_BWD");
  if (variant < 0 || variant >= static_cast<int>(std::size(kBackwardVariants))) variant = 0;
  const BackwardVariant bv = kBackwardVariants[variant];
  dispatch_float(s.dtype, "rmsnorm_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    using A = acc_t<T>;
    const std::int64_t per_block = rows_per_block(s, bv.log2_blocks),
                       blocks = (s.rows + per_block - 1) / per_block;
    // Scratch for dweight's partial rows, stream-ordered like the kernels that use it.
    Tensor partials;
    if (a.dweight && blocks > 0 && s.cols > 0)
      partials = Tensor({blocks, s.cols}, dtype_of<A>(),
                        Device{DeviceType::CUDA, stream.device.index}, stream);
    A* p = partials.defined() ? partials.data_ptr<A>() : nullptr;
    if (blocks > 0) {
      const Plan l = plan<T>(s.cols, 1, kBackwardThreads,
                             {a.grad_y, a.grad_r, a.input, a.weight, a.dx, a.dresidual});
      with_width<T>(l.width, [&](auto width) {
        constexpr int N = decltype(width)::value;
        if constexpr (N > 1) {
          const std::int64_t nv = s.cols / N;
          if (bv.per > 0 && nv <= std::int64_t{bv.per} * bv.max_threads) {
            const int threads = static_cast<int>(
                std::max<std::int64_t>(32, ((nv + bv.per - 1) / bv.per + 31) / 32 * 32));
            using K = void (*)(RmsNormShape, RmsNormBackwardArgs, std::int64_t, A*);
            const K kernel =
                !bv.async     ? static_cast<K>(backward_group_kernel<T, N, 2, 1>)
                : bv.per == 1 ? (bv.depth == 3 ? static_cast<K>(backward_async_kernel<T, N, 1, 3>)
                                               : static_cast<K>(backward_async_kernel<T, N, 1, 4>))
                              : (bv.depth == 3 ? static_cast<K>(backward_async_kernel<T, N, 2, 3>)
                                               : static_cast<K>(backward_async_kernel<T, N, 2, 4>));
            std::size_t shared = 0;
            if (bv.async) {
              const int arrays = a.grad_r ? 3 : 2;
              shared = static_cast<std::size_t>(bv.depth) *
                       (static_cast<std::size_t>(arrays) * bv.per * threads * 16 + threads * 4);
              check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(shared)),
                    "rmsnorm_backward");
            }
            kernel<<<static_cast<unsigned>(blocks), threads, shared, native(stream)>>>(
                s, a, per_block, p);
            return;
          }
        }
        const auto kernel = l.resident ? backward_kernel<T, N> : backward_streaming_kernel<T, N>;
        kernel<<<static_cast<unsigned>(blocks), l.threads, 0, native(stream)>>>(s, a, per_block, p);
      });
    }
    if (a.dweight && s.cols > 0)
      dweight_kernel<T><<<ceil_div(s.cols, 32), dim3(32, kReduceLanes), 0, native(stream)>>>(
          p, blocks, s.cols, static_cast<T*>(a.dweight));
  });
  check_launch("rmsnorm_backward");
}

}  // namespace meshfuse::detail::cuda
