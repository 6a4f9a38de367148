// The cpu backend's row log-sum-exp, shared by softmax and cross_entropy (internal).
//
// Two passes over the row (max, then the exp-sum) rather than one online pass that rescales the
// running sum (Milakov & Gimelshein 2018): rows up to ~500k f32 fit in L2, so the second pass
// does not reach memory, the kernel is bound by exp, and two passes measured faster. The max
// pass, bound by memory, runs one row ahead inside the exp pass (row_sum_exp_next_max), so the two
// overlap; it prefetches that row 2 KB ahead (prefetch_ahead). A table of exp at every 16-bit
// logit (as the swiglu forward's silu, Table16) measured slower inside these loops: the gather
// costs as much as the polynomial. Figures: docs/kernels/softmax.md.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "ops/common.h"
#include "ops/cpu_math.h"

namespace meshfuse::detail::cpu {

// The type of a row's sum of exps: float for 16-bit rows, double for f32 and f64 ones. An f32
// row's sum in f32 is off by several ulp (thousands of additions per lane), an error that the lse,
// and so every probability of the row, takes whole; cross_entropy keeps that lse in double.
template <typename T>
using exp_sum_t = std::conditional_t<kSixteenBit<T>, float, double>;

// Of one row v_j = m * x_j (in A = acc_t<T>): max = max_j v_j and sum_v = sum_j v_j.
template <typename A>
struct RowMax {
  A max;
  A sum_v;
};

template <typename T>
RowMax<acc_t<T>> row_max(const T* x, std::int64_t n, acc_t<T> m) {
  using A = acc_t<T>;
  A max = -std::numeric_limits<A>::infinity(), sum_v = 0;
#pragma omp simd reduction(max : max) reduction(+ : sum_v)
  for (std::int64_t j = 0; j < n; ++j) {
    const A v = A(to_float(x[j])) * m;
    max = v > max ? v : max;
    sum_v += v;
  }
  return {max, sum_v};
}

// The shift that keeps exp(v - shift) <= 1 (up to rounding). A row entirely -inf is shifted by 0,
// so its exps are 0 (not exp(-inf - -inf) = NaN) and its sum 0: log(0) = -inf, as torch.logsumexp.
template <typename A>
A exp_shift(A max) {
  return max == -std::numeric_limits<A>::infinity() ? A(0) : max;
}

// The rows [begin, end) of the calling thread of a `#pragma omp parallel` region: contiguous, as
// schedule(static) would give, so that a thread can read ahead into its next row.
inline std::pair<std::int64_t, std::int64_t> thread_rows(std::int64_t rows) {
#ifdef _OPENMP
  const std::int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
  const std::int64_t threads = 1, t = 0;
#endif
  return {rows * t / threads, rows * (t + 1) / threads};
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16-bit floats (bf16, f16: sign and magnitude) as int16 keys in the same order as their values
// (the magnitude bits of negatives flipped): their max is one vpmaxsw per 32 values, with no
// conversion. A positive NaN's key is above +inf's: it wins, where the float max skips it; the
// row's sum is NaN either way.
inline __m512i ordered_key(__m512i bits) {
  return _mm512_xor_si512(bits,
                          _mm512_and_si512(_mm512_srai_epi16(bits, 15), _mm512_set1_epi16(0x7fff)));
}

// The value of the largest key in `keys` (the key map is its own inverse).
template <typename T>
float max_of_keys(__m512i keys) {
  alignas(64) std::int16_t lane[32];
  _mm512_store_si512(lane, keys);
  std::int16_t max = lane[0];
  for (const std::int16_t k : lane) max = k > max ? k : max;
  const auto bits = static_cast<std::uint16_t>(max ^ ((max >> 15) & 0x7fff));
  return to_float(std::bit_cast<T>(bits));
}
#endif

// sum_j exp(m * x_j - shift) of one row (storing the exps in `exps` when kStoreExps) fused with
// row_max of the next row (its sum_v only when kSumV; 0 otherwise): the exp pass is bound by
// arithmetic and reads its row from L2, the max pass by memory, so in one loop the next row streams
// in while the exps are computed. The max is that of row_max (exact); the sums are added in another
// order. A NaN in the row makes the sum NaN, and so does +inf (shift = inf, exp(inf - inf)): every
// result derived from the row is then NaN, as in PyTorch. With AVX-512 the loop is written with
// vexp16: the kernels that call it (softmax and cross_entropy forward) are bound by this exp and
// by the ops around it, so non-empty 16-bit rows scaled by m > 0, without kSumV, take the next
// row's max on ordered_key (max_j m x_j = m max_j x_j: rounding is monotonic), 3 vector ops per
// 32 values for 5 per 16 as floats. The sum is an exp_sum_t: f32 rows add their exps in f32 lanes
// for kWideningVectors vectors at a time, then into double lanes (a few ops per 256 values; adding
// every vector into double lanes measured 1.25x the f32 cross_entropy forward's time).
template <bool kStoreExps, bool kSumV, typename T>
std::pair<exp_sum_t<T>, RowMax<acc_t<T>>> row_sum_exp_next_max(const T* x, const T* next,
                                                               std::int64_t n, acc_t<T> m,
                                                               acc_t<T> shift, acc_t<T>* exps) {
  using A = acc_t<T>;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<A, float>) {
    const __m512 vm = _mm512_set1_ps(m), vshift = _mm512_set1_ps(shift);
    __m512 sum = _mm512_setzero_ps();
    // f32 rows: `sum` holds at most kWideningVectors exps per lane before it is added into
    // wide_lo / wide_hi (its lanes 0-7 and 8-15 in double) and cleared.
    constexpr bool kWide = !kSixteenBit<T>;
    constexpr std::int64_t kWideningVectors = 16;
    // (The all-lanes masked forms: GCC 12 warns on the plain ones' undefined pass-through.)
    __m512d wide_lo = _mm512_setzero_pd(), wide_hi = _mm512_setzero_pd();
    const auto widen = [&] {
      const __m512d bits = _mm512_castps_pd(sum);
      const __m256 lo = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, bits, 0));
      const __m256 hi = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, bits, 1));
      wide_lo = _mm512_add_pd(wide_lo, _mm512_maskz_cvtps_pd(0xff, lo));
      wide_hi = _mm512_add_pd(wide_hi, _mm512_maskz_cvtps_pd(0xff, hi));
      sum = _mm512_setzero_ps();
    };
    const auto add_exps = [&](std::int64_t j) {
      const __mmask16 k = tail_mask(j, n);
      const __m512 e = vexp16(_mm512_fmsub_ps(load16(x + j, k), vm, vshift));
      if constexpr (kStoreExps) _mm512_mask_storeu_ps(exps + j, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    };
    constexpr bool kKeys = !kSumV && kSixteenBit<T>;
    if constexpr (kKeys) {
      if (n > 0 && m > 0 && m < std::numeric_limits<A>::infinity()) {
        __m512i keys = _mm512_set1_epi16(std::numeric_limits<std::int16_t>::min());
        for (std::int64_t j = 0; j < n; j += 32) {
          prefetch_ahead(next + j);
          add_exps(j);
          if (j + 16 < n) add_exps(j + 16);
          const __mmask32 k = n - j >= 32 ? ~__mmask32(0) : __mmask32((1u << (n - j)) - 1);
          keys = _mm512_mask_max_epi16(keys, k, keys,
                                       ordered_key(_mm512_maskz_loadu_epi16(k, next + j)));
        }
        return {lane_sum(sum), {max_of_keys<T>(keys) * m, A(0)}};
      }
    }
    __m512 sum_v = _mm512_setzero_ps();
    __m512 max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (std::int64_t j = 0; j < n; j += 16) {
      if (j * std::int64_t{sizeof(T)} % 64 == 0) prefetch_ahead(next + j);
      add_exps(j);
      if constexpr (kWide)
        if ((j / 16 + 1) % kWideningVectors == 0) widen();
      const __mmask16 k = tail_mask(j, n);
      const __m512 v = _mm512_mul_ps(load16(next + j, k), vm);
      max = _mm512_mask_max_ps(max, k, v, max);  // a NaN v keeps max, as `v > max ? v : max`
      if constexpr (kSumV) sum_v = _mm512_mask_add_ps(sum_v, k, sum_v, v);
    }
    if constexpr (kWide) {
      widen();
      return {lane_sum(_mm512_add_pd(wide_lo, wide_hi)),
              {lane_max(max), kSumV ? lane_sum(sum_v) : A(0)}};
    } else {
      return {lane_sum(sum), {lane_max(max), kSumV ? lane_sum(sum_v) : A(0)}};
    }
  }
#endif
  exp_sum_t<T> sum = 0;
  A max = -std::numeric_limits<A>::infinity(), sum_v = 0;
#pragma omp simd reduction(+ : sum, sum_v) reduction(max : max)
  for (std::int64_t j = 0; j < n; ++j) {
    const A e = vexp(A(to_float(x[j])) * m - shift);
    if constexpr (kStoreExps) exps[j] = e;
    sum += exp_sum_t<T>(e);
    const A v = A(to_float(next[j])) * m;
    max = v > max ? v : max;
    if constexpr (kSumV) sum_v += v;
  }
  return {sum, {max, sum_v}};
}

}  // namespace meshfuse::detail::cpu
