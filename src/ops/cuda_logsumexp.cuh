// The cuda backend's row log-sum-exp, shared by softmax and cross_entropy (internal).
//
// Exponents are in the units of the row's dtype (kBase2): 16-bit rows take u = x * m * log2(e),
// so that each exp is one ex2 instruction; f32 and f64 rows take u = x * m and the library's exp,
// as PyTorch does. Statistics combine in a fixed order (thread, then a warp butterfly, then the
// warps in index order), so the same inputs give bitwise the same results.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "core/cuda/cuda_utils.cuh"
#include "ops/cuda_rows.cuh"

namespace meshfuse::detail::cuda {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// Threads of a row block, and 16-byte vectors each thread loads per step of a streamed row.
constexpr int kMaxThreads = 512;
constexpr int kU = 4;

// Row blocks per SM that a kernel's registers are sized for (__launch_bounds__): 3 for kernels
// that hold rows in shared memory, 2 for those that stream them through registers (enough loads
// in flight either way); f64 (not a bandwidth target, and its exp2 is a long function) gets the
// registers of one.
template <typename T, int kBlocks>
constexpr int kMinBlocks = sizeof(T) == 8 ? 1 : kBlocks;

// 2^x by the ex2 instruction (about 2 ulp); results below 2^-126 flush to 0, which neither a sum
// of exps nor a probability rounded to the output type notices.
__device__ __forceinline__ float exp2a(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Base 2 for 16-bit rows: ex2 and the roundings of m * log2(e) and of u (2^-24 relative each,
// times an exponent of 10 to 20) stay far below a 16-bit output's rounding. f32 and f64 rows take
// natural units: e^(x * m - shift) with the exponent rounded once (an fma) and expf (within
// 2 ulp) or exp, where the base-2 form measured 1.3x to 2.7x PyTorch's error against fp64.
template <typename T>
constexpr bool kBase2 = sizeof(T) == 2;

// A logits multiplier m in T's units, the kernels' scale: u = x * scale.
template <typename T>
double units_scale(double m) {
  return kBase2<T> ? m * kLog2e : m;
}

// e^v, v in natural units, to the accuracy of the accumulation type.
__device__ __forceinline__ float exact_exp(float v) { return expf(v); }
__device__ __forceinline__ double exact_exp(double v) { return exp(v); }

// The exp of an exponent u in T's units.
template <typename T, typename A>
__device__ __forceinline__ A exp_units(A u) {
  if constexpr (kBase2<T>)
    return exp2a(u);
  else
    return exact_exp(u);
}

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// The shift that keeps exp(u - shift) <= 1. A max of -inf (every value -inf or NaN) is shifted
// by 0, so that its -inf values give 0 (not exp(-inf + inf) = NaN) and its NaNs stay NaN.
template <typename A>
__device__ __forceinline__ A shift(A max) {
  return max == neg_inf<A>() ? A(0) : max;
}

// The factor that moves a sum of exp(u - shift(from)) onto shift(to), to >= from. A sum whose max
// is -inf is 0 or NaN and stays as it is; to = +inf > from gives 0. The compiler evaluates the exp
// whether or not the max moved: ex2 for 16-bit rows keeps their loops as short as they were.
template <typename T, typename A>
__device__ __forceinline__ A rescale(A from, A to) {
  return from == to || from == neg_inf<A>() ? A(1) : exp_units<T>(from - to);
}

// Of a set of values u (T's units) and their inputs x: max u, sum exp(u - shift(max)), sum x.
// A NaN never wins the max (fmax skips it) but makes the sum NaN; so does +inf (exp(inf - inf)).
template <typename A>
struct RowStats {
  A max;
  A sum;
  A sum_x;
};

template <typename A>
__device__ __forceinline__ RowStats<A> empty_stats() {
  return {neg_inf<A>(), A(0), A(0)};
}

template <typename T, typename A>
__device__ __forceinline__ RowStats<A> combine(const RowStats<A>& a, const RowStats<A>& b) {
  const A max = fmax(a.max, b.max);
  return {max, a.sum * rescale<T>(a.max, max) + b.sum * rescale<T>(b.max, max), a.sum_x + b.sum_x};
}

// log sum_j e^(v_j), v = x * m: -inf when every value is -inf. 16-bit rows: in float, from base 2.
// f32 and f64 rows: in double, so that the lse that cross_entropy saves carries no rounding of
// its own (in f32, up to 2^-21 of an lse of 10 to 20, which its backward's p = e^(v - lse) takes
// whole, relative to every p).
template <typename T, typename A>
__device__ __forceinline__ auto natural_lse(const RowStats<A>& s) {
  if constexpr (kBase2<T>)
    return (shift(s.max) + log2(s.sum)) * A(kLn2);
  else
    return static_cast<double>(shift(s.max)) + log(static_cast<double>(s.sum));
}

// __shfl_xor_sync / __shfl_sync of any trivially copyable value, 4 bytes at a time.
template <typename V>
__device__ __forceinline__ V shuffle(V v, int lane, bool by_xor) {
  static_assert(sizeof(V) % 4 == 0);
  unsigned w[sizeof(V) / 4];
  std::memcpy(w, &v, sizeof(V));
#pragma unroll
  for (unsigned& x : w) x = by_xor ? __shfl_xor_sync(~0u, x, lane) : __shfl_sync(~0u, x, lane);
  std::memcpy(&v, w, sizeof(V));
  return v;
}

// Makes v look rewritten to the compiler, so that values converted from it before are converted
// again after, not kept alive: for 16-bit rows, converted floats take twice the registers.
template <typename V>
__device__ __forceinline__ void reconvert_after(V& v) {
  if constexpr (sizeof(V) % 4 == 0) {
    unsigned w[sizeof(V) / 4];
    std::memcpy(w, &v, sizeof(V));
#pragma unroll
    for (unsigned& x : w) asm volatile("" : "+r"(x));
    std::memcpy(&v, w, sizeof(V));
  } else {
    static_assert(sizeof(V) == 2);
    unsigned short x;
    std::memcpy(&x, &v, 2);
    asm volatile("" : "+h"(x));
    std::memcpy(&v, &x, 2);
  }
}

template <typename V, typename F>
__device__ __forceinline__ V warp_allreduce(V v, F combine_fn) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = combine_fn(v, shuffle(v, offset, true));
  return v;
}

// The block's reduction of v, the same bits in every thread (lane 0's result is broadcast: a
// combine contracted into an fma is not exactly commutative). blockDim.x: a multiple of 32.
template <typename V, typename F>
__device__ V block_allreduce(V v, V identity, F combine_fn) {
  __shared__ V partial[32];
  v = warp_allreduce(v, combine_fn);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : identity;
  __syncthreads();  // partial is free for the next call
  return shuffle(warp_allreduce(v, combine_fn), 0, false);
}

// The block's statistics of its threads'. 16-bit rows: one pairwise tree of combines. f32 and f64
// rows: the block's max first, then each thread's sum moved onto it (one rounded exp per thread's
// sum, whose errors average out over the block) and summed: in the tree, the combines near its
// root rescale sums of up to half the row, each by an exp of up to 2 ulp, an error that every
// exp of the row inherits.
template <typename T, typename A>
__device__ __forceinline__ RowStats<A> block_stats(const RowStats<A>& s) {
  if constexpr (kBase2<T>) {
    return block_allreduce(s, empty_stats<A>(), [](const RowStats<A>& a, const RowStats<A>& b) {
      return combine<T>(a, b);
    });
  } else {
    const A max = block_allreduce(s.max, neg_inf<A>(), [](A a, A b) { return fmax(a, b); });
    return block_allreduce(RowStats<A>{max, s.sum * rescale<T>(s.max, max), s.sum_x},
                           RowStats<A>{max, A(0), A(0)},
                           [](const RowStats<A>& a, const RowStats<A>& b) {
                             return RowStats<A>{a.max, a.sum + b.sum, a.sum_x + b.sum_x};
                           });
  }
}

// Streams this thread's vectors of a row, j = threadIdx.x + k * blockDim.x < nv, kU at a time:
// the next step's loads are issued before step(v, base) processes the current ones (vector k is
// j = base + k * blockDim.x, valid when j < nv), so that a thread keeps kU 16-byte loads in
// flight while it computes. A thread writes only its own vectors, so step may write the row.
template <typename V, typename Step>
__device__ __forceinline__ void stream_row(const V* row, std::int64_t nv, Step&& step) {
  const std::int64_t stride = blockDim.x;
  const auto load_step = [&](std::int64_t base, V(&v)[kU]) {
#pragma unroll
    for (int k = 0; k < kU; ++k)
      if (base + k * stride < nv) v[k] = row[base + k * stride];
  };
  V current[kU];
  load_step(threadIdx.x, current);
#pragma unroll 1
  for (std::int64_t base = threadIdx.x; base < nv; base += kU * stride) {
    V next[kU];
    load_step(base + kU * stride, next);
    step(current, base);
#pragma unroll
    for (int k = 0; k < kU; ++k) current[k] = next[k];
  }
}

// This thread's part of a row of nv vectors of W elements (stream_row), u = x * scale, one
// rescale per step. With kSumX, also sum x.
template <typename T, int W, bool kSumX>
__device__ RowStats<acc_t<T>> thread_row_stats(const T* row, std::int64_t nv, acc_t<T> scale) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  const std::int64_t stride = blockDim.x;
  RowStats<A> st = empty_stats<A>();
  stream_row(reinterpret_cast<const V*>(row), nv, [&](V(&v)[kU], std::int64_t base) {
    A step_max = neg_inf<A>();
#pragma unroll
    for (int k = 0; k < kU; ++k)
      if (base + k * stride < nv)
#pragma unroll
        for (int i = 0; i < W; ++i) step_max = fmax(step_max, v[k][i] * scale);
#pragma unroll
    for (int k = 0; k < kU; ++k) reconvert_after(v[k]);
    const A max = fmax(st.max, step_max);
    // f32 and f64 rows branch around their longer exp, rarely needed once the max has settled
    // (evaluated every step, it spilled registers in the streamed softmax).
    if (kBase2<T> || max != st.max) st.sum *= rescale<T>(st.max, max);
    st.max = max;
    const A sh = shift(max);
#pragma unroll
    for (int k = 0; k < kU; ++k)
      if (base + k * stride < nv)
#pragma unroll
        for (int i = 0; i < W; ++i) {
          const A x = v[k][i];
          st.sum += exp_units<T>(x * scale - sh);
          if constexpr (kSumX) st.sum_x += x;
        }
  });
  return st;
}

// Threads for a row of nv vectors, per_thread each: a multiple of 32 in [32, kMaxThreads].
inline int row_threads(std::int64_t nv, int per_thread) {
  const std::int64_t t = (nv + per_thread - 1) / per_thread;
  return static_cast<int>(
      std::min<std::int64_t>(kMaxThreads, std::max<std::int64_t>(32, (t + 31) / 32 * 32)));
}

// Vectors of W elements when every pointer is 16-byte aligned and rows are a whole number of
// vectors; else 1 (scalar accesses).
template <typename T>
int vector_width(std::int64_t cols, std::initializer_list<const void*> pointers) {
  if (cols % kVec16<T> != 0) return 1;
  for (const void* p : pointers)
    if (!aligned16(p)) return 1;
  return kVec16<T>;
}

// The part of a row of nv vectors that this block holds when `blocks` consecutive blocks share
// the row (a cluster, or independent blocks): vectors [begin, begin + count), count <= ceil(nv /
// blocks); thread t handles part vectors t, t + blockDim.x, ...
struct Part {
  std::int64_t begin;
  int count;

  __device__ Part(std::int64_t nv, int blocks) {
    const std::int64_t per = (nv + blocks - 1) / blocks;
    begin = (blockIdx.x % blocks) * per;
    count = static_cast<int>(begin + per < nv ? per : nv - begin);
  }
};

}  // namespace meshfuse::detail::cuda
