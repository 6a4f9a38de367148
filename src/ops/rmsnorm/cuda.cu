// CUDA RMSNorm.
//
// Forward: a row stays in registers as stored (x and residual) across the reduction of sum(r^2),
// then y and r are written: every row is read once. Rows of up to 512 16-byte vectors (bf16 H =
// 4096) go to groups of 64 threads with up to 8 vectors each, two rows per 128-thread block (one
// barrier per row), the fastest of the layouts measured (docs/kernels/rmsnorm.md). Wider rows take
// one block per row, 2 vectors per thread.
//
// Backward: each block walks a fixed range of rows with one 16-byte vector per thread per row (512
// threads at bf16 H = 4096), the next row's loads in flight while the current row is reduced and
// written (faster than 2 vectors per thread, a cp.async ring, or two rows per barrier pair).
// Each thread sums dy * n for its columns in registers and writes the block's partial row once; a
// second kernel, launched as a programmatic dependent, adds the partial rows in a fixed order. No
// float atomics, and dweight's bits depend on the shape only (not on the vector width or the
// device). A thread's sums over its block's rows are double (each term exact), so a partial row is
// its exact sum rounded once to the accumulation type (fp32; f64 for f64), and the partial rows
// are added in double: dweight is within about one fp32 rounding of the exact sum (fp32 sums over
// a block's rows drifted further from it than PyTorch's). fp32 partial rows keep the traffic of
// the fp32 version (double ones measured 6% slower at bf16 16384 x 4096).
//
// Rows too wide for registers take the "streaming" kernels, which read the row again after the
// reduction (from L2). Widths that are not a multiple of the vector, or rows that are not 16-byte
// aligned, use one element per vector.
#include <algorithm>

#include "core/cuda/cuda_utils.cuh"
#include "meshfuse/core/tensor.h"
#include "ops/common.h"
#include "ops/rmsnorm/rmsnorm_kernels.h"
#include "ops/cuda_rows.cuh"

namespace meshfuse::detail::cuda {
namespace {

// Forward rows in registers: groups of kGroup threads, kGroupPer vectors each, kGroupBlock
// threads per block (rows up to 512 vectors: bf16 H = 4096), else kForwardPer vectors per thread
// in one block of up to kForwardThreads per row (rows up to 2048 vectors: bf16 H = 16384).
constexpr int kGroup = 64;
constexpr int kGroupPer = 8;
constexpr int kGroupBlock = 128;
constexpr int kForwardPer = 2;
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

// A row's sum of squares and its rstd are once_t: double for f32 rows, so that y = r * rstd *
// weight is rounded once (write_out) and rstd adds almost nothing to that. (Summing each thread's
// squares in f32 first measured no faster.)
template <typename S>
__device__ __forceinline__ S inverse_rms(S sum_sq, std::int64_t cols, S eps) {
  return S(1) / sqrt(sum_sq / S(cols) + eps);
}

// ---- forward ----

// r = x * multiplier + residual from the stored vectors.
template <typename T, int N, typename A>
__device__ __forceinline__ void pre_norm(const Chunk<T, N>& x, const Chunk<T, N>& res,
                                         bool residual, A m, A (&r)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) r[k] = x[k] * m + (residual ? res[k] : A(0));
}

// Writes r (when the op outputs it) and y = r * rstd * weight at element offset off. f32 rows
// round y once: r * w is split exactly into p + p_err (an fma gives the product's rounding) and
// the double rstd into two floats, and y = p * rstd_hi + (p * rstd_lo + p_err * rstd_hi) in one
// final fma; the terms left out are below 2^-46 of y. The split is exact only away from the ends
// of f32's range: a product that overflows or nears the subnormals, or an rstd past FLT_MAX (eps 0
// and a row of tiny values), takes y = double(r) * double(w) * rstd, three conversions more.
template <typename T, int N, typename A, typename S>
__device__ __forceinline__ void write_out(const RmsNormForwardArgs& a, std::int64_t off,
                                          const A (&r)[N], S rstd, const Chunk<T, N>& w) {
  if (a.r) store_vec<T, N>(a.r, off, r);
  A y[N];
  if constexpr (std::is_same_v<T, float>) {
    const float hi = static_cast<float>(rstd), lo = static_cast<float>(rstd - hi);
    const bool split_rstd = hi >= 0x1p-100f && hi <= 0x1p100f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float p = __fmul_rn(r[k], w[k]), p_err = fmaf(r[k], w[k], -p);
      const float size = fabsf(p);
      y[k] = split_rstd && size >= 0x1p-100f && size <= 0x1p100f
                 ? fmaf(p, hi, fmaf(p, lo, p_err * hi))
                 : static_cast<float>(double(r[k]) * double(w[k]) * rstd);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = r[k] * rstd * w[k];
  }
  store_vec<T, N>(a.y, off, y);
}

// Rows held in registers as stored (half the registers of fp32 for 16-bit types): a group of G
// consecutive threads per row (B / G rows per block of B threads at a time; G = 0: the whole
// block, one row), P vectors per thread. G is fixed at compile time so that the column offsets
// are constants (a run-time G took 119 registers instead of 96 at bf16, G = 64, P = 8: one block
// fewer per SM). r is formed from the stored row twice, with the same operations, so y and r see
// the same unrounded r.
template <typename T, int N, int P, int G, int B>
__global__ void __launch_bounds__(B) forward_kernel(RmsNormShape s, RmsNormForwardArgs a) {
  using A = acc_t<T>;
  using S = once_t<T>;
  __shared__ S scratch[2][32];
  const A m = static_cast<A>(a.multiplier);
  const S eps = static_cast<S>(a.eps);
  // Resident rows are short: 32-bit column offsets.
  const int cols = static_cast<int>(s.cols), g = G > 0 ? G : static_cast<int>(blockDim.x);
  const int t = G > 0 ? threadIdx.x % G : threadIdx.x, per_block = G > 0 ? B / G : 1;
  const auto col = [&](int i) { return (t + i * g) * N; };
  int parity = 0;
  for (std::int64_t first = std::int64_t{blockIdx.x} * per_block; first < s.rows;
       first += std::int64_t{gridDim.x} * per_block, parity ^= 1) {
    const std::int64_t row = first + (G > 0 ? threadIdx.x / G : 0);
    // A group past the last row takes part in the reduction's barrier only.
    const bool live = row < s.rows;
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
    S sum_sq = 0;
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (live && col(i) < cols) {
        A r[N];
        pre_norm<T, N>(x[i], res[i], a.residual != nullptr, m, r);
#pragma unroll
        for (int k = 0; k < N; ++k) sum_sq += S(r[k]) * S(r[k]);
      }
    const S rstd = inverse_rms(group_sum(sum_sq, scratch, g, parity), s.cols, eps);
    if (!live) continue;
    if (a.rstd && t == 0) static_cast<rstd_t<T>*>(a.rstd)[row] = static_cast<rstd_t<T>>(rstd);
#pragma unroll
    for (int i = 0; i < P; ++i)
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
  using S = once_t<T>;
  __shared__ S scratch[32];
  const A m = static_cast<A>(a.multiplier);
  const S eps = static_cast<S>(a.eps);
  const std::int64_t first = std::int64_t{threadIdx.x} * N, step = std::int64_t{blockDim.x} * N;
  const Chunk<T, N> none{};
  const auto load_r = [&](std::int64_t off, A(&r)[N]) {
    pre_norm<T, N>(load_chunk<T, N>(a.x, off),
                   a.residual ? load_chunk<T, N>(a.residual, off) : none, a.residual != nullptr, m,
                   r);
  };
  for (std::int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const std::int64_t base = row * s.cols;
    S sum_sq = 0;
    for (std::int64_t c = first; c < s.cols; c += step) {
      A r[N];
      load_r(base + c, r);
#pragma unroll
      for (int k = 0; k < N; ++k) sum_sq += S(r[k]) * S(r[k]);
    }
    const S rstd = inverse_rms(block_sum(sum_sq, scratch), s.cols, eps);
    if (a.rstd && threadIdx.x == 0)
      static_cast<rstd_t<T>*>(a.rstd)[row] = static_cast<rstd_t<T>>(rstd);
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
  rstd_t<T> rstd;
};

template <typename T, int N>
__device__ __forceinline__ Slice<T, N> load_slice(const RmsNormBackwardArgs& a, std::int64_t row,
                                                  std::int64_t off) {
  Slice<T, N> v{};
  v.rstd = static_cast<const rstd_t<T>*>(a.rstd)[row];
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
// dy * n to acc (exact in double).
template <typename T, int N, typename A>
__device__ __forceinline__ void write_grads(const RmsNormBackwardArgs& a, std::int64_t off,
                                            const Slice<T, N>& v, const Chunk<T, N>& w, A scale,
                                            A mean, double (&acc)[N]) {
  const A rstd = v.rstd, m = static_cast<A>(a.multiplier);
  A dr[N], dx[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const A g = v.dy[k], n = v.in[k] * scale;
    dr[k] = rstd * (g * w[k] - n * mean) + (a.grad_r ? v.gr[k] : A(0));
    dx[k] = dr[k] * m;
    acc[k] = fma(double(g), double(n), acc[k]);
  }
  store_vec<T, N>(a.dx, off, dx);
  if (a.dresidual) store_vec<T, N>(a.dresidual, off, dr);
}

// dweight_kernel is launched as a programmatic dependent of the backward kernels (sm_90): its
// launch starts while they run, and it waits for their completion (and their partial rows) in
// griddepcontrol.wait. That hides the second launch.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Block b handles rows [b * rows_per_block, (b + 1) * rows_per_block) and, when partials is not
// null, writes their sum of dy * n (rounded once to A) to partials row b.
template <typename T, int N>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_kernel(RmsNormShape s, RmsNormBackwardArgs a, std::int64_t rows_per_block,
                    acc_t<T>* partials) {
  using A = acc_t<T>;
  launch_dependents();
  __shared__ A scratch[32];
  const std::int64_t c = std::int64_t{threadIdx.x} * N;
  const bool active = c < s.cols;
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t end = std::min(s.rows, first + rows_per_block);
  const Chunk<T, N> w = active ? weight_vec<T, N>(a.weight, c) : Chunk<T, N>{};
  double acc[N] = {};
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
// the same order (so the same bits), with the row read again after the reduction and the running
// sums kept in memory, in the block's row of `running` (double), until the last row writes them
// to its partials row.
template <typename T, int N>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_streaming_kernel(RmsNormShape s, RmsNormBackwardArgs a, std::int64_t rows_per_block,
                              acc_t<T>* partials, double* running) {
  using A = acc_t<T>;
  launch_dependents();
  __shared__ A scratch[32];
  const std::int64_t start = std::int64_t{threadIdx.x} * N, step = std::int64_t{blockDim.x} * N;
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t end = std::min(s.rows, first + rows_per_block);
  A* partial = partials ? partials + blockIdx.x * s.cols : nullptr;
  double* sums = partials ? running + blockIdx.x * s.cols : nullptr;
  for (std::int64_t row = first; row < end; ++row) {
    const std::int64_t base = row * s.cols;
    const A scale = static_cast<A>(a.input_scale) * A(static_cast<const rstd_t<T>*>(a.rstd)[row]);
    A dot = 0;
    for (std::int64_t c = start; c < s.cols; c += step) {
      dot += dot_share(load_slice<T, N>(a, row, base + c), weight_vec<T, N>(a.weight, c), scale);
    }
    const A mean = block_sum(dot, scratch) / A(s.cols);
    for (std::int64_t c = start; c < s.cols; c += step) {
      double acc[N] = {};
      if (partial && row > first) {
        const Vec<double, N> p = load_vec<double, N>(sums, c);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = p.v[k];
      }
      write_grads<T, N>(a, base + c, load_slice<T, N>(a, row, base + c),
                        weight_vec<T, N>(a.weight, c), scale, mean, acc);
      if (partial && row + 1 < end) store_vec<double, N>(sums, c, acc);
      if (partial && row + 1 == end) store_vec<A, N>(partial, c, acc);
    }
  }
}

// dweight[c] = sum over b of partials[b][c], in double: lane y of a block adds the rows
// b = y (mod kReduceLanes) in order (8 loads in flight at a time), then lane 0 adds the lanes in
// order. A function of the shape only.
template <typename T>
__global__ void __launch_bounds__(32 * kReduceLanes)
    dweight_kernel(const acc_t<T>* __restrict__ partials, std::int64_t blocks, std::int64_t cols,
                   T* __restrict__ dweight) {
  using A = double;
  wait_for_primary();
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
// only: about 2^20 / H blocks (at H = 4096, 256 blocks of 512 threads fill an H100/H200), at
// least 256 and at most 1024 so that the partial rows (written and read once: 8 bytes per element)
// stay a few percent of the traffic.
std::int64_t rows_per_block(const RmsNormShape& s) {
  const std::int64_t blocks = std::clamp<std::int64_t>(
      (std::int64_t{1} << 20) / std::max<std::int64_t>(s.cols, 1), 256, 1024);
  return std::max<std::int64_t>(1, (s.rows + blocks - 1) / blocks);
}

}  // namespace

void rmsnorm_forward(const RmsNormShape& s, const RmsNormForwardArgs& a, const Stream& stream) {
  if (s.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "rmsnorm", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    const Plan p =
        plan<T>(s.cols, kForwardPer, kForwardThreads, {a.x, a.residual, a.weight, a.y, a.r});
    with_width<T>(p.width, [&](auto width) {
      constexpr int N = decltype(width)::value;
      if constexpr (N > 1) {
        if (s.cols / N <= kGroup * kGroupPer) {
          constexpr int rows = kGroupBlock / kGroup;
          forward_kernel<T, N, kGroupPer, kGroup, kGroupBlock>
              <<<row_blocks((s.rows + rows - 1) / rows), kGroupBlock, 0, native(stream)>>>(s, a);
          return;
        }
      }
      if (p.resident)
        forward_kernel<T, N, kForwardPer, 0, kForwardThreads>
            <<<row_blocks(s.rows), p.threads, 0, native(stream)>>>(s, a);
      else
        forward_streaming_kernel<T, N><<<row_blocks(s.rows), p.threads, 0, native(stream)>>>(s, a);
    });
  });
  check_launch("rmsnorm");
}

void rmsnorm_backward(const RmsNormShape& s, const RmsNormBackwardArgs& a, const Stream& stream) {
  if (s.rows == 0 && !a.dweight) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "rmsnorm_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    using A = acc_t<T>;
    const std::int64_t per_block = rows_per_block(s), blocks = (s.rows + per_block - 1) / per_block;
    const Plan l = plan<T>(s.cols, 1, kBackwardThreads,
                           {a.grad_y, a.grad_r, a.input, a.weight, a.dx, a.dresidual});
    // Scratch for dweight's partial rows (and the streaming kernel's running sums), stream-ordered
    // like the kernels that use it.
    const bool partial_rows = a.dweight && blocks > 0 && s.cols > 0;
    const Device device{DeviceType::CUDA, stream.device.index};
    const Tensor partials =
        partial_rows ? Tensor({blocks, s.cols}, dtype_of<A>(), device, stream) : Tensor();
    const Tensor running = partial_rows && !l.resident
                               ? Tensor({blocks, s.cols}, DType::F64, device, stream)
                               : Tensor();
    A* p = partial_rows ? partials.data_ptr<A>() : nullptr;
    if (blocks > 0) {
      with_width<T>(l.width, [&](auto width) {
        constexpr int N = decltype(width)::value;
        const unsigned grid = static_cast<unsigned>(blocks);
        if (l.resident)
          backward_kernel<T, N><<<grid, l.threads, 0, native(stream)>>>(s, a, per_block, p);
        else
          backward_streaming_kernel<T, N><<<grid, l.threads, 0, native(stream)>>>(
              s, a, per_block, p, running.defined() ? running.data_ptr<double>() : nullptr);
      });
    }
    if (a.dweight && s.cols > 0) {
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(static_cast<unsigned>(ceil_div(s.cols, 32)));
      config.blockDim = dim3(32, kReduceLanes);
      config.stream = native(stream);
      cudaLaunchAttribute attribute{};
      attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
      config.attrs = &attribute;
      // Only code compiled for sm_90 or later waits in griddepcontrol.wait: older PTX
      // (CMAKE_CUDA_ARCHITECTURES below 90, JIT-compiled on a newer GPU) gets an ordinary launch.
      const int ptx = remembered(reinterpret_cast<const void*>(dweight_kernel<T>), [] {
        cudaFuncAttributes compiled{};
        check(cudaFuncGetAttributes(&compiled, dweight_kernel<T>), "rmsnorm_backward");
        return compiled.ptxVersion;
      });
      config.numAttrs = ptx >= 90 ? 1 : 0;
      check(cudaLaunchKernelEx(&config, dweight_kernel<T>, static_cast<const A*>(p), blocks,
                               s.cols, static_cast<T*>(a.dweight)),
            "rmsnorm_backward");
    }
  });
  check_launch("rmsnorm_backward");
}

}  // namespace meshfuse::detail::cuda
