#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "ops/fused_linear_cross_entropy/fused_linear_cross_entropy_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::make_labels;
using test::values;

using test::randn;

Shape loss_shape(std::int64_t rows, Reduction r) {
  return r == Reduction::None ? Shape{rows} : Shape{};
}

// The inputs of one call: x (N, H), weight (V, H), bias (V) or none, labels, and an upstream
// gradient of the loss's shape (varied per row for `none`).
struct Problem {
  Tensor x, weight, bias, labels, grad_loss;
};

Problem make_problem(DType dtype, std::int64_t n, std::int64_t h, std::int64_t v, bool bias,
                     Reduction r, std::uint64_t seed, DType label_dtype = DType::I64) {
  return {randn({n, h}, dtype, seed), randn({v, h}, dtype, seed + 1, 0.3),
          bias ? randn({v}, dtype, seed + 2) : Tensor(), make_labels(n, v, label_dtype, seed + 3),
          r == Reduction::None ? randn({n}, dtype, seed + 4) : test::full({}, dtype, 1.5)};
}

struct Result {
  Tensor loss, grad_x, grad_weight, grad_bias;
};

// Runs the op on the current backend with every gradient output (grad_bias when there is a bias),
// or the loss only.
Result run(const Problem& p, const CrossEntropyOptions& o, std::int64_t chunk_rows,
           bool grads = true) {
  const DType dt = p.x.dtype();
  Result r{Tensor(loss_shape(p.x.size(0), o.reduction), dt), Tensor(), Tensor(), Tensor()};
  if (grads) {
    r.grad_x = Tensor(p.x.shape(), dt);
    r.grad_weight = Tensor(p.weight.shape(), dt);
    if (p.bias.defined()) r.grad_bias = Tensor(p.bias.shape(), dt);
  }
  fused_linear_cross_entropy(p.x, p.weight, p.bias, p.labels,
                             grads ? p.grad_loss.view() : TensorView{}, r.loss, r.grad_x,
                             r.grad_weight, r.grad_bias, o, chunk_rows);
  return r;
}

Result run_reference(const Problem& p, const CrossEntropyOptions& o) {
  ForceKernelBackend force(KernelBackend::Reference);
  return run(p, o, 1);
}

// Tolerance of the cpu backend against the double reference: 16-bit outputs within a few of their
// ulps; f32 loosely, as its logits and gradients are fp32 GEMM sums over H, V and N.
double tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return 1e-10;
    case DType::F32:
      return 1e-4;
    default:
      return testing::default_tolerance(dtype);
  }
}

// The outputs of a and b, pairwise (an output undefined in both is skipped).
std::vector<std::tuple<const Tensor*, const Tensor*, std::string>> outputs(const Result& a,
                                                                           const Result& b) {
  return {{&a.loss, &b.loss, "loss"},
          {&a.grad_x, &b.grad_x, "grad_x"},
          {&a.grad_weight, &b.grad_weight, "grad_weight"},
          {&a.grad_bias, &b.grad_bias, "grad_bias"}};
}

void expect_close(const Result& a, const Result& b, double tol, const std::string& what) {
  for (const auto& [x, y, name] : outputs(a, b)) {
    ASSERT_EQ(x->defined(), y->defined()) << what << " " << name;
    if (x->defined()) test::expect_close(*x, *y, tol, what + " " + name);
  }
}

void expect_bitwise(const Result& a, const Result& b, const std::string& what) {
  for (const auto& [x, y, name] : outputs(a, b)) {
    ASSERT_EQ(x->defined(), y->defined()) << what << " " << name;
    if (x->defined()) {
      EXPECT_TRUE(testing::bitwise_equal(*x, *y)) << what << " " << name;
    }
  }
}

std::vector<CrossEntropyOptions> option_sets(Reduction r) {
  return {{-100, r, 0.0, 1.0, 0.0}, {-100, r, 0.1, 0.7, 1e-3}};
}

class FusedLinearCrossEntropyTest : public ::testing::TestWithParam<DType> {};

TEST_P(FusedLinearCrossEntropyTest, CpuMatchesReferenceForEveryReductionBiasOptionAndChunking) {
  // N = 11 rows in chunks of 4 (the last one partial) or in one chunk; H and V not multiples of
  // the vector width.
  for (bool bias : {false, true})
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      const Problem p = make_problem(GetParam(), 11, 19, 37, bias, r, 1);
      for (const CrossEntropyOptions& o : option_sets(r)) {
        const Result ref = run_reference(p, o);
        for (std::int64_t chunk : {4, 64})
          expect_close(run(p, o, chunk), ref, tolerance(GetParam()),
                       fmt::format("bias={} {} eps={} chunk={}", bias, to_string(r),
                                   o.label_smoothing, chunk));
      }
    }
}

TEST_P(FusedLinearCrossEntropyTest, ChunksOfOneAndThreeRowsAgreeAndChunksOfNOrMoreAreBitwiseEqual) {
  const Problem p = make_problem(GetParam(), 10, 24, 50, true, Reduction::Mean, 2);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const Result whole = run(p, o, 10);
  expect_bitwise(run(p, o, 11), whole, "chunk 11");
  expect_bitwise(run(p, o, 1000), whole, "chunk 1000");
  for (std::int64_t chunk : {1, 3})
    expect_close(run(p, o, chunk), whole, tolerance(GetParam()), fmt::format("chunk {}", chunk));
}

TEST_P(FusedLinearCrossEntropyTest, MatchesTheUnfusedCompositionOfLinearAndCrossEntropy) {
  // linear -> cross_entropy -> cross_entropy_backward -> linear_backward on the cpu backend. It
  // rounds the logits and their gradient to the dtype (the fused op keeps them in fp32), so
  // 16-bit types agree within a few ulps of the dtype; f64 logits are the same GEMM (OpenBLAS's
  // dgemm), f32 ones two of oneDNN's (its matmul primitive fused, its sgemm in linear).
  const std::int64_t n = 12, h = 32, v = 70;
  const Problem p = make_problem(GetParam(), n, h, v, true, Reduction::Mean, 3);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const DType dt = GetParam();
  Tensor logits({n, v}, dt), lse({n}, dt == DType::F64 ? DType::F64 : DType::F32),
      dlogits({n, v}, dt);
  Result unfused{Tensor({}, dt), Tensor({n, h}, dt), Tensor({v, h}, dt), Tensor({v}, dt)};
  linear(p.x, p.weight, p.bias, logits);
  cross_entropy(logits, p.labels, unfused.loss, lse, o);
  cross_entropy_backward(p.grad_loss, logits, p.labels, lse, dlogits, o);
  linear_backward(dlogits, p.x, p.weight, unfused.grad_x, unfused.grad_weight, unfused.grad_bias);
  expect_close(run(p, o, 5), unfused, 2 * tolerance(dt), "chunks of 5");
  expect_close(run(p, o, n), unfused, 2 * tolerance(dt), "one chunk");
  if (dt == DType::F64) expect_bitwise(run(p, o, n), unfused, "one chunk");
}

// The dtypes a parameter's gradient may have for inputs of `dtype`: its own, and f32 for 16-bit.
std::vector<DType> grad_dtypes(DType dtype) {
  if (dtype == DType::BF16 || dtype == DType::F16) return {dtype, DType::F32};
  return {dtype};
}

TEST_P(FusedLinearCrossEntropyTest, SeveralWeightBlocksMatchTheReferenceWithOneOrManyChunks) {
  // 16-bit weights are widened to fp32 a block of rows at a time; blocks of 16 rows over V = 37
  // (the last one partial) cover the block loop, with one chunk and several (a 16-bit grad_weight
  // block's product added and rounded per chunk; an f32 one accumulated by the GEMM).
  const std::int64_t n = 9, h = 16, v = 37;
  const Problem p = make_problem(GetParam(), n, h, v, true, Reduction::None, 4);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  for (DType gdt : grad_dtypes(GetParam())) {
    Result ref{Tensor({n}, GetParam()), test::empty_like(p.x), Tensor(p.weight.shape(), gdt),
               Tensor(p.bias.shape(), gdt)};
    {
      ForceKernelBackend force(KernelBackend::Reference);
      fused_linear_cross_entropy(p.x, p.weight, p.bias, p.labels, p.grad_loss, ref.loss, ref.grad_x,
                                 ref.grad_weight, ref.grad_bias, o);
    }
    for (std::int64_t chunk : {std::int64_t{4}, n}) {
      Result out{Tensor({n}, GetParam()), test::empty_like(p.x), Tensor(p.weight.shape(), gdt),
                 Tensor(p.bias.shape(), gdt)};
      const FusedLinearCrossEntropyShape s{GetParam(),  n,    h,    v,    chunk,
                                           o.reduction, true, true, true, true};
      detail::cpu::fused_linear_cross_entropy_blocked(
          16 * h, s, DType::I64,
          {p.x.data_ptr<void>(), p.weight.data_ptr<void>(), p.bias.data_ptr<void>(),
           p.labels.data_ptr<void>(), p.grad_loss.data_ptr<void>(), out.loss.data_ptr<void>(),
           out.grad_x.data_ptr<void>(), out.grad_weight.data_ptr<void>(),
           out.grad_bias.data_ptr<void>(), gdt, gdt},
          o);
      expect_close(out, ref, tolerance(GetParam()),
                   fmt::format("chunk={} grad dtype {}", chunk, to_string(gdt)));
    }
  }
}

// Unit roundoff of a 16-bit dtype (RNE: |round(y) - y| <= u |y|).
double unit_roundoff(DType dtype) { return dtype == DType::BF16 ? 0x1p-8 : 0x1p-11; }

// grad_weight over many chunks, both ways, against the exact gradient of the reference (double,
// rounded once to f32). Reduction sum, so that the gradient of the first k chunks' rows alone is
// the running sum s_k after chunk k. A 16-bit grad_weight is rounded once per chunk: its error at
// each element is at most sum over k of u |s_k| (plus fp32 GEMM rounding, orders smaller), the
// bound checked here (x1.1 for the rounding of the running sums themselves); typical errors grow
// like sqrt(chunks) u |s|. An f32 grad_weight (also a 16-bit bias's f32 grad_bias) accumulates
// every chunk in fp32: within 1e-5 of the largest value, whatever the number of chunks.
TEST_P(FusedLinearCrossEntropyTest, ManyChunksAccumulateGradWeightAsItsDTypeSays) {
  const DType dt = GetParam();
  if (dt != DType::BF16 && dt != DType::F16) GTEST_SKIP() << "16-bit weights only";
  const std::int64_t n = 64, h = 16, v = 37, chunk = 4, chunks = n / chunk;
  const Problem p = make_problem(dt, n, h, v, true, Reduction::Sum, 19);
  const CrossEntropyOptions o{.reduction = Reduction::Sum};
  // The exact running sums s_k (k = 1..chunks) of grad_weight, from the reference on k chunks.
  std::vector<std::vector<double>> partial;
  for (std::int64_t k = 1; k <= chunks; ++k) {
    Tensor loss({}, dt), dw({v, h}, DType::F32);
    ForceKernelBackend force(KernelBackend::Reference);
    fused_linear_cross_entropy(p.x.view().narrow(0, 0, k * chunk), p.weight, p.bias,
                               p.labels.view().narrow(0, 0, k * chunk), p.grad_loss, loss, {}, dw,
                               {}, o);
    partial.push_back(values(dw));
  }
  const std::vector<double>& exact = partial.back();
  double largest = 0;
  for (double e : exact) largest = std::max(largest, std::fabs(e));

  for (DType gdt : {dt, DType::F32}) {
    Tensor loss({}, dt), dw({v, h}, gdt), db({v}, gdt);
    fused_linear_cross_entropy(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, {}, dw, db, o,
                               chunk);
    const std::vector<double> got = values(dw);
    for (std::size_t i = 0; i < exact.size(); ++i) {
      double bound = 1e-5 * largest;
      if (gdt != DType::F32) {
        double sum = 0;
        for (const std::vector<double>& s : partial) sum += std::fabs(s[i]);
        bound = 1.1 * unit_roundoff(dt) * sum + 1e-5 * largest;
      }
      ASSERT_LE(std::fabs(got[i] - exact[i]), bound) << to_string(gdt) << " element " << i;
    }
    if (gdt == DType::F32) {
      // The bias's gradient (rows' sums of dlogits) in f32 too, against the reference's.
      Tensor ref_db({v}, DType::F32), ref_loss({}, dt);
      ForceKernelBackend force(KernelBackend::Reference);
      fused_linear_cross_entropy(p.x, p.weight, p.bias, p.labels, p.grad_loss, ref_loss, {}, {},
                                 ref_db, o);
      test::expect_close(db, ref_db, 1e-5, "f32 grad_bias");
    }
  }
}

TEST(FusedLinearCrossEntropy, AnF32GradWeightSumsEveryChunkWhereABf16OneRoundsEachAway) {
  // Weight (2, 1) = 0: logits 0, p = 1/2 in both columns, labels 0, reduction sum: every row's
  // dlogits are [-1/2, 1/2], so grad_weight = [-1/2, 1/2] * sum of x. x = [512, 1 x 15]: the first
  // chunk of one row gives 256, then fifteen steps of 1/2 each. bf16 holds 256 with an ulp of 2,
  // so 256 + 1/2 rounds back to 256 every chunk; the f32 grad_weight gets 263.5, and one chunk
  // rounds 263.5 once, to 264 (p is 1/2 within fp32 rounding of exp and log, hence NEAR for f32).
  const std::int64_t n = 16;
  Tensor x = test::full({n, 1}, DType::BF16, 1);
  copy(test::full({1, 1}, DType::F64, 512), x.view().narrow(0, 0, 1));
  const Tensor w = Tensor::zeros({2, 1}, DType::BF16), labels = Tensor::zeros({n}, DType::I64);
  const Tensor grad_loss = test::full({}, DType::BF16, 1);
  const CrossEntropyOptions o{.reduction = Reduction::Sum};
  Tensor loss({}, DType::BF16), dw16({2, 1}, DType::BF16), dw32({2, 1}, DType::F32);
  fused_linear_cross_entropy(x, w, {}, labels, grad_loss, loss, {}, dw16, {}, o, 1);
  fused_linear_cross_entropy(x, w, {}, labels, grad_loss, loss, {}, dw32, {}, o, 1);
  EXPECT_EQ(values(dw16), (std::vector<double>{-256, 256}));
  EXPECT_NEAR(values(dw32)[0], -263.5, 1e-4);
  EXPECT_NEAR(values(dw32)[1], 263.5, 1e-4);
  fused_linear_cross_entropy(x, w, {}, labels, grad_loss, loss, {}, dw16, {}, o, n);
  EXPECT_EQ(values(dw16), (std::vector<double>{-264, 264}));
}

TEST_P(FusedLinearCrossEntropyTest, Int32AndInt64LabelsGiveBitwiseTheSameResults) {
  const Problem p64 = make_problem(GetParam(), 8, 16, 30, false, Reduction::Sum, 5);
  Problem p32 = p64;
  p32.labels = Tensor({8}, DType::I32);
  copy(p64.labels, p32.labels);
  expect_bitwise(run(p32, {.reduction = Reduction::Sum}, 3),
                 run(p64, {.reduction = Reduction::Sum}, 3), "i32 vs i64");
}

TEST_P(FusedLinearCrossEntropyTest, OneRowMatchesReference) {
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    Problem p = make_problem(GetParam(), 1, 33, 65, true, r, 6);
    p.labels = from({1}, DType::I64, {17});
    expect_close(run(p, option_sets(r)[1], 1), run_reference(p, option_sets(r)[1]),
                 tolerance(GetParam()), std::string(to_string(r)));
  }
}

TEST_P(FusedLinearCrossEntropyTest, ZeroRowsGiveEmptyOrNanOrZeroLossAndZeroWeightGradients) {
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      Problem p = make_problem(GetParam(), 0, 8, 6, true, r, 7);
      Result out{Tensor(loss_shape(0, r), GetParam()), Tensor({0, 8}, GetParam()),
                 test::full({6, 8}, GetParam(), 7), test::full({6}, GetParam(), 7)};
      fused_linear_cross_entropy(p.x, p.weight, p.bias, p.labels, p.grad_loss, out.loss, out.grad_x,
                                 out.grad_weight, out.grad_bias, {.reduction = r});
      const std::string what = fmt::format("{} {}", to_string(backend), to_string(r));
      if (r == Reduction::None) {
        EXPECT_EQ(out.loss.shape(), Shape{0}) << what;
      }
      const double loss = r == Reduction::None ? 0.0 : values(out.loss)[0];
      EXPECT_TRUE(r == Reduction::Mean ? std::isnan(loss) : loss == 0.0) << what;
      for (double g : values(out.grad_weight)) ASSERT_EQ(g, 0.0) << what;
      for (double g : values(out.grad_bias)) ASSERT_EQ(g, 0.0) << what;
    }
  }
}

TEST_P(FusedLinearCrossEntropyTest, AllLabelsIgnoredGiveZeroNoneNanMeanZeroSumAndZeroGrads) {
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      Problem p = make_problem(GetParam(), 5, 12, 20, true, r, 8);
      p.labels = from({5}, DType::I32, {-100, -100, -100, -100, -100});
      const Result out = run(p, {.reduction = r, .label_smoothing = 0.2, .z_loss_scale = 1e-4}, 2);
      const std::string what = fmt::format("{} {}", to_string(backend), to_string(r));
      for (double l : values(out.loss)) {
        if (r == Reduction::Mean)
          EXPECT_TRUE(std::isnan(l)) << what;
        else
          EXPECT_EQ(l, 0.0) << what;
      }
      for (const Tensor* g : {&out.grad_x, &out.grad_weight, &out.grad_bias})
        for (double e : values(*g)) ASSERT_EQ(e, 0.0) << what;
    }
  }
}

TEST_P(FusedLinearCrossEntropyTest, TheMeanDividesByTheRowsNotIgnoredAmongAllRows) {
  // Chunks of 2 rows where the ignored rows are unevenly spread: the mean of the per-row losses
  // (reduction none) over the 4 rows kept, whatever the chunking.
  Problem p = make_problem(GetParam(), 7, 10, 15, false, Reduction::Mean, 9);
  p.labels = from({7}, DType::I64, {-100, -100, 3, 4, -100, 5, 14});
  const std::vector<double> rows = values(run(p, {.reduction = Reduction::None}, 2, false).loss);
  double sum = 0;
  for (double l : rows) sum += l;
  for (std::int64_t chunk : {1, 2, 7})
    EXPECT_NEAR(values(run(p, {}, chunk, false).loss)[0], sum / 4,
                4 * tolerance(GetParam()) * sum / 4)
        << chunk;
}

TEST_P(FusedLinearCrossEntropyTest, NonContiguousInputsGiveTheContiguousResult) {
  const Problem p = make_problem(GetParam(), 9, 20, 31, true, Reduction::None, 10);
  const auto xt = test::non_contiguous(p.x), wt = test::non_contiguous(p.weight);
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  const Result a = run(p, o, 4);
  Result b{test::empty_like(a.loss), test::empty_like(a.grad_x), test::empty_like(a.grad_weight),
           test::empty_like(a.grad_bias)};
  fused_linear_cross_entropy(xt.view, wt.view, p.bias, p.labels, p.grad_loss, b.loss, b.grad_x,
                             b.grad_weight, b.grad_bias, o, 4);
  expect_bitwise(a, b, "transposed x and weight");
}

TEST_P(FusedLinearCrossEntropyTest, ReductionNoneUsesThePerRowUpstreamGradient) {
  // Upstream 2 at row 4 and 0 elsewhere: the gradients of 2 * loss_4 alone, i.e. those of the
  // sum reduction with upstream 2 and every other label ignored.
  const std::int64_t n = 8;
  Problem none = make_problem(GetParam(), n, 14, 25, true, Reduction::None, 11);
  none.grad_loss = Tensor::zeros({n}, GetParam());
  copy(test::full({1}, DType::F64, 2), none.grad_loss.view().narrow(0, 4, 1));
  Problem one_row = none;
  one_row.labels = Tensor::copy_of(none.labels);
  for (std::int64_t i = 0; i < n; ++i)
    if (i != 4) copy(test::full({1}, DType::F64, -100), one_row.labels.view().narrow(0, i, 1));
  one_row.grad_loss = test::full({}, GetParam(), 2);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  CrossEntropyOptions sum = o;
  sum.reduction = Reduction::Sum;
  Result a = run(none, o, 3), b = run(one_row, sum, 3);
  a.loss = b.loss = Tensor();  // different shapes; the gradients are the point
  expect_close(a, b, tolerance(GetParam()), "upstream at row 4 only");
  // And the per-row upstream in general, against the reference.
  none.grad_loss = randn({n}, GetParam(), 12);
  expect_close(run(none, o, 3), run_reference(none, o), tolerance(GetParam()), "random upstream");
}

TEST_P(FusedLinearCrossEntropyTest, GradientsAreLinearInAScalarUpstreamSoOneCanBeScaledLater) {
  // The framework trick of the header: run with grad_loss = 1, scale by the real upstream later.
  // Exact for f32 / f64 (a power of two); 16-bit outputs round small values to subnormals, so
  // there within the dtype's tolerance.
  const DType dt = GetParam();
  Problem p = make_problem(dt, 6, 16, 21, true, Reduction::Mean, 13);
  p.grad_loss = test::full({}, dt, 1);
  const Result one = run(p, {}, 4);
  p.grad_loss = test::full({}, dt, 4);
  const Result four = run(p, {}, 4);
  const bool exact = dt == DType::F32 || dt == DType::F64;
  for (const auto& [a, b, name] : outputs(one, four)) {
    if (name == "loss") continue;
    const std::vector<double> va = values(*a), vb = values(*b);
    for (std::size_t i = 0; i < va.size(); ++i) {
      if (exact)
        ASSERT_EQ(va[i] * 4, vb[i]) << name << i;
      else
        ASSERT_NEAR(va[i] * 4, vb[i], tolerance(dt) * (1 + std::fabs(vb[i]))) << name << i;
    }
  }
}

TEST_P(FusedLinearCrossEntropyTest, LossOnlyEqualsTheLossComputedWithGradients) {
  const Problem p = make_problem(GetParam(), 10, 12, 40, true, Reduction::None, 14);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  EXPECT_TRUE(testing::bitwise_equal(run(p, o, 3, false).loss, run(p, o, 3).loss));
}

TEST_P(FusedLinearCrossEntropyTest, NanAndInfInputsPropagateLikeTheReference) {
  // A NaN in x row 1 and an inf in row 2 (both not ignored): NaN or inf losses for those rows,
  // and the same non-finite pattern in every gradient as the unfused double computation.
  Problem p = make_problem(GetParam(), 6, 10, 17, true, Reduction::None, 15);
  copy(test::full({1, 1}, DType::F64, NAN), p.x.view().narrow(0, 1, 1).narrow(1, 3, 1));
  copy(test::full({1, 1}, DType::F64, INFINITY), p.x.view().narrow(0, 2, 1).narrow(1, 5, 1));
  const CrossEntropyOptions o{.reduction = Reduction::None};
  const Result cpu = run(p, o, 4);
  const std::vector<double> loss = values(cpu.loss);
  EXPECT_TRUE(std::isnan(loss[1]));
  EXPECT_FALSE(std::isfinite(loss[2]));
  EXPECT_TRUE(std::isfinite(loss[4]));
  expect_close(cpu, run_reference(p, o), tolerance(GetParam()), "non-finite");
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, FusedLinearCrossEntropyTest,
                         ::testing::ValuesIn(test::kFloatDTypes), test::dtype_name);

TEST(FusedLinearCrossEntropy, MatchesTorchLinearThenCrossEntropy) {
  // torch (float64): x (3, 4), weight (5, 4), bias (5), labels [2, -100, 0].
  //  a: F.cross_entropy(F.linear(x, w, b) * 0.5, labels, label_smoothing=0.1)
  //     + 1e-2 * mean over kept rows of logsumexp(0.5 * logits)^2; backward of 1.
  //  b: F.cross_entropy(F.linear(x, w), labels, reduction='none'); backward of [1, 2, -0.5].
  const Tensor x =
      from({3, 4}, DType::F64, {1, -0.5, 0.25, 2, 0.5, 0.5, -1, 0, -2, 1, 0.75, -0.25});
  const Tensor w =
      from({5, 4}, DType::F64, {0.5, -1, 0.25, 0,   1,   0.5, -0.5, 0.25, -0.25, 0.75,
                                1,   -1, 0,    0.5, 0.5, 0.5, 1.5,  -0.5, 0,     0.25});
  const Tensor b = from({5}, DType::F64, {0.1, -0.2, 0.3, 0, 0.05});
  const Tensor labels = from({3}, DType::I64, {2, -100, 0});
  const std::vector<double> a_dx = {0.2627929743083579,
                                    -0.21736423719542997,
                                    -0.2070978987642418,
                                    0.2746334439429106,
                                    0,
                                    0,
                                    0,
                                    0,
                                    -0.12970960865731734,
                                    0.3568964443891857,
                                    0.12129015671759373,
                                    -0.11797879317439243};
  const std::vector<double> a_dw = {
      0.4734273415700028,   -0.2367136707850014,  -0.14613226967073814, 0.15338736795028907,
      0.02428988967274174,  -0.01214494483637087, 0.01842816890709273,  0.08564686881220536,
      -0.5192547517114183,  0.25962737585570916,  0.057812121536477565, -0.4756320750298402,
      -0.07327070208828154, 0.03663535104414077,  0.05425634636377635,  0.07118066148097714,
      0.08759662882492994,  -0.04379831441246497, 0.025004688930998133, 0.18450985282415683};
  const std::vector<double> a_db = {-0.1613465105817704, 0.05394356124611925, -0.06895280899702116,
                                    0.10090695043775064, 0.0950499049643675};
  const std::vector<double> b_loss = {5.2627816516109185, 0.0, 4.292428683662885};
  const std::vector<double> b_dx = {
      1.2935530243645725, -1.018926587377545,  -0.9735013044942098,  1.2366349682690452, 0, 0, 0, 0,
      0.3380914189108815, -0.8378821319626742, -0.31531205341338303, 0.35116574572637194};
  const std::vector<double> b_dw = {
      -0.8251560759297217,  0.41257803796486087,  0.4101661805452116,   0.19905344672348269,
      0.1836321758597471,   -0.09181608792987354, 0.038367284014877455, 0.3446420718693162,
      -0.20022885897796605, 0.10011442948898303,  -0.5466761320883258,  -1.8903144699874348,
      0.3109135364456528,   -0.1554567682228264,  -0.03308227444825637, 0.2893950972122969,
      0.5308392226022877,   -0.26541961130114383, 0.13122494197649304,  1.0572238541823389};
  const auto expect_near = [](const TensorView& t, const std::vector<double>& want,
                              const std::string& what) {
    const std::vector<double> got = values(t);
    ASSERT_EQ(got.size(), want.size()) << what;
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-13) << what << i;
  };
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (std::int64_t chunk : {1, 2, 3}) {
      const std::string what = fmt::format("{} chunk={} ", to_string(backend), chunk);
      Tensor loss({}, DType::F64), dx({3, 4}, DType::F64), dw({5, 4}, DType::F64),
          db({5}, DType::F64);
      fused_linear_cross_entropy(
          x, w, b, labels, test::full({}, DType::F64, 1), loss, dx, dw, db,
          {.label_smoothing = 0.1, .logits_multiplier = 0.5, .z_loss_scale = 1e-2}, chunk);
      expect_near(loss, {2.8553904047758474}, what + "a loss");
      expect_near(dx, a_dx, what + "a dx");
      expect_near(dw, a_dw, what + "a dw");
      expect_near(db, a_db, what + "a db");
      Tensor losses({3}, DType::F64);
      fused_linear_cross_entropy(x, w, {}, labels, from({3}, DType::F64, {1, 2, -0.5}), losses, dx,
                                 dw, {}, {.reduction = Reduction::None}, chunk);
      expect_near(losses, b_loss, what + "b loss");
      expect_near(dx, b_dx, what + "b dx");
      expect_near(dw, b_dw, what + "b dw");
    }
  }
}

TEST(FusedLinearCrossEntropy, DeterministicRunToRun) {
  const Problem p = make_problem(DType::BF16, 64, 48, 301, true, Reduction::Mean, 16);
  const CrossEntropyOptions o{.label_smoothing = 0.1, .z_loss_scale = 1e-4};
  expect_bitwise(run(p, o, 16), run(p, o, 16), "bf16 chunks of 16");
}

TEST(FusedLinearCrossEntropy, WorkspaceLogitsAreChunkRowsTimesVocabTimesFourBytes) {
  // The cpu backend allocates exactly these parts (cpu.cpp sizes its buffers from the same plan).
  FusedLinearCrossEntropyShape s{DType::BF16,     512,   2048, 32000, 128,
                                 Reduction::Mean, false, true, true,  false};
  FusedLinearCrossEntropyWorkspace ws = fused_linear_cross_entropy_workspace(s);
  EXPECT_EQ(ws.logits, 128 * 32000 * 4);
  EXPECT_EQ(ws.per_row, 512 * (8 + 4));
  // fp32 x and grad_x rows of a chunk, and a 32 MiB block of weight rows (4096 rows of 2048), which
  // also holds a block's grad_weight product: no V x H accumulator, however many chunks.
  EXPECT_EQ(ws.staging, 2 * 128 * 2048 * 4 + 4096 * 2048 * 4);
  EXPECT_EQ(ws.grad_bias, 0);
  EXPECT_EQ(ws.total(), ws.logits + ws.per_row + ws.staging);

  // The logits part does not grow with N, and is min(chunk_rows, N) rows.
  s.rows = 1 << 20;
  EXPECT_EQ(fused_linear_cross_entropy_workspace(s).logits, 128 * 32000 * 4);
  s.rows = 100;
  EXPECT_EQ(fused_linear_cross_entropy_workspace(s).logits, 100 * 32000 * 4);
  // chunk_rows 0: the cpu's default.
  s.rows = 4096;
  s.chunk_rows = 0;
  EXPECT_EQ(fused_linear_cross_entropy_workspace(s).logits,
            kFusedLinearCrossEntropyCpuChunkRows * 32000 * 4);
  // f32 needs no staging and accumulates in the outputs; f64 logits take 8 bytes.
  s = {DType::F32, 512, 2048, 32000, 128, Reduction::None, true, true, true, true};
  ws = fused_linear_cross_entropy_workspace(s);
  EXPECT_EQ(ws.logits, 128 * 32000 * 4);
  EXPECT_EQ(ws.per_row, 512 * (8 + 4 + 8));  // + the per-row upstream of `none`
  EXPECT_EQ(ws.staging, 0);
  EXPECT_EQ(ws.grad_bias, 32000 * 4);
  s.dtype = DType::F64;
  EXPECT_EQ(fused_linear_cross_entropy_workspace(s).logits, 128 * 32000 * 8);
  // Loss only: no gradient buffers.
  s = {DType::BF16, 512, 2048, 32000, 128, Reduction::None, true, false, false, false};
  ws = fused_linear_cross_entropy_workspace(s);
  EXPECT_EQ(ws.per_row, 512 * (8 + 4));
  EXPECT_EQ(ws.staging, (128 * 2048 + 4096 * 2048 + 32000) * 4);  // x rows, weight block, bias
}

TEST(FusedLinearCrossEntropy, WorkspaceSizesPast2To31AreExact) {
  // 2^15 rows per chunk of a LLaMA-3 vocabulary: 16.8 GB of logits, past 2^32 bytes.
  const FusedLinearCrossEntropyShape s{DType::BF16,     1 << 20, 4096, 128256, 1 << 15,
                                       Reduction::Mean, false,   true, true,   false};
  const FusedLinearCrossEntropyWorkspace ws = fused_linear_cross_entropy_workspace(s);
  EXPECT_EQ(ws.logits, std::int64_t{16'810'770'432});
}

TEST(FusedLinearCrossEntropy, TheDefaultChunkIs512RowsOnTheCpuAndAGibibyteOfLogitsOnCuda) {
  EXPECT_EQ(fused_linear_cross_entropy_chunk_rows(DeviceType::CPU, 128256), 512);
  // floor(2^30 / (4 V)) rounded down to a multiple of 256, at least 256.
  EXPECT_EQ(fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, 128256), 2048);
  EXPECT_EQ(fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, 32000), 8192);
  EXPECT_EQ(fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, 262144), 1024);
  EXPECT_EQ(fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, 1 << 24), 256);
  EXPECT_EQ(fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, 0), 256 * 4096 * 256);
}

TEST(FusedLinearCrossEntropy, ChunkRowsZeroRunsTheCpuDefaultChunks) {
  // 600 rows: 512 and 88 with the default, bitwise the same as asking for 512; one chunk of 600
  // sums grad_weight in another order (bf16: rounded per chunk), so it differs.
  const Problem p = make_problem(DType::BF16, 600, 8, 6, false, Reduction::Mean, 20);
  const Result by_default = run(p, {}, 0);
  expect_bitwise(by_default, run(p, {}, 512), "0 vs 512");
  EXPECT_FALSE(testing::bitwise_equal(by_default.grad_weight, run(p, {}, 600).grad_weight));
}

TEST(FusedLinearCrossEntropy, WorkspaceRejectsBadSizes) {
  FusedLinearCrossEntropyShape s{DType::F32, 4, 8, 16, -1};
  test::expect_error([&] { fused_linear_cross_entropy_workspace(s); }, ErrorCode::InvalidArgument,
                     {"fused_linear_cross_entropy", "chunk_rows", "positive", "-1"});
  s.chunk_rows = 2;
  s.vocab = -1;
  test::expect_error([&] { fused_linear_cross_entropy_workspace(s); }, ErrorCode::InvalidArgument,
                     {"fused_linear_cross_entropy", "vocab=-1"});
  s.vocab = 16;
  s.dtype = DType::I32;
  test::expect_error([&] { fused_linear_cross_entropy_workspace(s); }, ErrorCode::DTypeMismatch,
                     {"fused_linear_cross_entropy", "i32"});
}

TEST(FusedLinearCrossEntropy, BadLabelNamesTheRowAndValueBeforeAnyWork) {
  const Problem p = make_problem(DType::F32, 5, 4, 6, false, Reduction::Mean, 17);
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (DType label_dtype : {DType::I32, DType::I64}) {
      const Tensor labels = from({5}, label_dtype, {0, -100, 5, 6, -1});
      Tensor loss = test::full({}, DType::F32, 7), dx = test::full({5, 4}, DType::F32, 7);
      test::expect_error(
          [&] {
            fused_linear_cross_entropy(p.x, p.weight, {}, labels, p.grad_loss, loss, dx, {}, {}, {},
                                       2);
          },
          ErrorCode::InvalidArgument,
          {"fused_linear_cross_entropy", "labels[3] = 6", "[0, 6)", "-100"});
      EXPECT_EQ(values(loss)[0], 7.0) << to_string(backend);  // nothing written
      for (double g : values(dx)) ASSERT_EQ(g, 7.0) << to_string(backend);
    }
  }
}

TEST(FusedLinearCrossEntropy, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Problem p = make_problem(DType::F32, 4, 8, 10, true, Reduction::Mean, 18);
  Tensor loss({}, DType::F32), dx({4, 8}, DType::F32), dw({10, 8}, DType::F32),
      db({10}, DType::F32);
  const auto call = [&](const TensorView& x, const TensorView& w, const TensorView& b,
                        const TensorView& labels, const TensorView& gl, const TensorView& l,
                        const TensorView& gx, const TensorView& gw, const TensorView& gb,
                        const CrossEntropyOptions& o = {}, std::int64_t chunk = 2) {
    return [=] { fused_linear_cross_entropy(x, w, b, labels, gl, l, gx, gw, gb, o, chunk); };
  };
  const std::string op = "fused_linear_cross_entropy";
  using test::expect_error;
  expect_error(
      call(p.x, randn({10, 7}, DType::F32, 1), p.bias, p.labels, p.grad_loss, loss, dx, dw, db),
      ErrorCode::ShapeMismatch, {op, "'weight'", "[10, 7]", "(V, 8)", "[4, 8]"});
  expect_error(
      call(p.x, randn({10, 8}, DType::BF16, 1), p.bias, p.labels, p.grad_loss, loss, dx, dw, db),
      ErrorCode::DTypeMismatch, {op, "'weight'", "bf16", "f32"});
  expect_error(call(randn({4, 2, 8}, DType::F32, 1), p.weight, p.bias, p.labels, p.grad_loss, loss,
                    dx, dw, db),
               ErrorCode::InvalidArgument, {op, "'x'", "2 dimensions", "3"});
  expect_error(
      call(p.x, p.weight, randn({9}, DType::F32, 1), p.labels, p.grad_loss, loss, dx, dw, db),
      ErrorCode::ShapeMismatch, {op, "'bias'", "[10]", "[9]"});
  expect_error(
      call(p.x, p.weight, p.bias, Tensor::zeros({4}, DType::F32), p.grad_loss, loss, dx, dw, db),
      ErrorCode::DTypeMismatch, {op, "'labels'", "i32 or i64", "f32"});
  expect_error(
      call(p.x, p.weight, p.bias, Tensor::zeros({5}, DType::I64), p.grad_loss, loss, dx, dw, db),
      ErrorCode::ShapeMismatch, {op, "'labels'", "[4]", "[5]"});
  expect_error(call(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, dx, dw, db, {}, -3),
               ErrorCode::InvalidArgument,
               {op, "chunk_rows must be positive, or 0 for the device's default", "got -3"});
  expect_error(call(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, dx, dw, db,
                    {.label_smoothing = 1.5}),
               ErrorCode::InvalidArgument, {op, "label_smoothing", "1.5"});
  expect_error(call(p.x, p.weight, p.bias, p.labels, {}, loss, dx, {}, {}),
               ErrorCode::InvalidArgument, {op, "'grad_loss'", "required"});
  expect_error(call(p.x, p.weight, {}, p.labels, p.grad_loss, loss, dx, dw, db),
               ErrorCode::InvalidArgument, {op, "'grad_bias'", "'bias'"});
  expect_error(
      call(p.x, p.weight, p.bias, p.labels, test::full({4}, DType::F32, 1), loss, dx, dw, db),
      ErrorCode::ShapeMismatch, {op, "'grad_loss'", "[]", "[4]"});
  expect_error(
      call(p.x, p.weight, p.bias, p.labels, p.grad_loss, Tensor({4}, DType::F32), dx, dw, db),
      ErrorCode::ShapeMismatch, {op, "'loss'"});
  const auto dw_t = test::non_contiguous(dw);
  expect_error(call(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, dx, dw_t.view, db),
               ErrorCode::InvalidArgument, {op, "'grad_weight'", "contiguous"});
  expect_error(
      call(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, Tensor({4, 8}, DType::F64), dw, db),
      ErrorCode::DTypeMismatch, {op, "'grad_x'", "f64"});
  // grad_weight and grad_bias: the input's dtype, or f32 for 16-bit inputs only.
  expect_error(
      call(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, dx, Tensor({10, 8}, DType::F64), db),
      ErrorCode::DTypeMismatch, {op, "'grad_weight'", "'x' (f32)", "got f64"});
  const Problem h = make_problem(DType::BF16, 4, 8, 10, true, Reduction::Mean, 18);
  const Tensor hloss({}, DType::BF16), hdx({4, 8}, DType::BF16);
  expect_error(call(h.x, h.weight, h.bias, h.labels, h.grad_loss, hloss, hdx,
                    Tensor({10, 8}, DType::F16), {}),
               ErrorCode::DTypeMismatch, {op, "'grad_weight'", "(bf16) or f32", "got f16"});
  expect_error(
      call(h.x, h.weight, h.bias, h.labels, h.grad_loss, hloss, hdx, {}, Tensor({10}, DType::F64)),
      ErrorCode::DTypeMismatch, {op, "'grad_bias'", "(bf16) or f32", "got f64"});
  expect_error(call(h.x, h.weight, h.bias, h.labels, h.grad_loss, hloss, hdx,
                    Tensor({10, 7}, DType::F32), {}),
               ErrorCode::ShapeMismatch, {op, "'grad_weight'", "[10, 8]", "[10, 7]"});
}

TEST(FusedLinearCrossEntropy, BothDirectionsAreRegisteredForReferenceAndCpu) {
  for (std::string op : {"fused_linear_cross_entropy", "fused_linear_cross_entropy_backward"}) {
    int found = 0;
    for (const KernelInfo& k : registered_kernels())
      if (k.op == op && (k.backend == KernelBackend::Reference || k.backend == KernelBackend::CPU))
        ++found;
    EXPECT_EQ(found, 2) << op;
  }
}

}  // namespace
}  // namespace meshfuse
