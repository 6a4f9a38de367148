// Vectorisable math for the cpu backend (internal). glibc declares its vector expf only under
// -ffast-math, which would also break NaN/inf semantics, so the cpu kernels use this exp instead.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace meshfuse::detail::cpu {

// exp(x) in float, within 2 ulp of the correctly rounded value (subnormal results included);
// 0 for x <= -104 (true value below half the smallest subnormal), +inf past ln(FLT_MAX), NaN for
// NaN. Branch-free, so `#pragma omp simd` loops vectorise.
// Method: x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by its degree-7
// Taylor polynomial (truncation error < 6e-9 relative), then two exact scalings by 2^(n/2) so that
// neither factor leaves the normal range. The range ends need no selects: x is clamped to
// [-104, 89], where the scalings themselves round to 0 (below -103.97) or overflow to inf (above
// ln(FLT_MAX)), and a NaN passes through the clamps. Selecting the range ends after the fact made
// GCC compute every value under masks: this form is ~30% fewer vector ops.
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
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^k for an integer-valued float k in [-126, 127]: k + 127 sits in the low mantissa bits of
  // (k + kRound + 127); shifting by 23 moves it into the exponent field.
  const auto pow2 = [](float k) {
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(k + (kRound + 127.0f)) << 23);
  };
  const float n1 = (n * 0.5f + kRound) - kRound;
  return (p * pow2(n1)) * pow2(n - n1);
}

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

// Whether a kernel touching `bytes` in all (inputs and outputs) should stream its outputs: only
// when inputs and outputs together exceed the last-level cache, as memcpy does. Below it, ordinary
// stores leave the output in cache for whatever reads it next, and streaming measured slower (the
// CLI's rmsnorm, 16384 x 4096 bf16, 256 MiB under a 260 MiB L3: ~20% in two runs).
inline bool stream_worthwhile(std::int64_t bytes) {
  static const std::int64_t llc = [] {
#ifdef _SC_LEVEL3_CACHE_SIZE
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) return std::int64_t{l3};
#endif
    return std::int64_t{32} << 20;
  }();
  return bytes > llc;
}

// Writes the values f(0) .. f(n - 1) (each a T) to out: blocks of them are computed into an L1
// buffer by a vectorised loop, then copied out, whole 64-byte lines with streaming stores when
// `stream` (see stream_worthwhile).
template <typename T, typename F>
void stream_out(T* out, std::int64_t n, bool stream, F&& f) {
  constexpr std::int64_t kBlock = 2048 / sizeof(T);
  alignas(64) T buf[kBlock];
  for (std::int64_t c0 = 0; c0 < n; c0 += kBlock) {
    const std::int64_t len = std::min(kBlock, n - c0);
#ifdef _OPENMP  // this header is also compiled without OpenMP (tests)
#pragma omp simd
#endif
    for (std::int64_t i = 0; i < len; ++i) buf[i] = f(c0 + i);
    auto* dst = reinterpret_cast<char*>(out + c0);
    const auto* src = reinterpret_cast<const char*>(buf);
    std::int64_t bytes = len * static_cast<std::int64_t>(sizeof(T));
#if defined(__AVX512F__)
    if (stream) {
      // Ordinary stores up to the first line boundary, then whole lines, then the tail.
      const std::int64_t head =
          std::min(bytes, std::int64_t(-reinterpret_cast<std::intptr_t>(dst) & 63));
      std::memcpy(dst, src, static_cast<std::size_t>(head));
      dst += head, src += head, bytes -= head;
      for (; bytes >= 64; dst += 64, src += 64, bytes -= 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(src));
    }
#else
    (void)stream;
#endif
    std::memcpy(dst, src, static_cast<std::size_t>(bytes));
  }
}

// The f64 kernels use the libm exp: double loops are not the fast path.
inline double vexp(double x) { return std::exp(x); }

}  // namespace meshfuse::detail::cpu
