#include "ops/cpu_math.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "test_util.h"

namespace meshfuse {
namespace {

using detail::cpu::stream_out;
using detail::cpu::vexp;

TEST(CpuMath, VexpIsWithinTwoUlpFromSubnormalToOverflow) {
  double worst = 0;
  for (float x = -103.9f; x < 88.72f; x += 0.000731f) {
    const double exact = std::exp(static_cast<double>(x));
    // ulp of the float nearest `exact`, never below the subnormal spacing 2^-149.
    const double ulp = std::ldexp(1.0, std::max(std::ilogb(exact), -126) - 23);
    worst = std::max(worst, std::fabs(vexp(x) - exact) / ulp);
  }
  EXPECT_LE(worst, 2.0);
}

TEST(CpuMath, VexpHandlesInfNanAndTheRangeEnds) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(vexp(-inf), 0.0f);
  EXPECT_EQ(vexp(inf), inf);
  EXPECT_EQ(vexp(100.0f), inf);
  EXPECT_EQ(vexp(-104.5f), 0.0f);
  EXPECT_NEAR(vexp(-100.0f), std::exp(-100.0), 1.5e-45);  // a subnormal float
  EXPECT_TRUE(std::isnan(vexp(std::nanf(""))));
  EXPECT_EQ(vexp(0.0f), 1.0f);
}

// Every bf16 above and below each rounding boundary: ties, NaN payloads, inf, subnormals (which the
// AVX512-BF16 conversion would flush; stream_out must not).
std::vector<float> bf16_boundary_values() {
  std::vector<float> v;
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      v.push_back(std::bit_cast<float>(hi << 16 | lo));
  return v;
}

TEST(CpuMath, StreamOutStoresAsStoreAsStreamedOrNotAtAnyAlignment) {
  const std::vector<float> v = bf16_boundary_values();
  const auto n = static_cast<std::int64_t>(v.size());
  std::vector<bfloat16> next(v.size() + 1);
  for (const bool stream : {false, true})
    for (const std::int64_t skew : {0, 1, 7}) {  // out misaligned by `skew` elements
      std::vector<bfloat16> out(v.size() + 64);
      bfloat16* dst = out.data() + skew;
      stream_out(dst, n - skew, stream, [&](std::int64_t i) { return v[i]; },
                 {next.data(), nullptr});
      detail::cpu::stream_fence();
      for (std::int64_t i = 0; i < n - skew; ++i)
        ASSERT_EQ(dst[i].bits, to_bfloat16(v[i]).bits)
            << "value bits " << std::hex << std::bit_cast<std::uint32_t>(v[i]);
    }
}

TEST(CpuMath, StreamOutStoresF32AndF16AsStoreAs) {
  const std::vector<float> v = bf16_boundary_values();
  const auto n = static_cast<std::int64_t>(v.size()) - 3;
  std::vector<float> f32(v.size());
  std::vector<float16> f16(v.size());
  stream_out(f32.data() + 3, n, true, [&](std::int64_t i) { return v[i]; });
  stream_out(f16.data() + 3, n, true, [&](std::int64_t i) { return v[i]; });
  detail::cpu::stream_fence();
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f32[3 + i]), std::bit_cast<std::uint32_t>(v[i]));
    ASSERT_EQ(f16[3 + i].bits, to_float16(v[i]).bits);
  }
}

}  // namespace
}  // namespace meshfuse
