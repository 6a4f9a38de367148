// Vectorisable math for the cpu backend (internal). glibc declares its vector expf only under
// -ffast-math, which would also break NaN/inf semantics, so the cpu kernels use this exp instead.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

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

// The f64 kernels use the libm exp: double loops are not the fast path.
inline double vexp(double x) { return std::exp(x); }

}  // namespace meshfuse::detail::cpu
