// CPU RMSNorm: rows split over OpenMP threads; within a row, unit-stride loops vectorised with
// `#pragma omp simd` (the simd reduction order is fixed by the build, not by the thread count).
// Two passes per row, which stays in cache: the statistics, then the outputs through StreamOut,
// which brings the next row into cache meanwhile (into L2 in the forward: see PrefetchTo). The
// fused forward writes r in its statistics pass, so that both passes move data (faster than r in
// a pass of its own). The loops are bound by vector arithmetic as much as by memory, hence the
// multiplier's multiply only where it is not 1. A software pipeline (y of row i - 1 written in the
// loop that reads row i) measured slower. Figures: docs/kernels/rmsnorm.md.
// The row sums (of r^2 in the forward, of dy * w * n in the backward) are double: each term is
// exact or nearly so in it, so rstd and the backward's mean are rounded once, and the kernels are
// bound by memory (the wider adds cost little).
// dweight: each fixed block of rows sums into its own partial row; the partials are then added in
// block order, so the result does not depend on the thread count either. The partials are double:
// each term dy * n is exact in it and the sums over rows lose nothing that shows in the output, so
// dweight is the exact sum of the terms rounded once (fp32 sums over thousands of rows drift
// further from it than PyTorch's; the backward is bound by memory, not by these adds).
// Compiled once per SIMD target (cpu_simd-inl.h) for the compiler to vectorise the loops for each,
// dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/rmsnorm/cpu.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/cpu_simd-inl.h"
#include "ops/rmsnorm/rmsnorm_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace {

// Row blocks of the dweight reduction: at least kMinRowsPerBlock rows (a partial row costs as much
// as the rows it sums) and at most kMaxBlocks blocks (bounds the partials' memory).
constexpr std::int64_t kMinRowsPerBlock = 8;
constexpr std::int64_t kMaxBlocks = 256;
// Columns per task when adding the partials.
constexpr std::int64_t kCombineCols = 256;

// The weight as A once per call (1 when absent), so the inner loops need no branch or conversion.
template <typename T, typename A>
std::vector<A> weight_as(const void* weight, std::int64_t cols) {
  std::vector<A> w(cols, A(1));
  if (weight)
    for (std::int64_t c = 0; c < cols; ++c) w[c] = to_float(static_cast<const T*>(weight)[c]);
  return w;
}

// r = x * m + residual at element c, in A (the multiply only when kScale, the add when kResidual).
template <bool kResidual, bool kScale, typename T, typename A = acc_t<T>>
A residual_add(const T* x, const T* res, std::int64_t c, A m) {
  A v = A(to_float(x[c]));
  if constexpr (kScale) v *= m;
  if constexpr (kResidual) v += A(to_float(res[c]));
  return v;
}

template <typename T, bool kResidual, bool kScale>
void forward_rows(const RmsNormShape& s, const RmsNormForwardArgs& a) {
  using A = acc_t<T>;
  const std::vector<A> weight = weight_as<T, A>(a.weight, s.cols);
  const A* w = weight.data();
  const A m = static_cast<A>(a.multiplier);
  const std::int64_t row_bytes = s.cols * std::int64_t{sizeof(T)};
  const OutputWrite out =
      output_write((kResidual ? 4 : 2) * s.rows * row_bytes, a.y, s.rows * row_bytes);
  if constexpr (kResidual) advise_second_output(out, a.r, s.rows * row_bytes);
  const bool stream = out.stream;
  const auto in = [&](const void* p, std::int64_t row) {
    return static_cast<const T*>(p) + row * s.cols;
  };
  parallel_if(s.rows * s.cols >= kParallelMin, [&] {
    populate_rows(out, a.y, s.rows, row_bytes, row_bytes);
    if constexpr (kResidual) populate_rows(out, a.r, s.rows, row_bytes, row_bytes);
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < s.rows; ++row) {
      const T* x = in(a.x, row);
      const T* res = kResidual ? in(a.residual, row) : nullptr;
      const std::int64_t next = row + 1 < s.rows ? row + 1 : row;
      const auto value = [&](std::int64_t c) {
        return residual_add<kResidual, kScale>(x, res, c, m);
      };
      double sum_sq = 0;
      if constexpr (kResidual) {
        // r is written in the statistics pass: the pass then moves data too.
        StreamOutBlocks(
            static_cast<T*>(a.r) + row * s.cols, s.cols, stream,
            [&](std::int64_t c0, std::int64_t len, A* buf) {
              const T *xb = x + c0, *rb = res + c0;  // locals, or GCC does not vectorise
              double part = 0;
#if HWY_ARCH_ARM_A64
              // Two loops on Arm: GCC 12.2 leaves the fused one scalar on the SVE2 target and
              // then drops its sum (the scalar loop's accumulator is never stored into the
              // "omp simd" lanes that the reduction adds up: rstd came out garbage under qemu).
#pragma omp simd
              for (std::int64_t i = 0; i < len; ++i)
                buf[i] = residual_add<kResidual, kScale>(xb, rb, i, m);
#pragma omp simd reduction(+ : part)
              for (std::int64_t i = 0; i < len; ++i) part += double(buf[i]) * double(buf[i]);
#else
#pragma omp simd reduction(+ : part)
              for (std::int64_t i = 0; i < len; ++i) {
                buf[i] = residual_add<kResidual, kScale>(xb, rb, i, m);
                part += double(buf[i]) * double(buf[i]);
              }
#endif
              sum_sq += part;
            },
            {in(a.residual, next)}, PrefetchTo::L2);
      } else {
#pragma omp simd reduction(+ : sum_sq)
        for (std::int64_t c = 0; c < s.cols; ++c) sum_sq += double(value(c)) * double(value(c));
      }
      const A rstd = A(1.0 / std::sqrt(sum_sq / double(s.cols) + a.eps));
      if (a.rstd) static_cast<rstd_t<T>*>(a.rstd)[row] = static_cast<rstd_t<T>>(rstd);
      // y from the unrounded r (recomputed), so 16-bit outputs are rounded once.
      StreamOut(
          static_cast<T*>(a.y) + row * s.cols, s.cols, stream,
          [&](std::int64_t c) { return value(c) * rstd * w[c]; }, {in(a.x, next)}, PrefetchTo::L2);
    }
    hwy::FlushStream();
  });
}

// One row of the backward; adds dy * n (in double) into dw_partial when kDweight. `next` is the row
// that follows (itself for the last row), brought into cache while this row's outputs are written.
template <typename T, bool kGradR, bool kDresidual, bool kDweight, typename A = acc_t<T>>
void backward_row(const RmsNormShape& s, const RmsNormBackwardArgs& a, const A* w, std::int64_t row,
                  std::int64_t next, bool stream, double* dw_partial) {
  const auto in_row = [&](const void* p, std::int64_t r) {
    return p ? static_cast<const T*>(p) + r * s.cols : nullptr;
  };
  const T* dy = in_row(a.grad_y, row);
  const T* in = in_row(a.input, row);
  const T* gr = kGradR ? in_row(a.grad_r, row) : nullptr;
  const A rstd = static_cast<const rstd_t<T>*>(a.rstd)[row];
  const A scale = static_cast<A>(a.input_scale) * rstd;  // n = in * scale
  const A m = static_cast<A>(a.multiplier);
  double dot = 0;
#pragma omp simd reduction(+ : dot)
  for (std::int64_t c = 0; c < s.cols; ++c) {
    const A g = to_float(dy[c]);
    const A n = A(to_float(in[c])) * scale;
    dot += double(g) * double(w[c]) * double(n);
    if constexpr (kDweight) dw_partial[c] += double(g) * double(n);
  }
  const A mean = A(dot / double(s.cols));
  const auto dr = [&](std::int64_t c) {
    const A n = A(to_float(in[c])) * scale;
    A d = rstd * (A(to_float(dy[c])) * w[c] - n * mean);
    if constexpr (kGradR) d += A(to_float(gr[c]));
    return d;
  };
  const T* next_dy = in_row(a.grad_y, next);
  const T* next_in = in_row(a.input, next);
  const T* next_gr = kGradR ? in_row(a.grad_r, next) : nullptr;
  T* dx = static_cast<T*>(a.dx) + row * s.cols;
  if constexpr (kDresidual) {
    StreamOut(static_cast<T*>(a.dresidual) + row * s.cols, s.cols, stream, dr, {next_dy});
    StreamOut(dx, s.cols, stream, [&](std::int64_t c) { return dr(c) * m; }, {next_in, next_gr});
  } else {
    StreamOut(dx, s.cols, stream, [&](std::int64_t c) { return dr(c) * m; },
              {next_dy, next_in, next_gr});
  }
}

template <typename T, bool kGradR, bool kDresidual, bool kDweight>
void backward_rows(const RmsNormShape& s, const RmsNormBackwardArgs& a) {
  using A = acc_t<T>;
  const std::vector<A> weight = weight_as<T, A>(a.weight, s.cols);
  const std::int64_t blocks =
      std::min((s.rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock, kMaxBlocks);
  if (blocks == 0) {
    if constexpr (kDweight) std::fill_n(static_cast<T*>(a.dweight), s.cols, store_as<T>(A(0)));
    return;
  }
  const std::int64_t rows_per_block = (s.rows + blocks - 1) / blocks;
  const std::unique_ptr<double[]> partials(kDweight ? new double[blocks * s.cols] : nullptr);
  const std::int64_t row_bytes = s.cols * std::int64_t{sizeof(T)};
  const OutputWrite w =
      output_write((3 + kGradR + kDresidual) * s.rows * row_bytes, a.dx, s.rows * row_bytes);
  if constexpr (kDresidual) advise_second_output(w, a.dresidual, s.rows * row_bytes);
  const bool stream = w.stream;
  parallel_if(s.rows * s.cols >= kParallelMin, [&] {
    populate_rows(w, a.dx, s.rows, row_bytes, row_bytes);
    if constexpr (kDresidual) populate_rows(w, a.dresidual, s.rows, row_bytes, row_bytes);
#pragma omp for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b) {
      double* partial = kDweight ? partials.get() + b * s.cols : nullptr;
      if constexpr (kDweight) std::fill_n(partial, s.cols, 0.0);
      const std::int64_t end = std::min(s.rows, (b + 1) * rows_per_block);
      for (std::int64_t row = b * rows_per_block; row < end; ++row)
        backward_row<T, kGradR, kDresidual, kDweight>(
            s, a, weight.data(), row, row + 1 < s.rows ? row + 1 : row, stream, partial);
    }
    hwy::FlushStream();
  });
  if constexpr (kDweight) {
    T* dw = static_cast<T*>(a.dweight);
    parallel_if(blocks * s.cols >= kParallelMin, [&] {
#pragma omp for schedule(static)
      for (std::int64_t c0 = 0; c0 < s.cols; c0 += kCombineCols) {
        const std::int64_t width = std::min(kCombineCols, s.cols - c0);
        double sum[kCombineCols] = {};
        for (std::int64_t b = 0; b < blocks; ++b) {
          const double* p = partials.get() + b * s.cols + c0;
#pragma omp simd
          for (std::int64_t c = 0; c < width; ++c) sum[c] += p[c];
        }
        for (std::int64_t c = 0; c < width; ++c) dw[c0 + c] = from_double<T>(sum[c]);
      }
    });
  }
}

// Calls f(bool_constant<flag>{}).
template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag)
    f(std::true_type{});
  else
    f(std::false_type{});
}

}  // namespace

void RmsNormForward(const RmsNormShape& s, const RmsNormForwardArgs& a) {
  dispatch_float(s.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    with_flag(a.residual != nullptr, [&](auto residual) {
      with_flag(a.multiplier != 1.0, [&](auto scale) { forward_rows<T, residual, scale>(s, a); });
    });
  });
}

void RmsNormBackward(const RmsNormShape& s, const RmsNormBackwardArgs& a) {
  dispatch_float(s.dtype, "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    with_flag(a.grad_r != nullptr, [&](auto grad_r) {
      with_flag(a.dresidual != nullptr, [&](auto dresidual) {
        with_flag(a.dweight != nullptr,
                  [&](auto dweight) { backward_rows<T, grad_r, dresidual, dweight>(s, a); });
      });
    });
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(RmsNormForward);
HWY_EXPORT(RmsNormBackward);

void rmsnorm_forward(const RmsNormShape& s, const RmsNormForwardArgs& a, const Stream&) {
  HWY_DYNAMIC_DISPATCH(RmsNormForward)(s, a);
}

void rmsnorm_backward(const RmsNormShape& s, const RmsNormBackwardArgs& a, const Stream&) {
  HWY_DYNAMIC_DISPATCH(RmsNormBackward)(s, a);
}

}  // namespace meshfuse::detail::cpu
#endif
