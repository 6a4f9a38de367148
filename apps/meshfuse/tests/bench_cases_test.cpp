// The bench cases called directly at a tiny model: every kernel they name exists, and every
// direction runs and matches the reference in every bench dtype.
#include <gtest/gtest.h>

#include <algorithm>

#include "bench_cases/case.h"
#include "meshfuse/core/kernel_backend.h"

namespace meshfuse::cli {
namespace {

BenchSetup tiny_setup(DType dtype) {
  BenchSetup s;
  s.model.name = "tiny";
  s.model.hidden_size = 64;
  s.model.intermediate_size = 96;
  s.model.num_attention_heads = 4;
  s.model.num_key_value_heads = 2;
  s.model.head_dim = 16;
  s.model.vocab_size = 100;
  s.model.rms_norm_eps = 1e-5;
  s.tokens = 24;  // more than the linears' 16 checked rows
  s.seq_len = 6;   // the recurrent and sequence cases
  s.dtype = dtype;
  return s;
}

TEST(BenchCases, EveryCaseNamesRegisteredKernels) {
  const std::vector<KernelInfo> kernels = registered_kernels();
  for (const BenchCase& c : all_cases()) {
    EXPECT_FALSE(c.kernels.empty()) << c.name;
    for (const std::string& kernel : c.kernels)
      EXPECT_TRUE(std::any_of(kernels.begin(), kernels.end(),
                              [&](const KernelInfo& k) { return k.op == kernel; }))
          << c.name << " names the unregistered kernel " << kernel;
  }
}

TEST(BenchCases, CaseNamesAreUniqueAndDistinctFromGroups) {
  std::vector<std::string> names;
  for (const BenchCase& c : all_cases()) names.push_back(c.name);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  for (const BenchCase& c : all_cases())
    EXPECT_EQ(std::count(names.begin(), names.end(), c.group), 0) << c.group;
}

TEST(BenchCases, ToleranceScalesAtolByTheOutputsMagnitude) {
  EXPECT_DOUBLE_EQ(tolerance(DType::BF16).atol, 2e-2);
  EXPECT_DOUBLE_EQ(tolerance(DType::BF16, 4.0).atol, 8e-2);
  EXPECT_DOUBLE_EQ(tolerance(DType::BF16, 4.0).rtol, 2e-2);
  EXPECT_DOUBLE_EQ(tolerance(DType::F32, 0.5).atol, 5e-6);
  // Over many terms the fp32 accumulation error (4 units of 2^-24 times sqrt(terms)) dominates.
  EXPECT_DOUBLE_EQ(tolerance(DType::F32, 2.0, 1 << 20).atol, 2 * 4 * 0x1p-24 * 1024);
  EXPECT_DOUBLE_EQ(tolerance(DType::BF16, 2.0, 1 << 20).atol, 2 * 2e-2);
  // f16 keeps 2^-24 absolute precision below its normal range: atol never goes under 4 steps.
  EXPECT_DOUBLE_EQ(tolerance(DType::F16, 1e-9).atol, 4 * 0x1p-24);
}

TEST(BenchCases, CompareOutputCountsElementsOutsideTheTolerance) {
  Tensor expected({4}, DType::F32), actual({4}, DType::F32);
  for (int i = 0; i < 4; ++i) expected.data_ptr<float>()[i] = actual.data_ptr<float>()[i] = 1.0f;
  actual.data_ptr<float>()[2] = 1.1f;
  const Comparison c = compare_output("y", actual, expected, {0.01, 0.01});
  EXPECT_EQ(c.name, "y");
  EXPECT_EQ(c.diff.violations, 1);
  EXPECT_NEAR(c.diff.max_abs_err, 0.1, 1e-6);
  EXPECT_EQ(compare_output("y", actual, expected, {0.2, 0.0}).diff.violations, 0);
}

class BenchCasesInDtype : public ::testing::TestWithParam<DType> {};

TEST_P(BenchCasesInDtype, EveryDirectionRunsAndMatchesTheReference) {
  const BenchSetup s = tiny_setup(GetParam());
  for (const BenchCase& c : all_cases()) {
    const std::vector<Direction> directions = c.make(s);
    // Every op has a forward; all but continuous_count a backward.
    ASSERT_EQ(directions.size(), c.name == "continuous_count" ? 1u : 2u) << c.name;
    EXPECT_EQ(directions[0].direction, "forward");
    if (directions.size() == 2) {
      EXPECT_EQ(directions[1].direction, "backward");
    }
    for (const Direction& d : directions) {
      EXPECT_TRUE(std::find(c.kernels.begin(), c.kernels.end(), d.kernel) != c.kernels.end())
          << c.name << " " << d.kernel;
      EXPECT_NE(d.bytes > 0, d.flops > 0) << c.name << ": rated by bytes or by flops";
      EXPECT_FALSE(d.formula.empty()) << c.name;
      d.run();
      const std::vector<Comparison> comparisons = d.check();
      EXPECT_FALSE(comparisons.empty()) << c.name;
      for (const Comparison& cmp : comparisons)
        EXPECT_EQ(cmp.diff.violations, 0)
            << c.name << " " << d.direction << " " << cmp.name << ": max abs "
            << cmp.diff.max_abs_err << ", atol " << cmp.tolerance.atol;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BenchDtypes, BenchCasesInDtype,
                         ::testing::Values(DType::BF16, DType::F16, DType::F32),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(BenchCases, SwigluCountsBenchmarkingBytes) {
  const BenchSetup s = tiny_setup(DType::BF16);
  const std::vector<BenchCase> cases = all_cases();
  const BenchCase swiglu = *std::find_if(cases.begin(), cases.end(),
                                         [](const BenchCase& c) { return c.name == "swiglu"; });
  const std::vector<Direction> d = swiglu.make(s);
  EXPECT_DOUBLE_EQ(d[0].bytes, 3.0 * 24 * 96 * 2);  // 3·N·I·e
  EXPECT_DOUBLE_EQ(d[1].bytes, 5.0 * 24 * 96 * 2);  // 5·N·I·e
}

TEST(BenchCases, LinearCountsTwoFlopsPerMultiplyAdd) {
  const BenchSetup s = tiny_setup(DType::F32);
  const std::vector<BenchCase> cases = all_cases();
  const BenchCase gate = *std::find_if(cases.begin(), cases.end(),
                                       [](const BenchCase& c) { return c.name == "linear_gate"; });
  const std::vector<Direction> d = gate.make(s);
  EXPECT_EQ(d[0].shape, "x: [24, 64], weight: [96, 64]");
  EXPECT_DOUBLE_EQ(d[0].flops, 2.0 * 24 * 96 * 64);
  EXPECT_DOUBLE_EQ(d[1].flops, 4.0 * 24 * 96 * 64);  // grad_x and grad_weight
  EXPECT_TRUE(d[0].blas && d[1].blas);
}

}  // namespace
}  // namespace meshfuse::cli
