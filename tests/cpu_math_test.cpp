#include <cmath>
#include <limits>

#include "ops/cpu_math.h"
#include "test_util.h"

namespace meshfuse {
namespace {

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

}  // namespace
}  // namespace meshfuse
