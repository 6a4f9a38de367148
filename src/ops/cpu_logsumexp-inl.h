// The cpu backend's row log-sum-exp, shared by softmax and cross_entropy (internal).
//
// Two passes over the row (max, then the exp-sum) rather than one online pass that rescales the
// running sum (Milakov & Gimelshein 2018): rows up to ~500k f32 fit in L2, so the second pass
// does not reach memory, the kernel is bound by exp, and two passes measured faster. The max
// pass, bound by memory, runs one row ahead inside the exp pass (row_sum_exp_next_max), so the two
// overlap; it prefetches that row 2 KB ahead (PrefetchAhead). A table of exp at every 16-bit
// logit (as the swiglu forward's silu, Table16) measured slower inside these loops: the gather
// costs as much as the polynomial. Figures: docs/kernels/softmax.md. Compiled once per SIMD
// target, as cpu_simd-inl.h (included the same way).

#if defined(MESHFUSE_OPS_CPU_LOGSUMEXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MESHFUSE_OPS_CPU_LOGSUMEXP_INL_H_
#undef MESHFUSE_OPS_CPU_LOGSUMEXP_INL_H_
#else
#define MESHFUSE_OPS_CPU_LOGSUMEXP_INL_H_
#endif

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
#include "ops/cpu_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {

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

// 16-bit floats (bf16, f16: sign and magnitude) as int16 keys in the same order as their values
// (the magnitude bits of negatives flipped): their max is one integer max per vector of 16-bit
// lanes, with no conversion. A positive NaN's key is above +inf's: it wins, where the float max
// skips it; the row's sum is NaN either way.
template <class D16>
HWY_INLINE hn::Vec<D16> OrderedKey(D16 d, hn::Vec<D16> bits) {
  return hn::Xor(bits, hn::And(hn::ShiftRight<15>(bits), hn::Set(d, 0x7fff)));
}

// The value of the key `max` (the key map is its own inverse).
template <typename T>
float KeyValue(std::int16_t max) {
  return to_float(std::bit_cast<T>(static_cast<std::uint16_t>(max ^ ((max >> 15) & 0x7fff))));
}

// sum_j exp(m * x_j - shift) of one row (storing the exps in `exps` when kStoreExps; `exps` has
// room for whole vectors past n) fused with row_max of the next row (its sum_v only when kSumV;
// 0 otherwise): the exp pass is bound by arithmetic and reads its row from L2, the max pass by
// memory, so in one loop the next row streams in while the exps are computed. The max is that of
// row_max (exact); the sums are added in another order. A NaN in the row makes the sum NaN, and so
// does +inf (shift = inf, exp(inf - inf)): every result derived from the row is then NaN, as in
// PyTorch. Non-empty 16-bit rows scaled by m > 0, without kSumV, take the next row's max on
// OrderedKey (max_j m x_j = m max_j x_j: rounding is monotonic), fewer vector ops than as floats.
// The sum is an exp_sum_t: f32 rows add their exps in f32 lanes for kWideningVectors vectors at a
// time, then into double lanes (a few ops per 256 values; adding every vector into double lanes
// measured 1.25x the f32 cross_entropy forward's time). f64 rows, and every row on HWY_SCALAR (one
// lane: the portable fallback), take the compiler-vectorised loop.
template <bool kStoreExps, bool kSumV, typename T>
std::pair<exp_sum_t<T>, RowMax<acc_t<T>>> row_sum_exp_next_max(const T* x, const T* next,
                                                               std::int64_t n, acc_t<T> m,
                                                               acc_t<T> shift, acc_t<T>* exps) {
  using A = acc_t<T>;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<A, float>) {
    const DF d;
    const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
    const VF vm = hn::Set(d, m), vshift = hn::Set(d, shift);
    VF sum = hn::Zero(d);
    // f32 rows: `sum` holds at most kWideningVectors exps per lane before it is added into
    // wide_lo / wide_hi (its lower and upper halves in double) and cleared.
    constexpr bool kWide = !kSixteenBit<T>;
    constexpr std::int64_t kWideningVectors = 16;
    const hn::Half<DF> dh;
    const hn::Rebind<double, hn::Half<DF>> dd;
    auto wide_lo = hn::Zero(dd), wide_hi = hn::Zero(dd);
    const auto widen = [&] {
      wide_lo = hn::Add(wide_lo, hn::PromoteTo(dd, hn::LowerHalf(dh, sum)));
      wide_hi = hn::Add(wide_hi, hn::PromoteTo(dd, hn::UpperHalf(dh, sum)));
      sum = hn::Zero(d);
    };
    // The values of x from j (fewer than a vector at the row's end: the other lanes give 0).
    // Always inlined: GCC called it out of line (through the PLT) from the AVX2 and SSE4 16-bit
    // loops below, each call spilling the exp's constants.
    const auto add_exps = [&](std::int64_t j) __attribute__((always_inline)) {
      const bool full = j + lanes <= n;
      const VF v = full ? LoadF(d, x + j) : LoadFTail(d, x + j, n - j);
      VF e = VExp(d, hn::MulSub(v, vm, vshift));
      if constexpr (kStoreExps) hn::StoreU(e, d, exps + j);
      if (!full) e = hn::IfThenElseZero(hn::FirstN(d, n - j), e);
      sum = hn::Add(sum, e);
    };
    constexpr bool kKeys = !kSumV && kSixteenBit<T>;
    if constexpr (kKeys) {
      if (n > 0 && m > 0 && m < std::numeric_limits<A>::infinity()) {
        const hn::Repartition<std::int16_t, DF> dk;  // twice the lanes of d
        const auto* keys_in = reinterpret_cast<const std::int16_t*>(next);
        auto keys = hn::Set(dk, std::numeric_limits<std::int16_t>::min());
        HWY_ALIGN std::int16_t tail[2 * kMaxLanes];
        for (std::int64_t j = 0; j < n; j += 2 * lanes) {
          PrefetchAhead(next + j);
          add_exps(j);
          if (j + lanes < n) add_exps(j + lanes);
          const std::int16_t* k = keys_in + j;
          if (j + 2 * lanes > n) {  // the row's end: pad with the bits of the smallest key
            // (0xffff, a negative NaN's; the bits 0x8000 are -0's, which topped a negative row).
            std::fill(tail, tail + 2 * lanes, std::int16_t{-1});
            std::memcpy(tail, k, (n - j) * sizeof(T));
            k = tail;
          }
          keys = hn::Max(keys, OrderedKey(dk, hn::LoadU(dk, k)));
        }
        return {LaneSum(d, sum), {KeyValue<T>(hn::GetLane(hn::MaxOfLanes(dk, keys))) * m, A(0)}};
      }
    }
    VF sum_v = hn::Zero(d);
    VF max = hn::Set(d, -std::numeric_limits<float>::infinity());
    const std::int64_t per_line = 64 / std::int64_t{sizeof(T)};
    for (std::int64_t j = 0; j < n; j += lanes) {
      if (j % per_line == 0) PrefetchAhead(next + j);
      add_exps(j);
      if constexpr (kWide)
        if ((j / lanes + 1) % kWideningVectors == 0) widen();
      const bool full = j + lanes <= n;
      VF v = hn::Mul(full ? LoadF(d, next + j) : LoadFTail(d, next + j, n - j), vm);
      // A NaN v keeps max, as `v > max ? v : max`; the lanes past the row's end keep it too.
      auto take = hn::Gt(v, max);
      if (!full) take = hn::And(take, hn::FirstN(d, n - j));
      max = hn::IfThenElse(take, v, max);
      if constexpr (kSumV) {
        if (!full) v = hn::IfThenElseZero(hn::FirstN(d, n - j), v);
        sum_v = hn::Add(sum_v, v);
      }
    }
    const A sum_v_total = kSumV ? LaneSum(d, sum_v) : A(0);
    if constexpr (kWide) {
      widen();
      return {LaneSum(dd, hn::Add(wide_lo, wide_hi)), {LaneMax(d, max), sum_v_total}};
    } else {
      return {LaneSum(d, sum), {LaneMax(d, max), sum_v_total}};
    }
  } else
#endif
  {
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
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MESHFUSE_OPS_CPU_LOGSUMEXP_INL_H_
