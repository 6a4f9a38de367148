// CPU softmax: rows split over OpenMP threads, each row vectorised by the compiler. The forward
// makes three passes over a row (max; exp and sum; scale), one exp per element, the max pass of
// the next row fused into the exp pass (see row_sum_exp_next_max); the backward makes two (dot,
// then the output); a row stays in L2 between passes. Compiled once per SIMD target
// (cpu_simd-inl.h), dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/softmax/cpu.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <algorithm>
#include <memory>

#include "ops/common.h"
#include "ops/cpu_logsumexp-inl.h"
#include "ops/cpu_math.h"
#include "ops/cpu_simd-inl.h"
#include "ops/softmax/softmax_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {

// sum_c a[c] * b[c]. 16-bit rows multiply in f32 lanes (8- or 11-bit significands: each product
// exact) and add there 16 vectors at a time, then into double lanes: a loop converting every
// element to double made the backward compute-bound, slower than PyTorch's on AVX2 and AVX-512
// (docs/kernels/softmax.md). f32 and f64 rows, and HWY_SCALAR, take that loop (exact products, the
// sum in double).
template <typename T>
double RowDot(const T* a, const T* b, std::int64_t n) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kSixteenBit<T>) {
    const DF d;
    const hn::Half<DF> dh;
    const hn::Rebind<double, hn::Half<DF>> dd;
    const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
    constexpr std::int64_t kWideningVectors = 16;
    auto lo = hn::Zero(dd), hi = hn::Zero(dd);
    for (std::int64_t j = 0; j < n;) {
      VF sum = hn::Zero(d);
      const std::int64_t end = std::min(n, j + kWideningVectors * lanes);
      for (; j + lanes <= end; j += lanes) sum = hn::MulAdd(LoadF(d, a + j), LoadF(d, b + j), sum);
      if (j < end) {
        sum = hn::MulAdd(LoadFTail(d, a + j, end - j), LoadFTail(d, b + j, end - j), sum);
        j = end;
      }
      lo = hn::Add(lo, hn::PromoteTo(dd, hn::LowerHalf(dh, sum)));
      hi = hn::Add(hi, hn::PromoteTo(dd, hn::UpperHalf(dh, sum)));
    }
    return LaneSum(dd, hn::Add(lo, hi));
  }
#endif
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t c = 0; c < n; ++c) sum += double(to_float(a[c])) * double(to_float(b[c]));
  return sum;
}

void SoftmaxForward(const SoftmaxShape& s, const void* x, void* y, double multiplier) {
  dispatch_float(s.dtype, "softmax", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A m = static_cast<A>(multiplier);
    const std::int64_t row_bytes = s.cols * std::int64_t{sizeof(T)};
    const OutputWrite w = output_write(2 * s.rows * row_bytes, y, s.rows * row_bytes);
    parallel_if(s.rows * s.cols >= kParallelMin, [&] {
      populate_rows(w, y, s.rows, row_bytes, row_bytes);
      // The unnormalised exps, kept in A so that 16-bit outputs are rounded once; a row of them
      // stays in L2 until the output is written (streamed past the last-level cache). Whole
      // vectors are stored past the row's end. Not zeroed: every element is written before it is
      // read, and zeroing it was a noticeable part of a tiny call.
      const auto scratch =
          std::make_unique_for_overwrite<A[]>(static_cast<std::size_t>(s.cols) + kMaxLanes);
      A* e = scratch.get();
      const auto row = [&](std::int64_t r) {
        return static_cast<const T*>(x) + row_offset(r, s.cols);
      };
      const auto [begin, end] = thread_rows(s.rows);
      A max = begin < end ? row_max(row(begin), s.cols, m).max : A(0);
      for (std::int64_t r = begin; r < end; ++r) {
        const A shift = exp_shift(max);
        // The last row reads itself as its "next" row (from cache); that max goes unused.
        const auto [sum, next] = row_sum_exp_next_max<true, false>(
            row(r), row(r + 1 < end ? r + 1 : r), s.cols, m, shift, e);
        max = next.max;
        // A row entirely -inf has sum 0: 0 * inf = NaN, as PyTorch.
        const A inv = A(1) / sum;
        StreamOut(static_cast<T*>(y) + row_offset(r, s.cols), s.cols, w.stream,
                  [&](std::int64_t c) { return e[c] * inv; });
      }
      hwy::FlushStream();
    });
  });
}

void SoftmaxBackward(const SoftmaxShape& s, const void* grad_y, const void* y, void* grad_x,
                     double multiplier) {
  dispatch_float(s.dtype, "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A m = static_cast<A>(multiplier);
    const std::int64_t row_bytes = s.cols * std::int64_t{sizeof(T)};
    const OutputWrite w = output_write(3 * s.rows * row_bytes, grad_x, s.rows * row_bytes);
    parallel_if(s.rows * s.cols >= kParallelMin, [&] {
      populate_rows(w, grad_x, s.rows, row_bytes, row_bytes);
#pragma omp for schedule(static)
      for (std::int64_t r = 0; r < s.rows; ++r) {
        const T* dyr = static_cast<const T*>(grad_y) + row_offset(r, s.cols);
        const T* yr = static_cast<const T*>(y) + row_offset(r, s.cols);
        const A dot = A(RowDot(dyr, yr, s.cols));
        const std::int64_t next = row_offset(r + 1 < s.rows ? r + 1 : r, s.cols);
        T* const gxr = static_cast<T*>(grad_x) + row_offset(r, s.cols);
        const std::initializer_list<const T*> ahead = {static_cast<const T*>(grad_y) + next,
                                                       static_cast<const T*>(y) + next};
#if HWY_TARGET != HWY_SCALAR
        // With vectors: LoadF widens f16 with F16C where the target has it, which the compiler
        // does not emit for the per-element loop below (ten integer ops an element instead).
        if constexpr (std::is_same_v<A, float>) {
          StreamOutBlocks(
              gxr, s.cols, w.stream,
              [&](std::int64_t c0, std::int64_t len, A* buf) {
                const DF d;
                const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
                const VF vm = hn::Set(d, m), vdot = hn::Set(d, dot);
                for (std::int64_t j = 0; j < len; j += lanes) {
                  const bool full = j + lanes <= len;
                  const auto k = static_cast<std::size_t>(len - j);
                  const T* dyj = dyr + c0 + j;
                  const T* yj = yr + c0 + j;
                  const VF dyv = full ? LoadF(d, dyj) : LoadFTail(d, dyj, k);
                  const VF yv = full ? LoadF(d, yj) : LoadFTail(d, yj, k);
                  hn::Store(hn::Mul(hn::Mul(vm, yv), hn::Sub(dyv, vdot)), d, buf + j);
                }
              },
              ahead);
        } else
#endif
          StreamOut(
              gxr, s.cols, w.stream,
              [&](std::int64_t c) { return m * A(to_float(yr[c])) * (A(to_float(dyr[c])) - dot); },
              ahead);
      }
      hwy::FlushStream();
    });
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(SoftmaxForward);
HWY_EXPORT(SoftmaxBackward);

void softmax_forward(const SoftmaxShape& s, const void* x, void* y, double multiplier,
                     const Stream&) {
  HWY_DYNAMIC_DISPATCH(SoftmaxForward)(s, x, y, multiplier);
}

void softmax_backward(const SoftmaxShape& s, const void* grad_y, const void* y, void* grad_x,
                      double multiplier, const Stream&) {
  HWY_DYNAMIC_DISPATCH(SoftmaxBackward)(s, grad_y, y, grad_x, multiplier);
}

}  // namespace meshfuse::detail::cpu
#endif
