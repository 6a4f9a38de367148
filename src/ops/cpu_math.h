// Vectorisable math and output stores for the cpu backend (internal). glibc declares its vector
// expf (libmvec) only under -ffast-math, which would also break NaN/inf semantics; declared for
// `omp simd` by hand it measured no faster inside the kernels, although faster alone, so the
// kernels use the exp below (figures: docs/kernels/common.md).
#pragma once

#ifdef __linux__
#include <sys/mman.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "ops/common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace meshfuse::detail::cpu {

// exp(r) for |r| <= ln2/2 as 1 + r + c2 r^2 + ... + c6 r^6 (Horner from c6): minimax for the
// relative error, 2.0e-9 (fitted by reweighted least squares at Chebyshev points). It replaced the
// degree-7 Taylor polynomial (6e-9): one multiply-add less, and vexp16 within 1.06 ulp against
// 0.94 (every float in [-103, 88.7]).
inline constexpr std::array<float, 7> kExpPoly = {1.384365140e-03f,
                                                  8.374156430e-03f,
                                                  4.166800156e-02f,
                                                  1.666643173e-01f,
                                                  4.999999404e-01f,
                                                  1.0f,
                                                  1.0f};

// exp(x) in float, within 2 ulp of the correctly rounded value (subnormal results included);
// 0 for x <= -104 (true value below half the smallest subnormal), +inf past ln(FLT_MAX), NaN for
// NaN. Branch-free, so `#pragma omp simd` loops vectorise.
// Method: x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by kExpPoly, then two
// exact scalings by 2^(n/2) so that neither factor leaves the normal range. The range ends need no
// selects: x is clamped to [-104, 89], where the scalings themselves round to 0 (below -103.97) or
// overflow to inf (above ln(FLT_MAX)), and a NaN passes through the clamps. Selecting the range
// ends after the fact made GCC compute every value under masks: this form is ~30% fewer vector
// ops.
inline float vexp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;         // ln2 with 9 trailing zero bits
  constexpr float kLn2Lo = 1.428606765330187045e-06f;  // ln2 - kLn2Hi
  constexpr float kRound = 12582912.0f;                // 1.5 * 2^23: adding rounds to integer
  constexpr float kMin = -104.0f, kMax = 89.0f;        // n = round(x / ln2) stays in [-150, 128]
  float xc = x < kMin ? kMin : x;
  xc = xc > kMax ? kMax : xc;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (std::size_t i = 1; i < kExpPoly.size(); ++i) p = p * r + kExpPoly[i];
  // 2^k for an integer-valued float k in [-126, 127]: k + 127 sits in the low mantissa bits of
  // (k + kRound + 127); shifting by 23 moves it into the exponent field.
  const auto pow2 = [](float k) {
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(k + (kRound + 127.0f)) << 23);
  };
  const float n1 = (n * 0.5f + kRound) - kRound;
  return (p * pow2(n1)) * pow2(n - n1);
}

#if defined(__AVX512F__)
// vexp on 16 lanes with AVX-512's rounding and scaling instructions: the same reduction and
// polynomial, 2^n applied by vscalefps, which rounds subnormal results once and overflows to inf
// (about half the vector ops of the vectorised vexp). Within 2 ulp as vexp (1.06 ulp measured over
// every float in [-103, 88.7]); NaN stays NaN, -inf gives 0 (x is first clamped below at -104;
// vmaxps keeps a NaN in its second operand); finite x past ln(FLT_MAX) gives +inf. No clamp above
// (one vector op of 13 less): x = +inf reduces to inf - inf, and what vscalefps makes of that is
// not relied on. Every caller passes x <= 0 (a shifted logit, up to rounding) or -g for silu,
// where g = -inf
// gives NaN whatever exp gives (-inf / (1 + exp(inf)) or -inf / NaN).
// (The all-lanes masked forms: GCC 12 warns on the plain ones' undefined pass-through.)
inline __m512 vexp16(__m512 x) {
  constexpr __mmask16 kAll = 0xffff;
  x = _mm512_maskz_max_ps(kAll, _mm512_set1_ps(-104.0f), x);
  const __m512 n =
      _mm512_maskz_roundscale_ps(kAll, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (std::size_t i = 1; i < kExpPoly.size(); ++i)
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_maskz_scalef_ps(kAll, p, n);
}

// The sum (or the max) of a vector's lanes in lane order.
inline float lane_sum(__m512 v) {
  alignas(64) float lane[16];
  _mm512_store_ps(lane, v);
  float sum = 0;
  for (const float x : lane) sum += x;
  return sum;
}
inline double lane_sum(__m512d v) {
  alignas(64) double lane[8];
  _mm512_store_pd(lane, v);
  double sum = 0;
  for (const double x : lane) sum += x;
  return sum;
}
inline float lane_max(__m512 v) {
  alignas(64) float lane[16];
  _mm512_store_ps(lane, v);
  float max = lane[0];
  for (const float x : lane) max = x > max ? x : max;
  return max;
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 elements as floats; lanes outside k read as 0.
template <typename T>
__m512 load16(const T* p, __mmask16 k) {
  constexpr __mmask16 kAll = 0xffff;
  if constexpr (std::is_same_v<T, float>)
    return _mm512_maskz_loadu_ps(k, p);
  else if constexpr (std::is_same_v<T, bfloat16>)
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(
        kAll, _mm512_maskz_cvtepu16_epi32(kAll, _mm256_maskz_loadu_epi16(k, p)), 16));
  else
    return _mm512_maskz_cvtph_ps(kAll, _mm256_maskz_loadu_epi16(k, p));
}

// The lanes of elements [j, n) among 16 from j.
inline __mmask16 tail_mask(std::int64_t j, std::int64_t n) {
  return n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
}

// Brings the line 2 KB past p into L1: a loop that streams a row from memory while it computes
// calls it once per 64 bytes (the hardware prefetchers alone left the memory reads idle). The
// address is formed as an integer: past the end of the tensor it points nowhere, which a prefetch
// (it never faults) may do but C++ pointer arithmetic may not.
inline void prefetch_ahead(const void* p) {
  constexpr std::uintptr_t kAheadBytes = 2048;
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) + kAheadBytes),
               _MM_HINT_T0);
}

#endif
#endif

inline std::int64_t max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// A function of a 16-bit float (bf16 or f16) as a table of its value, in float, at each of the
// 65536 arguments, indexed by the argument's bits: one gather (lookup16) in place of the
// arithmetic. For silu (an exp and a division) it is faster (gates touch a few thousand entries,
// which stay in L1); for the exp alone, inside the softmax and cross_entropy forward loops, it
// measured slower than vexp16. 256 KiB.
template <typename T>
class Table16 {
  static_assert(kSixteenBit<T>);

 public:
  // Entry i = f(the value whose bits are i), f taking and returning a float.
  template <typename F>
  requires std::is_invocable_r_v<float, F&, float>
  explicit Table16(F&& f) : entries_(kSize) {
    for (int i = 0; i < kSize; ++i)
      entries_[i] = f(to_float(std::bit_cast<T>(static_cast<std::uint16_t>(i))));
  }
  float operator[](T x) const { return entries_[std::bit_cast<std::uint16_t>(x)]; }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // f of the elements [p, p + 16) in the lanes of k; the other lanes are 0 (nothing is read there).
  __m512 lookup16(const T* p, __mmask16 k) const {
    const __m512i index = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_maskz_loadu_epi16(k, p));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, index, entries_.data(), 4);
  }
#endif

 private:
  static constexpr int kSize = 1 << 16;
  std::vector<float> entries_;
};

// Non-temporal (streaming) stores for large outputs. An ordinary store first reads the line it
// writes (read for ownership), so a kernel reading k streams and writing one moves k + 2 of them;
// streaming stores skip that read, as memcpy does for large copies (the copy the bandwidth figures
// are measured with). GCC 12 ignores `omp simd nontemporal`, hence the intrinsics; other targets
// take ordinary stores. A thread's streaming stores are weakly ordered: it calls stream_fence()
// before other threads may read what it wrote.
inline void stream_fence() {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
}

// Whether a kernel touching `bytes` in all (inputs and outputs) should stream its output `out`
// (`out_bytes` long): when they do not fit in the threads' L2 caches, and the output's pages are
// already mapped. The L2 caches, not the L3 a VM reports (shared with other tenants), are what
// streaming pays off past. A freshly allocated output (large mallocs are fresh mappings; PyTorch's
// CPU tensors are) is zeroed page by page into the cache by the OS on first touch, and a streaming
// store then evicts that line and writes it again: slower. mincore() tells whether the page in
// the middle of the output is mapped yet (the first may hold the allocator's header). Figures:
// docs/kernels/common.md.
inline bool stream_worthwhile(std::int64_t bytes, const void* out, std::int64_t out_bytes) {
  static const std::int64_t l2 = [] {
    long size = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
    size = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return std::int64_t{size > 0 ? size : 1 << 20};
  }();
  if (bytes <= l2 * max_threads()) return false;
#ifdef __linux__
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t mid =
      reinterpret_cast<std::uintptr_t>(out) + static_cast<std::uintptr_t>(out_bytes / 2);
  unsigned char mapped = 1;
  if (mincore(reinterpret_cast<void*>(mid & ~(page - 1)), 1, &mapped) == 0 && !(mapped & 1))
    return false;
#else
  (void)out, (void)out_bytes;
#endif
  return true;
}

// The cache level stream_out brings the next rows to. L2 (prefetcht2) suits a kernel whose next
// pass reads its rows once more from cache with few operands (rmsnorm forward: prefetches into
// L1 competed with the streaming stores for fill buffers); kernels that read two or three rows
// ahead measured faster with L1 (softmax and swiglu backward).
enum class PrefetchTo { L1, L2 };

// Up to three rows to bring into cache while stream_out writes (null entries are skipped).
template <typename T>
struct Prefetch {
  std::array<const char*, 3> rows{};
  int count = 0;
  PrefetchTo to;
  Prefetch(std::initializer_list<const T*> next, std::int64_t offset, PrefetchTo level)
      : to(level) {
    for (const T* p : next)
      if (p && count < 3) rows[count++] = reinterpret_cast<const char*>(p + offset);
  }
  void operator()(std::int64_t byte) const {
    for (int k = 0; k < count; ++k) {
      if (to == PrefetchTo::L2)
        __builtin_prefetch(rows[k] + byte, 0, 1);
      else
        __builtin_prefetch(rows[k] + byte, 0, 3);
    }
  }
};

// Stores one 64-byte line with an ordinary or a streaming store.
inline void store_line(char* dst, const void* line, bool stream) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_loadu_si512(line);
  if (stream)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  else
    _mm512_storeu_si512(dst, v);
#else
  (void)stream;
  std::memcpy(dst, line, 64);
#endif
}

// Writes the values f(0) .. f(n - 1) (each an A = acc_t<T>) to out as T, rounded as store_as:
// blocks of them are computed into an L1 buffer by a vectorised loop, then converted and stored,
// whole 64-byte lines with streaming stores when `stream` (see stream_worthwhile). While it
// writes, it brings the same elements of each `next` row into cache: a kernel that makes several
// passes over a row passes its next row's inputs, so that they load while this row's output is
// written (its last pass would otherwise leave memory reads idle).
// stream_out_blocks(out, n, stream, fill, next) does the same with fill(c0, len, buf) writing the
// values f(c0) .. f(c0 + len - 1) into buf, for kernels that compute a block with intrinsics.
inline constexpr std::int64_t kStreamOutBlock = 1024;  // values per fill call, at most
template <typename T, typename Fill>
void stream_out_blocks(T* out, std::int64_t n, bool stream, Fill&& fill,
                       std::initializer_list<const std::type_identity_t<T>*> next = {},
                       PrefetchTo level = PrefetchTo::L1) {
  using A = acc_t<T>;
  constexpr std::int64_t kBlock = kStreamOutBlock;
  constexpr std::int64_t kLine = 64 / sizeof(T);  // elements per line
  alignas(64) A buf[kBlock];
  alignas(64) T conv[kLine];
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
    std::int64_t i = head;
    for (; i + kLine <= len; i += kLine) {
      if (i + kLine < len) prefetch((i + kLine) * std::int64_t{sizeof(T)});
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
      if constexpr (std::is_same_v<T, bfloat16>) {
        // vcvtne2ps2bf16 rounds to nearest even and quietens NaNs as to_bfloat16 does, but
        // flushes subnormal inputs to zero: a line holding one takes the portable path.
        const __m512 lo = _mm512_loadu_ps(buf + i), hi = _mm512_loadu_ps(buf + i + 16);
        if (!(_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20))) {
          const __m512i v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
          if (stream)
            _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), v);
          else
            _mm512_storeu_si512(dst + i, v);
          continue;
        }
      }
#endif
#ifdef _OPENMP
#pragma omp simd
#endif
      for (std::int64_t k = 0; k < kLine; ++k) conv[k] = store_as<T>(buf[i + k]);
      store_line(reinterpret_cast<char*>(dst + i), conv, stream);
    }
    for (; i < len; ++i) dst[i] = store_as<T>(buf[i]);
  }
}

template <typename T, typename F>
void stream_out(T* out, std::int64_t n, bool stream, F&& f,
                std::initializer_list<const std::type_identity_t<T>*> next = {},
                PrefetchTo level = PrefetchTo::L1) {
  stream_out_blocks(
      out, n, stream,
      [&](std::int64_t c0, std::int64_t len, acc_t<T>* buf) {
#ifdef _OPENMP  // this header is also compiled without OpenMP (tests)
#pragma omp simd
#endif
        for (std::int64_t i = 0; i < len; ++i) buf[i] = f(c0 + i);
      },
      next, level);
}

// The f64 kernels use the libm exp: double loops are not the fast path.
inline double vexp(double x) { return std::exp(x); }

}  // namespace meshfuse::detail::cpu
