// exp_choice: meshfuse's VExp (src/ops/cpu_simd-inl.h) against Highway's hn::Exp
// (hwy/contrib/math), on every SIMD target this build has and the CPU allows: the rate of each
// over a 4 KiB array in L1, summed as the softmax and cross_entropy loops sum their exps, and the
// worst error in ulp over [-87, 0] (the range the kernels pass: shifted logits, -gate). One thread.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "exp_choice.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "ops/cpu_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {

// Elements per second of exp over x (repeated `reps` times), and the worst ulp error over x.
template <bool kOurs>
void Measure(const float* x, std::int64_t n, std::int64_t reps, double* rate, double* ulp) {
  const DF d;
  const auto exp = [&](VF v) {
    if constexpr (kOurs)
      return VExp(d, v);
    else
      return hn::Exp(d, v);
  };
  VF sum = hn::Zero(d);
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t r = 0; r < reps; ++r)
    for (std::int64_t i = 0; i < n; i += hn::Lanes(d)) sum = hn::Add(sum, exp(hn::LoadU(d, x + i)));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *rate = double(n) * double(reps) / s + 0 * LaneSum(d, sum);  // the sum keeps the loop alive
  std::vector<float> out(n);
  for (std::int64_t i = 0; i < n; i += hn::Lanes(d))
    hn::StoreU(exp(hn::LoadU(d, x + i)), d, &out[i]);
  double worst = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double exact = std::exp(double(x[i]));
    const double unit = std::ldexp(1.0, std::max(std::ilogb(exact), -126) - 23);
    worst = std::max(worst, std::fabs(out[i] - exact) / unit);
  }
  *ulp = worst;
}
void MeasureOurs(const float* x, std::int64_t n, std::int64_t reps, double* rate, double* ulp) {
  Measure<true>(x, n, reps, rate, ulp);
}
void MeasureHighway(const float* x, std::int64_t n, std::int64_t reps, double* rate, double* ulp) {
  Measure<false>(x, n, reps, rate, ulp);
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {
HWY_EXPORT(MeasureOurs);
HWY_EXPORT(MeasureHighway);
}  // namespace meshfuse::detail::cpu

int main() {
  using namespace meshfuse::detail::cpu;
  constexpr std::int64_t kN = 1024, kReps = 200000;
  std::vector<float> x(kN);
  for (std::int64_t i = 0; i < kN; ++i) x[i] = -87.0f * float(i) / float(kN - 1);
  std::printf("target   ours Gexp/s  hwy Exp Gexp/s  ours/hwy  ours max ulp  hwy max ulp\n");
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    double ours[2], theirs[2];
    for (int trial = 0; trial < 3; ++trial) {  // the best of three: the machine is shared
      double r, u;
      HWY_DYNAMIC_DISPATCH(MeasureOurs)(x.data(), kN, kReps / 10, &r, &u);
      if (trial == 0 || r > ours[0]) ours[0] = r, ours[1] = u;
      HWY_DYNAMIC_DISPATCH(MeasureHighway)(x.data(), kN, kReps / 10, &r, &u);
      if (trial == 0 || r > theirs[0]) theirs[0] = r, theirs[1] = u;
    }
    std::printf("%-8s %11.2f  %14.2f  %8.2f  %12.2f  %11.2f\n", hwy::TargetName(target),
                ours[0] / 1e9, theirs[0] / 1e9, ours[0] / theirs[0], ours[1], theirs[1]);
  }
  hwy::SetSupportedTargetsForTest(0);
}
#endif
