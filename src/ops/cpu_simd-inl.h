// The cpu backend's SIMD building blocks, written in Google Highway's portable ops and compiled
// once per SIMD target (internal). A kernel file includes it after <hwy/foreach_target.h> and
// calls it from its own HWY_NAMESPACE; HWY_DYNAMIC_DISPATCH then runs the best target the CPU has
// (or the one MESHFUSE_CPU_TARGET pins: src/core/cpu_target.cpp). Figures:
// docs/kernels/cpu_simd.md.

// Per-target include guard (Highway's convention: the toggle flips once per target).
#if defined(MESHFUSE_OPS_CPU_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MESHFUSE_OPS_CPU_SIMD_INL_H_
#undef MESHFUSE_OPS_CPU_SIMD_INL_H_
#else
#define MESHFUSE_OPS_CPU_SIMD_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "ops/common.h"
#include "ops/cpu_math.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Full vectors of f32 and the matching integer vectors.
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
// The vector's lanes as elements of type T (16-bit types: half a vector's bytes).
template <typename T>
using DOf = hn::Rebind<std::conditional_t<sizeof(T) == 2, std::uint16_t, float>, DF>;

// The most lanes a vector of DF has (on SVE a bound, not the run-time count): stack buffers' size.
inline constexpr std::size_t kMaxLanes = hn::MaxLanes(DF());

#define MESHFUSE_HWY_SCALEF (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
// exp(r) for |r| <= ln2/2 given x and n = round(x / ln2): the Cody-Waite split and kExpPoly.
HWY_INLINE VF ExpReduced(DF d, VF x, VF n) {
  VF r = hn::NegMulAdd(n, hn::Set(d, 0.693145751953125f), x);
  r = hn::NegMulAdd(n, hn::Set(d, 1.428606765330187045e-06f), r);
  VF p = hn::Set(d, kExpPoly[0]);
  for (std::size_t i = 1; i < kExpPoly.size(); ++i) p = hn::MulAdd(p, r, hn::Set(d, kExpPoly[i]));
  return p;
}
// exp(x) on the lanes of x: the reduction and polynomial of the scalar vexp (cpu_math.h),
// x = n ln2 + r with |r| <= ln2/2, exp(r) by kExpPoly; then 2^n. AVX-512 scales by vscalefps,
// which rounds subnormal results once and overflows to inf in one instruction (Highway has no op
// for it: one of the two intrinsics kept, see docs/kernels/cpu_simd.md); other targets scale by
// two exact factors 2^(n/2) as the scalar vexp does. Within 2 ulp (subnormal results included); NaN
// stays NaN; -inf gives 0; finite x past ln(FLT_MAX) gives +inf (on AVX-512 +inf itself is outside
// the domain: every caller passes x <= 0, up to rounding, or -gate, where silu(-inf) is NaN
// anyway). Highway's own hn::Exp (hwy/contrib/math) measured slower on every target, and gives 0
// for NaN (bench/exp_choice; figures in docs/kernels/cpu_simd.md).
HWY_INLINE VF VExp(DF d, VF x) {
#if MESHFUSE_HWY_SCALEF
  // Clamped with a compare, which is false for NaN, so a NaN passes through (Highway leaves Min
  // and Max of a NaN to the target and compiler: relying on maxps returning its second operand
  // gave numbers for NaN on an Intel Xeon's build).
  x = hn::IfThenElse(hn::Lt(x, hn::Set(d, -104.0f)), hn::Set(d, -104.0f), x);
  const VF n = hn::Round(hn::Mul(x, hn::Set(d, 1.44269504088896341f)));
  const VF p = ExpReduced(d, x, n);
  return VF{_mm512_maskz_scalef_ps(0xffff, p.raw, n.raw)};  // (maskz: GCC 12 warns on the plain)
#else
  // n = round(x / ln2) by adding 1.5 * 2^23, whose bits then hold n in the low mantissa bits:
  // three ops where a Round and a ConvertTo (with Highway's overflow fix-ups) take six.
  constexpr float kRound = 12582912.0f;
  const DI di;
  const VF vround = hn::Set(d, kRound), log2e = hn::Set(d, 1.44269504088896341f);
  VF t = hn::MulAdd(x, log2e, vround);
  VF n = hn::Sub(t, vround);
  // Every lane with |n| <= 125 (false for NaN and +-inf): 2^n is normal and so is p * 2^n, which
  // is then n added to p's exponent field, exactly the two-factor product below. Seven ops fewer
  // than the general path, whose clamps and second factor only results outside [2^-125, 2^126]
  // need; rows of shifted logits rarely have one.
  if (HWY_LIKELY(hn::AllTrue(d, hn::Le(hn::Abs(n), hn::Set(d, 125.0f))))) {
    const auto ni = hn::Sub(hn::BitCast(di, t), hn::BitCast(di, vround));
    return hn::BitCast(d, hn::Add(hn::BitCast(di, ExpReduced(d, x, n)), hn::ShiftLeft<23>(ni)));
  }
  // Clamped with compares, as above, so that n stays in [-150, 128] and both factors 2^(n/2) are
  // exact: the scalar vexp's scaling.
  x = hn::IfThenElse(hn::Lt(x, hn::Set(d, -104.0f)), hn::Set(d, -104.0f), x);
  x = hn::IfThenElse(hn::Gt(x, hn::Set(d, 89.0f)), hn::Set(d, 89.0f), x);
  t = hn::MulAdd(x, log2e, vround);
  n = hn::Sub(t, vround);
  const VF p = ExpReduced(d, x, n);
  // 2^k for an integer k in [-126, 127]: k + 127 shifted into the exponent field.
  const auto pow2 = [&](hn::Vec<DI> k) {
    return hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(k, hn::Set(di, 127))));
  };
  const auto ni = hn::Sub(hn::BitCast(di, t), hn::BitCast(di, vround));
  const auto n1 = hn::ShiftRight<1>(ni);
  return hn::Mul(hn::Mul(p, pow2(n1)), pow2(hn::Sub(ni, n1)));
#endif
}

// Whether Highway converts f16 with instructions (x86: F16C, from AVX2 up; Arm). Its x86 fallback
// mishandles infinities and NaNs and truncates where it should round: those targets convert with
// to_float / to_float16 (meshfuse/core/dtype.h) one element at a time.
#define MESHFUSE_HWY_F16_HARDWARE (!HWY_ARCH_X86 || HWY_TARGET < HWY_SSE4)

// Lanes(d) elements of T from p as floats.
template <typename T>
HWY_INLINE VF LoadF(DF d, const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(d, p);
  } else {
    const DOf<T> d16;
    const auto bits = hn::LoadU(d16, reinterpret_cast<const std::uint16_t*>(p));
    if constexpr (std::is_same_v<T, bfloat16>) {
      return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(DU(), bits)));
    } else {
#if MESHFUSE_HWY_F16_HARDWARE
      const hn::Rebind<hwy::float16_t, DF> dh;
      return hn::PromoteTo(d, hn::BitCast(dh, bits));
#else
      HWY_ALIGN float wide[kMaxLanes];
      for (std::size_t i = 0; i < hn::Lanes(d); ++i) wide[i] = to_float(p[i]);
      return hn::Load(d, wide);
#endif
    }
  }
}

// The first n < Lanes(d) elements of T from p as floats, the other lanes 0; reads nothing past
// p + n (Highway's MaskedLoad may read the whole vector for 16-bit lanes).
template <typename T>
HWY_INLINE VF LoadFTail(DF d, const T* p, std::size_t n) {
  HWY_ALIGN T buf[kMaxLanes] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return LoadF(d, buf);
}

// The lanes' sum (or max) in lane order, independent of the compiler's reduction tree.
template <class D>
HWY_INLINE hn::TFromD<D> LaneSum(D d, hn::Vec<D> v) {
  HWY_ALIGN hn::TFromD<D> lane[hn::MaxLanes(D())];
  hn::Store(v, d, lane);
  hn::TFromD<D> sum = 0;
  for (std::size_t i = 0; i < hn::Lanes(d); ++i) sum += lane[i];
  return sum;
}
HWY_INLINE float LaneMax(DF d, VF v) {
  HWY_ALIGN float lane[kMaxLanes];
  hn::Store(v, d, lane);
  float max = lane[0];
  for (std::size_t i = 0; i < hn::Lanes(d); ++i) max = lane[i] > max ? lane[i] : max;
  return max;
}

// Brings the line 2 KB past p into L1: a loop that streams a row from memory while it computes
// calls it once per 64 bytes (the hardware prefetchers alone left the memory reads idle). The
// address is formed as an integer: past the end of the tensor it points nowhere, which a prefetch
// (it never faults) may do but C++ pointer arithmetic may not.
HWY_INLINE void PrefetchAhead(const void* p) {
  constexpr std::uintptr_t kAheadBytes = 2048;
  hwy::Prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) + kAheadBytes));
}

// The Table16 indices of elements [p, p + Lanes(DF)): their bits; n < Lanes reads only n elements
// (the other lanes index entry 0).
template <typename T>
HWY_INLINE hn::Vec<DI> TableIndex(const T* p, std::size_t n) {
  const DOf<T> d16;
  HWY_ALIGN std::uint16_t buf[kMaxLanes] = {};
  const std::uint16_t* bits = reinterpret_cast<const std::uint16_t*>(p);
  if (n < hn::Lanes(DF())) bits = static_cast<const std::uint16_t*>(std::memcpy(buf, p, n * 2));
  return hn::BitCast(DI(), hn::PromoteTo(DU(), hn::LoadU(d16, bits)));
}

// f(elements [p, p + Lanes)) from a Table16, one gather; n < Lanes as TableIndex.
template <typename T>
HWY_INLINE VF Lookup(DF d, const Table16<T>& table, const T* p, std::size_t n) {
  return hn::GatherIndex(d, table.data(), TableIndex(p, n));
}

// f(first, second): the two values of the FloatPair entries (their bits) of elements
// [p, p + Lanes), from two 64-bit gathers of half a vector each, half the elements that two 32-bit
// gathers load (the gathers bound the swiglu backward on AMD Zen 4); n < Lanes as TableIndex. Not
// on the scalar target, which has no halves of a vector.
#if HWY_TARGET != HWY_SCALAR
template <typename T, typename F>
HWY_INLINE auto LookupPair(DF d, const Table16<T, std::uint64_t>& table, const T* p,
                           std::size_t n, const F& f) {
  // Lane 2i of a gathered vector is entry i's first value, lane 2i + 1 its second.
  static_assert(std::endian::native == std::endian::little);
  const hn::Repartition<std::uint64_t, DF> d64;
  const hn::RebindToSigned<decltype(d64)> di64;
  const hn::Half<DI> dh;
  const auto index = TableIndex(p, n);
  const auto gather = [&](auto half) {
    return hn::BitCast(d, hn::GatherIndex(d64, table.data(), hn::PromoteTo(di64, half)));
  };
  const VF lower = gather(hn::LowerHalf(dh, index));
  const VF upper = gather(hn::UpperHalf(dh, index));
  return f(hn::ConcatEven(d, upper, lower), hn::ConcatOdd(d, upper, lower));
}
#endif

// Stores one 64-byte line with an ordinary or a streaming store (dst 64-byte aligned).
HWY_INLINE void StoreLine(char* dst, const void* line, bool stream) {
  const hn::ScalableTag<std::uint8_t> d8;
  const std::size_t step = std::min<std::size_t>(hn::Lanes(d8), 64);
  const hn::CappedTag<std::uint8_t, 64> dc;
  for (std::size_t b = 0; b < 64; b += step) {
    const auto v = hn::LoadU(dc, static_cast<const std::uint8_t*>(line) + b);
    if (stream)
      hn::Stream(v, dc, reinterpret_cast<std::uint8_t*>(dst + b));
    else
      hn::StoreU(v, dc, reinterpret_cast<std::uint8_t*>(dst + b));
  }
}

// 32 floats as one 64-byte line of 16-bit T at out (64-byte aligned), rounded as store_as<T>,
// with ordinary or streaming stores. Vector targets convert two vectors of floats into one full
// vector of T and store it from the register: a line converted into an L1 buffer with half-vector
// stores and copied out with full-vector loads stalled on store forwarding (each load spans two
// stores): half of the AVX2 bf16 softmax forward's output pass. bf16: to nearest even, NaN
// quietened, subnormals kept (AVX512-BF16's vcvtne2ps2bf16, which StoreLinesAvx512Bf16 uses where
// the CPU has it, flushes them, and is not in Highway's AVX-512 target), in seven vector ops per
// vector of floats and a narrowing of two into one. f16 where Highway converts it with
// instructions.
template <typename T>
HWY_INLINE void StoreLine16(const float* in, T* out, bool stream) {
#if HWY_TARGET == HWY_SCALAR
  constexpr bool kVector = false;
#else
  constexpr bool kVector = std::is_same_v<T, bfloat16> || MESHFUSE_HWY_F16_HARDWARE;
#endif
  if constexpr (!kVector) {  // one element at a time into L1, then the line
    HWY_ALIGN T conv[32];
    for (std::int64_t k = 0; k < 32; ++k) conv[k] = store_as<T>(in[k]);
    StoreLine(reinterpret_cast<char*>(out), conv, stream);
  } else {
#if HWY_TARGET != HWY_SCALAR
    // At most 16 floats a vector: each step fills one vector of 2 x Lanes(d) <= 32 elements.
    const hn::CappedTag<float, 16> d;
    const hn::Repartition<std::uint16_t, decltype(d)> d16;
    const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
    auto* bits = reinterpret_cast<std::uint16_t*>(out);
    for (std::int64_t k = 0; k < 32; k += 2 * lanes) {
      hn::Vec<decltype(d16)> v;
      if constexpr (std::is_same_v<T, bfloat16>) {
        const hn::RebindToUnsigned<decltype(d)> du;
        // The rounded float's bits, the bf16 in their upper half.
        const auto rounded = [&](const float* p) {
          const auto u = hn::BitCast(du, hn::LoadU(d, p));
          const auto nan = hn::Gt(hn::And(u, hn::Set(du, 0x7fffffffu)), hn::Set(du, 0x7f800000u));
          const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
          return hn::BitCast(d16, hn::IfThenElse(nan, hn::Or(u, hn::Set(du, 0x400000u)),
                                                 hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), odd))));
        };
        v = hn::ConcatOdd(d16, rounded(in + k + lanes), rounded(in + k));
      } else {
#if MESHFUSE_HWY_F16_HARDWARE
        // Combined as u16 halves: Highway's NEON target has no Combine of f16 vectors.
        const hn::Rebind<hwy::float16_t, decltype(d)> dh;
        const hn::Rebind<std::uint16_t, decltype(d)> dh16;
        const auto half = [&](const float* p) {
          return hn::BitCast(dh16, hn::DemoteTo(dh, hn::LoadU(d, p)));
        };
        v = hn::Combine(d16, half(in + k + lanes), half(in + k));
#endif
      }
      if (stream)
        hn::Stream(v, d16, bits + k);
      else
        hn::Store(v, d16, bits + k);
    }
#endif
  }
}

#if MESHFUSE_HWY_SCALEF
// StoreLines (below) for bf16 on a CPU with AVX512-BF16 (Cooper Lake, Zen 4): vcvtne2ps2bf16
// rounds 32 floats in one instruction as to_bfloat16 does, except that it flushes subnormal inputs,
// so a line holding one takes StoreLine16. Highway 1.0.3's AVX-512 target lacks AVX512-BF16: this
// function alone is compiled with it, and called where the CPU has it (HasAvx512Bf16). Converting
// a whole block first and copying its lines out afterwards made the bf16 forwards 1.1-1.5x slower
// than this conversion in registers straight to the output (docs/kernels/cpu_simd.md).
__attribute__((target(HWY_TARGET_STR ",avx512bf16"))) HWY_NOINLINE inline std::int64_t
StoreLinesAvx512Bf16(bfloat16* dst, const float* buf, std::int64_t head, std::int64_t len,
                     bool stream, const Prefetch<bfloat16>& prefetch) {
  constexpr std::int64_t kLine = 32;  // bf16 per 64-byte line
  std::int64_t i = head;
  for (; i + kLine <= len; i += kLine) {
    if (i + kLine < len) prefetch((i + kLine) * std::int64_t{sizeof(bfloat16)});
    const __m512 lo = _mm512_loadu_ps(buf + i), hi = _mm512_loadu_ps(buf + i + 16);
    if (_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20)) {
      StoreLine16(buf + i, dst + i, stream);
      continue;
    }
    const __m512i v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), v);
    else
      _mm512_storeu_si512(dst + i, v);
  }
  return i;
}
inline bool HasAvx512Bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

// Stores whole 64-byte lines of T at dst + head, dst + head + kLine, ... up to len from the
// values buf[head ..] (dst + head 64-byte aligned), 16-bit lines converted in registers
// (StoreLine16), f32 and f64 ones copied, with ordinary or streaming stores; the line after each
// is prefetched through `prefetch`. Returns the first element not stored.
template <typename T>
HWY_INLINE std::int64_t StoreLines(T* dst, const acc_t<T>* buf, std::int64_t head, std::int64_t len,
                                   bool stream, const Prefetch<T>& prefetch) {
#if MESHFUSE_HWY_SCALEF
  if constexpr (std::is_same_v<T, bfloat16>)
    if (HasAvx512Bf16()) return StoreLinesAvx512Bf16(dst, buf, head, len, stream, prefetch);
#endif
  constexpr std::int64_t kLine = 64 / sizeof(T);  // elements per line
  std::int64_t i = head;
  for (; i + kLine <= len; i += kLine) {
    if (i + kLine < len) prefetch((i + kLine) * std::int64_t{sizeof(T)});
    if constexpr (std::is_same_v<T, acc_t<T>>)
      StoreLine(reinterpret_cast<char*>(dst + i), buf + i, stream);
    else
      StoreLine16(buf + i, dst + i, stream);
  }
  return i;
}

// Writes the values f(0) .. f(n - 1) (each an A = acc_t<T>) to out as T, rounded as store_as:
// blocks of them are computed into an L1 buffer, then converted and stored, whole 64-byte lines
// with streaming stores when `stream` (see output_write). While it writes, it brings the
// same elements of each `next` row into cache: a kernel that makes several passes over a row
// passes its next row's inputs, so that they load while this row's output is written (its last
// pass would otherwise leave memory reads idle).
// StreamOutBlocks(out, n, stream, fill, next) does the same with fill(c0, len, buf) writing the
// values f(c0) .. f(c0 + len - 1) into buf, for kernels that compute a block with vectors; buf
// holds kStreamOutBlock values, so fill may store whole vectors past len.
template <typename T, typename Fill>
void StreamOutBlocks(T* out, std::int64_t n, bool stream, Fill&& fill,
                     std::initializer_list<const std::type_identity_t<T>*> next = {},
                     PrefetchTo level = PrefetchTo::L1) {
  using A = acc_t<T>;
  constexpr std::int64_t kBlock = kStreamOutBlock;
  HWY_ALIGN A buf[kBlock];
  for (std::int64_t c0 = 0; c0 < n; c0 += kBlock) {
    const std::int64_t len = std::min(kBlock, n - c0);
    fill(c0, len, buf);
    T* dst = out + c0;
    const Prefetch<T> prefetch(next, c0, level);
    // Ordinary stores up to the first line boundary, then whole lines, then the tail.
    const std::int64_t head = std::min(
        len, std::int64_t(-reinterpret_cast<std::intptr_t>(dst) & 63) / std::int64_t{sizeof(T)});
    for (std::int64_t i = 0; i < head; ++i) dst[i] = store_as<T>(buf[i]);
    prefetch(0);
    std::int64_t i = StoreLines(dst, buf, head, len, stream, prefetch);
    for (; i < len; ++i) dst[i] = store_as<T>(buf[i]);
  }
}

template <typename T, typename F>
void StreamOut(T* out, std::int64_t n, bool stream, F&& f,
               std::initializer_list<const std::type_identity_t<T>*> next = {},
               PrefetchTo level = PrefetchTo::L1) {
  StreamOutBlocks(
      out, n, stream,
      [&](std::int64_t c0, std::int64_t len, acc_t<T>* buf) {
#ifdef _OPENMP
#pragma omp simd
#endif
        for (std::int64_t i = 0; i < len; ++i) buf[i] = f(c0 + i);
      },
      next, level);
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MESHFUSE_OPS_CPU_SIMD_INL_H_
