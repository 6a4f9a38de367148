// The cpu backend on every SIMD target this build has and the CPU allows, each pinned in turn
// (hwy::SetSupportedTargetsForTest): the reduction ops within the reference's tolerances on each
// (their sums' order follows the vector width), the element-wise ones bitwise equal across
// targets. ctest also runs the whole op suite with MESHFUSE_CPU_TARGET set (tests/CMakeLists.txt).
#include <hwy/highway.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "meshfuse/core/platform.h"
#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::make_labels;
using test::randn;

// Runs f once per target, that target pinned, with its name.
template <typename F>
void on_every_target(F&& f) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    f(std::string(hwy::TargetName(target)));
  }
  hwy::SetSupportedTargetsForTest(0);
}

bool bitwise_equal(const TensorView& a, const TensorView& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Columns that leave a tail after every vector width (16, 8, 4 floats).
constexpr std::int64_t kRows = 6, kCols = 1037;

TEST(CpuTargets, InfoNamesThePinnedTarget) {
  const std::vector<std::string> built = cpu_simd_targets();
  EXPECT_NE(std::find(built.begin(), built.end(), cpu_simd_target()), built.end());
  std::vector<std::string> seen;
  on_every_target([&](const std::string&) { seen.push_back(cpu_simd_target()); });
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), "scalar");  // the fallback every CPU has
}

TEST(CpuTargets, ReductionOpsMatchTheReferenceOnEveryTarget) {
  for (const DType dtype : test::kFloatDTypes) {
    SCOPED_TRACE(to_string(dtype));
    const Tensor x = randn({kRows, kCols}, dtype, 1, 3.0), dy = randn({kRows, kCols}, dtype, 2);
    const Tensor w = randn({kCols}, dtype, 3);
    const Tensor labels = make_labels(kRows, kCols, DType::I64, 4);
    const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
    struct Out {
      Tensor softmax, softmax_grad, loss, lse, ce_grad, y, rstd, dx, dw;
    };
    const auto run = [&] {
      Out r{test::empty_like(x),
            test::empty_like(x),
            Tensor({kRows}, dtype),
            Tensor({kRows}, cross_entropy_lse_dtype(dtype)),
            test::empty_like(x),
            test::empty_like(x),
            Tensor({kRows}, rmsnorm_rstd_dtype(dtype)),
            test::empty_like(x),
            test::empty_like(w)};
      softmax(x, r.softmax);
      softmax_backward(dy, r.softmax, r.softmax_grad);
      cross_entropy(x, labels, r.loss, r.lse, o);
      cross_entropy_backward(randn({kRows}, dtype, 5), x, labels, r.lse, r.ce_grad, o);
      rmsnorm(x, w, r.y, r.rstd, 1e-5);
      rmsnorm_backward(dy, x, w, r.rstd, r.dx, r.dw);
      return r;
    };
    Out ref;
    {
      ForceKernelBackend force(KernelBackend::Reference);
      ref = run();
    }
    // The inputs' tolerance throughout (an f32 row's lse is f64, computed from f32 exps).
    const double tol = testing::default_tolerance(dtype);
    on_every_target([&](const std::string&) {
      const Out got = run();
      expect_close(got.softmax, ref.softmax, tol, "softmax");
      expect_close(got.softmax_grad, ref.softmax_grad, tol, "softmax_backward");
      expect_close(got.loss, ref.loss, tol, "cross_entropy loss");
      expect_close(got.lse, ref.lse, tol, "cross_entropy lse");
      expect_close(got.ce_grad, ref.ce_grad, tol, "cross_entropy_backward");
      expect_close(got.y, ref.y, tol, "rmsnorm");
      expect_close(got.rstd, ref.rstd, tol, "rmsnorm rstd");
      expect_close(got.dx, ref.dx, tol, "rmsnorm_backward dx");
      expect_close(got.dw, ref.dw, tol, "rmsnorm_backward dweight");
    });
  }
}

// add and mul round each element once from an exact fma or product; swiglu on 16-bit gates reads
// silu from the same tables on every target: the same bits everywhere.
TEST(CpuTargets, ElementwiseOpsAndSixteenBitSwigluAreBitwiseEqualAcrossTargets) {
  for (const DType dtype : test::kFloatDTypes) {
    SCOPED_TRACE(to_string(dtype));
    const Tensor a = randn({kRows, kCols}, dtype, 6), b = randn({kRows, kCols}, dtype, 7);
    const bool sixteen = dtype == DType::BF16 || dtype == DType::F16;
    std::vector<Tensor> first;
    on_every_target([&](const std::string& name) {
      std::vector<Tensor> out;
      for (int i = 0; i < (sixteen ? 5 : 2); ++i) out.push_back(test::empty_like(a));
      add(a, b, out[0], 0.37);
      mul(a, -1.7, out[1]);
      if (sixteen) {
        swiglu(a, b, out[2]);
        swiglu_backward(b, a, b, out[3], out[4]);
      }
      if (first.empty()) {
        first = std::move(out);
        return;
      }
      for (std::size_t i = 0; i < out.size(); ++i)
        EXPECT_TRUE(bitwise_equal(out[i], first[i])) << "output " << i << " on " << name;
    });
  }
}

}  // namespace
}  // namespace meshfuse
