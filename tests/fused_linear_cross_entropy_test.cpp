// fused_linear_cross_entropy on every backend the build has (reference and cpu on the CPU;
// reference and cuda on CUDA tensors), against the reference backend on the CPU. CUDA cases skip
// without a GPU.
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "meshfuse/core/memory.h"
#include "meshfuse/meshfuse.h"
#include "ops/fused_linear_cross_entropy/fused_linear_cross_entropy_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::make_labels;
using test::on;
using test::randn;
using test::Target;
using test::to_cpu;
using test::values;

// The oracle: the reference backend on CPU tensors.
const Target kOracle{KernelBackend::Reference, Device{}};

Shape loss_shape(std::int64_t rows, Reduction r) {
  return r == Reduction::None ? Shape{rows} : Shape{};
}

void set(const TensorView& t, std::int64_t i, double value) {
  copy(test::full({1}, DType::F64, value), t.narrow(0, i, 1));
}

// The inputs of one call, on the CPU: x (N, H), weight (V, H), bias (V) or none, labels, and an
// upstream gradient of the loss's shape (varied per row for `none`).
struct Problem {
  Tensor x, weight, bias, labels, grad_loss;
};

Problem make_problem(DType dtype, std::int64_t n, std::int64_t h, std::int64_t v, bool bias,
                     Reduction r, std::uint64_t seed, DType label_dtype = DType::I64) {
  return {randn({n, h}, dtype, seed), randn({v, h}, dtype, seed + 1, 0.3),
          bias ? randn({v}, dtype, seed + 2) : Tensor(), make_labels(n, v, label_dtype, seed + 3),
          r == Reduction::None ? randn({n}, dtype, seed + 4) : test::full({}, dtype, 1.5)};
}

// Outputs, on the CPU.
struct Result {
  Tensor loss, grad_x, grad_weight, grad_bias;
};

Tensor cpu_or_empty(const Tensor& t, const Stream& stream) {
  return t.defined() ? to_cpu(t, stream) : Tensor();
}

// Runs the op on `target` (inputs are copied to its device) with every gradient output (grad_bias
// when there is a bias), or the loss only; outputs come back on the CPU. The loss and grad_loss
// have `loss_dtype` (grad_loss converted), or the inputs' dtype when it is not given.
Result run(const Target& target, const Stream& stream, const Problem& p,
           const CrossEntropyOptions& o, std::int64_t chunk_rows, bool grads = true,
           std::optional<DType> loss_dtype = std::nullopt) {
  ForceKernelBackend force(target.backend);
  const Device d = target.device;
  const DType ldt = loss_dtype.value_or(p.x.dtype());
  const Tensor grad_loss(p.grad_loss.shape(), ldt);
  copy(p.grad_loss, grad_loss);
  const Tensor x = on(p.x, d, stream), w = on(p.weight, d, stream), b = on(p.bias, d, stream),
               y = on(p.labels, d, stream), g = on(grad_loss, d, stream);
  const auto gradient_of = [&](const Tensor& t) {
    return grads && t.defined() ? Tensor(t.shape(), t.dtype(), d, stream) : Tensor();
  };
  const Tensor loss(loss_shape(p.x.size(0), o.reduction), ldt, d, stream);
  const Tensor dx = gradient_of(x), dw = gradient_of(w), db = gradient_of(b);
  fused_linear_cross_entropy(x, w, b, y, grads ? g.view() : TensorView{}, loss, dx, dw, db, o,
                             chunk_rows, stream);
  return {to_cpu(loss, stream), cpu_or_empty(dx, stream), cpu_or_empty(dw, stream),
          cpu_or_empty(db, stream)};
}

Result run_reference(const Problem& p, const CrossEntropyOptions& o) {
  return run(kOracle, {}, p, o, 1);
}

// Tolerance against the double reference. f32: fp32 GEMM sums over H, V and N (cuBLASLt's
// without TF32 on cuda). 16-bit: the dtype's default on the cpu backend (outputs within a few of
// their ulps); twice that on cuda, whose gradient GEMMs take the logits' gradient rounded to the
// dtype (cuda.cu) on top of the outputs' own rounding.
double tolerance(const Target& target, DType dtype) {
  switch (dtype) {
    case DType::F64:
      return 1e-10;
    case DType::F32:
      return 1e-4;
    default:
      return (target.backend == KernelBackend::CUDA ? 2 : 1) * testing::default_tolerance(dtype);
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

// `got` (outputs of `dtype` inputs on `target`) against the oracle's `ref`: within tolerance for
// the kernels; bitwise for the reference on CUDA tensors, which runs the oracle's loops on host
// copies.
void expect_matches_reference(const Target& target, DType dtype, const Result& got,
                              const Result& ref, const std::string& what) {
  if (target.backend == KernelBackend::Reference)
    expect_bitwise(got, ref, what);
  else
    expect_close(got, ref, tolerance(target, dtype), what);
}

// Plain options, and label smoothing with a logit multiplier and the z-loss.
std::vector<CrossEntropyOptions> option_sets(Reduction r) {
  return {{-100, r, 0.0, 1.0, 0.0}, {-100, r, 0.1, 0.7, 1e-3}};
}

// The dtypes a parameter's gradient may have for inputs of `dtype`: its own, and f32 for 16-bit.
std::vector<DType> grad_dtypes(DType dtype) {
  if (dtype == DType::BF16 || dtype == DType::F16) return {dtype, DType::F32};
  return {dtype};
}

// Unit roundoff of a 16-bit dtype (RNE: |round(y) - y| <= u |y|).
double unit_roundoff(DType dtype) { return dtype == DType::BF16 ? 0x1p-8 : 0x1p-11; }

// Every target: the kernels and the reference on CUDA tensors.
class FusedLinearCrossEntropyBackends : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(FusedLinearCrossEntropyBackends, MatchesTheReferenceForEveryReductionBiasOptionAndChunking) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // N = 11 rows in chunks of 1, 3 and 4 (the last one partial), N and more; H and V odd and not
  // multiples of the vector width (scalar row kernels on cuda).
  for (bool bias : {false, true})
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      const Problem p = make_problem(dtype, 11, 19, 37, bias, r, 1);
      for (const CrossEntropyOptions& o : option_sets(r)) {
        const Result ref = run_reference(p, o);
        for (std::int64_t chunk : {1, 3, 4, 11, 64})
          expect_matches_reference(target, dtype, run(target, stream, p, o, chunk), ref,
                                   fmt::format("bias={} {} eps={} chunk={}", bias, to_string(r),
                                               o.label_smoothing, chunk));
      }
    }
}

TEST_P(FusedLinearCrossEntropyBackends, WideVocabularyRowsMatchTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // V = 2504: 16-byte vectorised row kernels, and rows of several 1024-element tiles for cuda's
  // in-place rounding of the 16-bit logit gradient.
  for (Reduction r : {Reduction::None, Reduction::Mean}) {
    const Problem p = make_problem(dtype, 24, 64, 2504, true, r, 2);
    const CrossEntropyOptions o = option_sets(r)[1];
    const Result ref = run_reference(p, o);
    for (std::int64_t chunk : {7, 24})
      expect_matches_reference(target, dtype, run(target, stream, p, o, chunk), ref,
                               fmt::format("{} chunk={}", to_string(r), chunk));
  }
}

TEST_P(FusedLinearCrossEntropyBackends,
       ChunksOfOneAndThreeRowsAgreeAndChunksOfNOrMoreAreBitwiseEqual) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Problem p = make_problem(dtype, 10, 24, 50, true, Reduction::Mean, 2);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const Result whole = run(target, stream, p, o, 10);
  expect_bitwise(run(target, stream, p, o, 11), whole, "chunk 11");
  expect_bitwise(run(target, stream, p, o, 1000), whole, "chunk 1000");
  for (std::int64_t chunk : {1, 3})
    expect_close(run(target, stream, p, o, chunk), whole, tolerance(target, dtype),
                 fmt::format("chunk {}", chunk));
}

TEST_P(FusedLinearCrossEntropyBackends, Int32AndInt64LabelsGiveBitwiseTheSameResults) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Problem p64 = make_problem(dtype, 8, 16, 30, false, Reduction::Sum, 5);
  Problem p32 = p64;
  p32.labels = Tensor({8}, DType::I32);
  copy(p64.labels, p32.labels);
  expect_bitwise(run(target, stream, p32, {.reduction = Reduction::Sum}, 3),
                 run(target, stream, p64, {.reduction = Reduction::Sum}, 3), "i32 vs i64");
}

TEST_P(FusedLinearCrossEntropyBackends, OneRowMatchesReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    Problem p = make_problem(dtype, 1, 33, 65, true, r, 6);
    p.labels = from({1}, DType::I64, {17});
    const CrossEntropyOptions o = option_sets(r)[1];
    expect_matches_reference(target, dtype, run(target, stream, p, o, 1), run_reference(p, o),
                             std::string(to_string(r)));
  }
}

TEST_P(FusedLinearCrossEntropyBackends, ZeroRowsGiveEmptyOrNanOrZeroLossAndZeroWeightGradients) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    const Problem p = make_problem(dtype, 0, 8, 6, true, r, 7);
    const Tensor loss(loss_shape(0, r), dtype, d, stream), dx({0, 8}, dtype, d, stream),
        dw = on(test::full({6, 8}, dtype, 7), d, stream),
        db = on(test::full({6}, dtype, 7), d, stream);
    fused_linear_cross_entropy(on(p.x, d, stream), on(p.weight, d, stream), on(p.bias, d, stream),
                               on(p.labels, d, stream), on(p.grad_loss, d, stream), loss, dx, dw,
                               db, {.reduction = r}, kFusedLinearCrossEntropyChunkRows, stream);
    const std::string what(to_string(r));
    if (r == Reduction::None) {
      EXPECT_EQ(loss.shape(), Shape{0}) << what;
    } else {
      const double l = values(to_cpu(loss, stream))[0];
      EXPECT_TRUE(r == Reduction::Mean ? std::isnan(l) : l == 0.0) << what;
    }
    for (double g : values(to_cpu(dw, stream))) ASSERT_EQ(g, 0.0) << what;
    for (double g : values(to_cpu(db, stream))) ASSERT_EQ(g, 0.0) << what;
  }
}

TEST_P(FusedLinearCrossEntropyBackends, AllLabelsIgnoredGiveZeroNoneNanMeanZeroSumAndZeroGrads) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    Problem p = make_problem(dtype, 5, 12, 20, true, r, 8);
    p.labels = from({5}, DType::I32, {-100, -100, -100, -100, -100});
    const Result out =
        run(target, stream, p, {.reduction = r, .label_smoothing = 0.2, .z_loss_scale = 1e-4}, 2);
    const std::string what(to_string(r));
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

TEST_P(FusedLinearCrossEntropyBackends, TheMeanDividesByTheRowsNotIgnoredAmongAllRows) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // Chunks of 2 rows where the ignored rows are unevenly spread: the mean of the per-row losses
  // (reduction none) over the 4 rows kept, whatever the chunking.
  Problem p = make_problem(dtype, 7, 10, 15, false, Reduction::Mean, 9);
  p.labels = from({7}, DType::I64, {-100, -100, 3, 4, -100, 5, 14});
  const std::vector<double> rows =
      values(run(target, stream, p, {.reduction = Reduction::None}, 2, false).loss);
  double sum = 0;
  for (double l : rows) sum += l;
  for (std::int64_t chunk : {1, 2, 7})
    EXPECT_NEAR(values(run(target, stream, p, {}, chunk, false).loss)[0], sum / 4,
                4 * tolerance(target, dtype) * sum / 4)
        << chunk;
}

TEST_P(FusedLinearCrossEntropyBackends, NonContiguousInputsGiveTheContiguousResult) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Problem p = make_problem(dtype, 9, 20, 31, true, Reduction::None, 10);
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  const Result a = run(target, stream, p, o, 4);
  // Storage (cols, rows) on the target's device, whose transposed view holds t.
  const auto transposed = [&](const Tensor& t) {
    return on(Tensor::copy_of(t.view().transpose(0, 1)), d, stream);
  };
  const Tensor xs = transposed(p.x), ws = transposed(p.weight);
  const Tensor loss({9}, dtype, d, stream), dx(p.x.shape(), dtype, d, stream),
      dw(p.weight.shape(), dtype, d, stream), db({31}, dtype, d, stream);
  {
    ForceKernelBackend force(target.backend);
    fused_linear_cross_entropy(xs.view().transpose(0, 1), ws.view().transpose(0, 1),
                               on(p.bias, d, stream), on(p.labels, d, stream),
                               on(p.grad_loss, d, stream), loss, dx, dw, db, o, 4, stream);
  }
  expect_bitwise(a,
                 {to_cpu(loss, stream), to_cpu(dx, stream), to_cpu(dw, stream), to_cpu(db, stream)},
                 "transposed x and weight");
}

TEST_P(FusedLinearCrossEntropyBackends, ReductionNoneUsesThePerRowUpstreamGradient) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // Upstream 2 at row 4 and 0 elsewhere: the gradients of 2 * loss_4 alone, i.e. those of the
  // sum reduction with upstream 2 and every other label ignored.
  const std::int64_t n = 8;
  Problem none = make_problem(dtype, n, 14, 25, true, Reduction::None, 11);
  none.grad_loss = Tensor::zeros({n}, dtype);
  set(none.grad_loss, 4, 2);
  Problem one_row = none;
  one_row.labels = Tensor::copy_of(none.labels);
  for (std::int64_t i = 0; i < n; ++i)
    if (i != 4) set(one_row.labels, i, -100);
  one_row.grad_loss = test::full({}, dtype, 2);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  CrossEntropyOptions sum = o;
  sum.reduction = Reduction::Sum;
  Result a = run(target, stream, none, o, 3), b = run(target, stream, one_row, sum, 3);
  a.loss = b.loss = Tensor();  // different shapes; the gradients are the point
  expect_close(a, b, tolerance(target, dtype), "upstream at row 4 only");
  // And the per-row upstream in general, against the reference.
  none.grad_loss = randn({n}, dtype, 12);
  expect_matches_reference(target, dtype, run(target, stream, none, o, 3), run_reference(none, o),
                           "random upstream");
}

TEST_P(FusedLinearCrossEntropyBackends, GradientsAreLinearInAScalarUpstreamSoOneCanBeScaledLater) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // The framework trick of the header: run with grad_loss = 1, scale by the real upstream later.
  // Exact for f32 / f64 (a power of two); 16-bit outputs round small values to subnormals, so
  // there within the dtype's tolerance.
  Problem p = make_problem(dtype, 6, 16, 21, true, Reduction::Mean, 13);
  p.grad_loss = test::full({}, dtype, 1);
  const Result one = run(target, stream, p, {}, 4);
  p.grad_loss = test::full({}, dtype, 4);
  const Result four = run(target, stream, p, {}, 4);
  const bool exact = dtype == DType::F32 || dtype == DType::F64;
  for (const auto& [a, b, name] : outputs(one, four)) {
    if (name == "loss") continue;
    const std::vector<double> va = values(*a), vb = values(*b);
    for (std::size_t i = 0; i < va.size(); ++i) {
      if (exact)
        ASSERT_EQ(va[i] * 4, vb[i]) << name << i;
      else
        ASSERT_NEAR(va[i] * 4, vb[i], tolerance(target, dtype) * (1 + std::fabs(vb[i])))
            << name << i;
    }
  }
}

TEST_P(FusedLinearCrossEntropyBackends, LossOnlyEqualsTheLossComputedWithGradients) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Problem p = make_problem(dtype, 10, 12, 40, true, Reduction::None, 14);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  const Result loss_only = run(target, stream, p, o, 3, false);
  EXPECT_FALSE(loss_only.grad_x.defined());
  EXPECT_TRUE(testing::bitwise_equal(loss_only.loss, run(target, stream, p, o, 3).loss));
}

TEST_P(FusedLinearCrossEntropyBackends, NanAndInfInputsPropagateLikeTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // A NaN in x row 1 and an inf in row 2 (both not ignored): NaN or inf losses for those rows,
  // and the same non-finite pattern in every gradient as the unfused double computation.
  Problem p = make_problem(dtype, 6, 10, 17, true, Reduction::None, 15);
  copy(test::full({1, 1}, DType::F64, NAN), p.x.view().narrow(0, 1, 1).narrow(1, 3, 1));
  copy(test::full({1, 1}, DType::F64, INFINITY), p.x.view().narrow(0, 2, 1).narrow(1, 5, 1));
  const CrossEntropyOptions o{.reduction = Reduction::None};
  const Result out = run(target, stream, p, o, 4);
  const std::vector<double> loss = values(out.loss);
  EXPECT_TRUE(std::isnan(loss[1]));
  EXPECT_FALSE(std::isfinite(loss[2]));
  EXPECT_TRUE(std::isfinite(loss[4]));
  expect_matches_reference(target, dtype, out, run_reference(p, o), "non-finite");
}

TEST_P(FusedLinearCrossEntropyBackends, DeterministicRunToRunOnAStream) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking with respect to the default stream), as in training.
  std::optional<CudaStream> cuda;
  if (target.device.type == DeviceType::CUDA) cuda.emplace(target.device.index);
  const Stream stream = cuda ? cuda->stream() : Stream{target.device};
  for (const auto& [n, h, v, seed] :
       std::vector<std::tuple<int, int, int, int>>{{64, 48, 301, 16}, {40, 64, 300, 9}}) {
    const Problem p = make_problem(dtype, n, h, v, true, Reduction::Mean, seed);
    const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
    const Result first = run(target, stream, p, o, 16);
    for (int i = 0; i < 3; ++i)
      expect_bitwise(run(target, stream, p, o, 16), first, fmt::format("N={} rerun {}", n, i));
  }
}

// grad_weight and grad_bias of 16-bit inputs in f32 over 16 chunks (the GEMM accumulates in the
// caller's f32 buffer), against the reference's exact gradients rounded to f32. The tolerance is
// that of the 16-bit outputs: cuda's GEMMs take the logits' gradient rounded to the dtype.
TEST_P(FusedLinearCrossEntropyBackends, AnF32GradWeightOfSixteenBitWeightsMatchesTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  if (dtype != DType::BF16 && dtype != DType::F16) GTEST_SKIP() << "16-bit weights only";
  const Stream stream{target.device};
  const std::int64_t n = 64, h = 40, v = 300;
  const Problem p = make_problem(dtype, n, h, v, true, Reduction::Mean, 12);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const auto f32_grads = [&](const Target& t, const Stream& s) {
    ForceKernelBackend force(t.backend);
    const Device d = t.device;
    const Tensor loss({}, dtype, d, s), dw({v, h}, DType::F32, d, s), db({v}, DType::F32, d, s);
    fused_linear_cross_entropy(on(p.x, d, s), on(p.weight, d, s), on(p.bias, d, s),
                               on(p.labels, d, s), on(p.grad_loss, d, s), loss, {}, dw, db, o, 4,
                               s);
    return Result{Tensor(), Tensor(), to_cpu(dw, s), to_cpu(db, s)};
  };
  expect_matches_reference(target, dtype, f32_grads(target, stream), f32_grads(kOracle, {}),
                           "f32 grad_weight and grad_bias");
}

// 16-bit inputs with an f32 loss: the double per-row losses rounded once to f32, so the reference
// gives bitwise the f64 loss of the same inputs rounded to f32 and the kernels agree with it to
// f32's tolerance; the gradients of an f32 grad_loss are those of the 16-bit grad_loss of the same
// value, bit for bit.
TEST_P(FusedLinearCrossEntropyBackends, AnF32LossOfSixteenBitInputsIsTheDoubleLossRoundedOnce) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  if (dtype != DType::BF16 && dtype != DType::F16) GTEST_SKIP() << "16-bit inputs only";
  const Stream stream{target.device};
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    const Problem p = make_problem(dtype, 37, 24, 500, true, r, 31);
    const auto widened = [](const Tensor& t) {
      if (!t.defined()) return Tensor();
      const Tensor w(t.shape(), t.dtype() == DType::I64 ? DType::I64 : DType::F64);
      copy(t, w);
      return w;
    };
    const Problem exact_inputs{widened(p.x), widened(p.weight), widened(p.bias), p.labels,
                               widened(p.grad_loss)};
    for (const CrossEntropyOptions& o : option_sets(r)) {
      const std::string what = fmt::format("{} eps={}", to_string(r), o.label_smoothing);
      const Tensor exact = run_reference(exact_inputs, o).loss, rounded(exact.shape(), DType::F32);
      copy(exact, rounded);
      const Result got = run(target, stream, p, o, 8, true, DType::F32);
      ASSERT_EQ(got.loss.dtype(), DType::F32);
      if (target.backend == KernelBackend::Reference)
        EXPECT_TRUE(testing::bitwise_equal(got.loss, rounded)) << what;
      else
        test::expect_close(got.loss, rounded, tolerance(target, DType::F32), what);
      Result same = run(target, stream, p, o, 8);
      same.loss = got.loss;  // the gradients are compared
      expect_bitwise(got, same, what);
    }
  }
}

// A 16-bit grad_weight takes each chunk's fp32 product added to its 16-bit running sum and rounded
// once per chunk: against the f32 grad_weight of the same chunks (same products), the difference
// at each element is at most sum over k of u |s_k| (u the dtype's unit roundoff, s_k the running
// sum after chunk k, from the f32 runs on the first k chunks; x1.1 for the rounding of the sums
// themselves), plus fp32-level differences between the two GEMMs' algorithms (1e-5 of the largest).
TEST_P(FusedLinearCrossEntropyBackends, ASixteenBitGradWeightRoundsOncePerChunkAndNoMore) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  if (dtype != DType::BF16 && dtype != DType::F16) GTEST_SKIP() << "16-bit weights only";
  const Stream stream{target.device};
  const Device d = target.device;
  const std::int64_t n = 64, h = 24, v = 50, chunk = 4, chunks = n / chunk;
  const Problem p = make_problem(dtype, n, h, v, false, Reduction::Sum, 13);
  const CrossEntropyOptions o{.reduction = Reduction::Sum};
  const Tensor x = on(p.x, d, stream), w = on(p.weight, d, stream), y = on(p.labels, d, stream),
               g = on(p.grad_loss, d, stream);
  const auto grad_weight = [&](std::int64_t rows, DType gdt) {
    ForceKernelBackend force(target.backend);
    const Tensor loss({}, dtype, d, stream), dw({v, h}, gdt, d, stream);
    fused_linear_cross_entropy(x.view().narrow(0, 0, rows), w, {}, y.view().narrow(0, 0, rows), g,
                               loss, {}, dw, {}, o, chunk, stream);
    return values(to_cpu(dw, stream));
  };
  std::vector<std::vector<double>> partial;  // s_1 .. s_chunks
  for (std::int64_t k = 1; k <= chunks; ++k) partial.push_back(grad_weight(k * chunk, DType::F32));
  const std::vector<double>& f32 = partial.back();
  const std::vector<double> narrow = grad_weight(n, dtype);
  double largest = 0;
  for (double e : f32) largest = std::max(largest, std::fabs(e));
  for (std::size_t i = 0; i < f32.size(); ++i) {
    double sum = 0;
    for (const std::vector<double>& s : partial) sum += std::fabs(s[i]);
    ASSERT_LE(std::fabs(narrow[i] - f32[i]), 1.1 * unit_roundoff(dtype) * sum + 1e-5 * largest)
        << "element " << i;
  }
}

TEST_P(FusedLinearCrossEntropyBackends, BadLabelNamesTheRowAndValueBeforeAnyWork) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Problem p = make_problem(dtype, 5, 4, 6, false, Reduction::Mean, 17);
  const Tensor x = on(p.x, d, stream), w = on(p.weight, d, stream), g = on(p.grad_loss, d, stream);
  ForceKernelBackend force(target.backend);
  for (DType label_dtype : {DType::I32, DType::I64}) {
    // Rows 3 and 4 are both out of range: the first is reported.
    const Tensor labels = on(from({5}, label_dtype, {0, -100, 5, 6, -1}), d, stream);
    const Tensor loss = on(test::full({}, dtype, 7), d, stream),
                 dx = on(test::full({5, 4}, dtype, 7), d, stream);
    test::expect_error(
        [&] { fused_linear_cross_entropy(x, w, {}, labels, g, loss, dx, {}, {}, {}, 2, stream); },
        ErrorCode::InvalidArgument,
        {"fused_linear_cross_entropy", "labels[3] = 6", "[0, 6)", "-100"});
    EXPECT_EQ(values(to_cpu(loss, stream))[0], 7.0);  // nothing written
    for (double e : values(to_cpu(dx, stream))) ASSERT_EQ(e, 7.0);
  }
}

INSTANTIATE_TEST_SUITE_P(, FusedLinearCrossEntropyBackends,
                         ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);

// The kernels only: what the reference (no chunks, all in double) has no counterpart of.
class FusedLinearCrossEntropyKernels : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(FusedLinearCrossEntropyKernels, MatchesTheUnfusedCompositionOfLinearAndCrossEntropy) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  // linear -> cross_entropy -> cross_entropy_backward -> linear_backward on the same backend. It
  // rounds the logits and their gradient to the dtype (the fused op keeps the logits in fp32), so
  // 16-bit types agree within a few ulps of the dtype. On the cpu, f64 logits are the same GEMM
  // (OpenBLAS's dgemm), hence bitwise; f32 ones two of oneDNN's (its matmul primitive fused, its
  // sgemm in linear).
  const std::int64_t n = 12, h = 32, v = 70;
  const Problem p = make_problem(dtype, n, h, v, true, Reduction::Mean, 3);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const Tensor x = on(p.x, d, stream), w = on(p.weight, d, stream), b = on(p.bias, d, stream),
               y = on(p.labels, d, stream), g = on(p.grad_loss, d, stream);
  const Tensor logits({n, v}, dtype, d, stream), dlogits({n, v}, dtype, d, stream),
      lse({n}, is_sixteen_bit(dtype) ? DType::F32 : DType::F64, d, stream);
  const Tensor loss({}, dtype, d, stream), dx({n, h}, dtype, d, stream),
      dw({v, h}, dtype, d, stream), db({v}, dtype, d, stream);
  {
    ForceKernelBackend force(target.backend);
    linear(x, w, b, logits, stream);
    cross_entropy(logits, y, loss, lse, o, stream);
    cross_entropy_backward(g, logits, y, lse, dlogits, o, stream);
    linear_backward(dlogits, x, w, dx, dw, db, stream);
  }
  const Result unfused{to_cpu(loss, stream), to_cpu(dx, stream), to_cpu(dw, stream),
                       to_cpu(db, stream)};
  const double tol = 2 * tolerance(target, dtype);
  expect_close(run(target, stream, p, o, 5), unfused, tol, "chunks of 5");
  expect_close(run(target, stream, p, o, n), unfused, tol, "one chunk");
  if (target.backend == KernelBackend::CPU && dtype == DType::F64)
    expect_bitwise(run(target, stream, p, o, n), unfused, "one chunk");
}

TEST_P(FusedLinearCrossEntropyKernels, ChunkRowsZeroRunsTheDevicesDefaultChunks) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // 600 rows: the cpu's default is 512 rows (chunks of 512 and 88), cuda's more than 600 for
  // V = 300 (one chunk). chunk_rows = 0 is bitwise that chunking; where it splits the rows, one
  // chunk of 600 sums a bf16 grad_weight in another order (rounded per chunk), so it differs.
  const std::int64_t n = 600, v = 300;
  const Problem p = make_problem(dtype, n, 16, v, true, Reduction::Mean, 20);
  const std::int64_t chunk = fused_linear_cross_entropy_chunk_rows(target.device.type, v);
  const Result by_default = run(target, stream, p, {}, 0);
  expect_bitwise(by_default, run(target, stream, p, {}, std::min(chunk, n)),
                 fmt::format("0 vs {}", chunk));
  if (chunk < n && dtype == DType::BF16) {
    EXPECT_FALSE(
        testing::bitwise_equal(by_default.grad_weight, run(target, stream, p, {}, n).grad_weight));
  }
}

INSTANTIATE_TEST_SUITE_P(, FusedLinearCrossEntropyKernels,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);

class FusedLinearCrossEntropyKernelTargets : public ::testing::TestWithParam<Target> {};

TEST_P(FusedLinearCrossEntropyKernelTargets,
       AnF32GradWeightSumsEveryChunkWhereABf16OneRoundsEachAway) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  // Weight (2, 1) = 0: logits 0, p = 1/2 in both columns, labels 0, reduction sum: every row's
  // dlogits are [-1/2, 1/2], so grad_weight = [-1/2, 1/2] * sum of x. x = [512, 1 x 15]: the first
  // chunk of one row gives 256, then fifteen steps of 1/2 each. bf16 holds 256 with an ulp of 2,
  // so 256 + 1/2 rounds back to 256 every chunk; the f32 grad_weight gets 263.5, and one chunk
  // rounds 263.5 once, to 264 (p is 1/2 within fp32 rounding of exp and log, hence NEAR for f32).
  const std::int64_t n = 16;
  Tensor host_x = test::full({n, 1}, DType::BF16, 1);
  copy(test::full({1, 1}, DType::F64, 512), host_x.view().narrow(0, 0, 1));
  const Tensor x = on(host_x, d, stream), w = Tensor::zeros({2, 1}, DType::BF16, d, stream),
               labels = Tensor::zeros({n}, DType::I64, d, stream),
               grad_loss = on(test::full({}, DType::BF16, 1), d, stream);
  const CrossEntropyOptions o{.reduction = Reduction::Sum};
  const Tensor loss({}, DType::BF16, d, stream), dw16({2, 1}, DType::BF16, d, stream),
      dw32({2, 1}, DType::F32, d, stream);
  ForceKernelBackend force(target.backend);
  fused_linear_cross_entropy(x, w, {}, labels, grad_loss, loss, {}, dw16, {}, o, 1, stream);
  fused_linear_cross_entropy(x, w, {}, labels, grad_loss, loss, {}, dw32, {}, o, 1, stream);
  EXPECT_EQ(values(to_cpu(dw16, stream)), (std::vector<double>{-256, 256}));
  const std::vector<double> f32 = values(to_cpu(dw32, stream));
  EXPECT_NEAR(f32[0], -263.5, 1e-4);
  EXPECT_NEAR(f32[1], 263.5, 1e-4);
  fused_linear_cross_entropy(x, w, {}, labels, grad_loss, loss, {}, dw16, {}, o, n, stream);
  EXPECT_EQ(values(to_cpu(dw16, stream)), (std::vector<double>{-264, 264}));
}

INSTANTIATE_TEST_SUITE_P(, FusedLinearCrossEntropyKernelTargets,
                         ::testing::ValuesIn(test::kernel_targets()), test::target_param_name);

// The cpu backend's weight blocks and its accumulation of grad_weight over many chunks. Cuda's
// gradient GEMMs take the logits' gradient rounded to the dtype, so its f32 grad_weight is not
// the exact sum checked here: the two 16-bit tests above bound it.
class FusedLinearCrossEntropyCpu : public ::testing::TestWithParam<DType> {};

TEST_P(FusedLinearCrossEntropyCpu, SeveralWeightBlocksMatchTheReferenceWithOneOrManyChunks) {
  const DType dtype = GetParam();
  const Target cpu{KernelBackend::CPU, Device{}};
  // 16-bit weights are widened to fp32 a block of rows at a time; blocks of 16 rows over V = 37
  // (the last one partial) cover the block loop, with one chunk and several (a 16-bit grad_weight
  // block's product added and rounded per chunk; an f32 one accumulated by the GEMM).
  const std::int64_t n = 9, h = 16, v = 37;
  const Problem p = make_problem(dtype, n, h, v, true, Reduction::None, 4);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  for (DType gdt : grad_dtypes(dtype)) {
    Result ref{Tensor({n}, dtype), test::empty_like(p.x), Tensor(p.weight.shape(), gdt),
               Tensor(p.bias.shape(), gdt)};
    {
      ForceKernelBackend force(KernelBackend::Reference);
      fused_linear_cross_entropy(p.x, p.weight, p.bias, p.labels, p.grad_loss, ref.loss, ref.grad_x,
                                 ref.grad_weight, ref.grad_bias, o);
    }
    for (std::int64_t chunk : {std::int64_t{4}, n}) {
      Result out{Tensor({n}, dtype), test::empty_like(p.x), Tensor(p.weight.shape(), gdt),
                 Tensor(p.bias.shape(), gdt)};
      const FusedLinearCrossEntropyShape s{dtype,       n,    h,    v,    chunk,
                                           o.reduction, true, true, true, true};
      detail::cpu::fused_linear_cross_entropy_blocked(
          16 * h, s, DType::I64,
          {p.x.data_ptr<void>(), p.weight.data_ptr<void>(), p.bias.data_ptr<void>(),
           p.labels.data_ptr<void>(), p.grad_loss.data_ptr<void>(), out.loss.data_ptr<void>(),
           out.grad_x.data_ptr<void>(), out.grad_weight.data_ptr<void>(),
           out.grad_bias.data_ptr<void>(), dtype, gdt, gdt},
          o);
      expect_close(out, ref, tolerance(cpu, dtype),
                   fmt::format("chunk={} grad dtype {}", chunk, to_string(gdt)));
    }
  }
}

// grad_weight over many chunks, both ways, against the exact gradient of the reference (double,
// rounded once to f32). Reduction sum, so that the gradient of the first k chunks' rows alone is
// the running sum s_k after chunk k. A 16-bit grad_weight is rounded once per chunk: its error at
// each element is at most sum over k of u |s_k| (plus fp32 GEMM rounding, orders smaller), the
// bound checked here (x1.1 for the rounding of the running sums themselves); typical errors grow
// like sqrt(chunks) u |s|. An f32 grad_weight (also a 16-bit bias's f32 grad_bias) accumulates
// every chunk in fp32: within 1e-5 of the largest value, whatever the number of chunks.
TEST_P(FusedLinearCrossEntropyCpu, ManyChunksAccumulateGradWeightAsItsDTypeSays) {
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

INSTANTIATE_TEST_SUITE_P(, FusedLinearCrossEntropyCpu, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

// Known values, on every target.
class FusedLinearCrossEntropyTorch : public ::testing::TestWithParam<Target> {};

TEST_P(FusedLinearCrossEntropyTorch, MatchesTorchLinearThenCrossEntropy) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
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
  const auto expect_near = [&](const TensorView& t, const std::vector<double>& want,
                               const std::string& what) {
    const std::vector<double> got = values(to_cpu(t, stream));
    ASSERT_EQ(got.size(), want.size()) << what;
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-13) << what << i;
  };
  const Tensor on_x = on(x, d, stream), on_w = on(w, d, stream), on_b = on(b, d, stream),
               on_labels = on(labels, d, stream);
  const Tensor one = on(test::full({}, DType::F64, 1), d, stream),
               upstream = on(from({3}, DType::F64, {1, 2, -0.5}), d, stream);
  ForceKernelBackend force(target.backend);
  for (std::int64_t chunk : {1, 2, 3}) {
    const std::string what = fmt::format("chunk={} ", chunk);
    const Tensor loss({}, DType::F64, d, stream), dx({3, 4}, DType::F64, d, stream),
        dw({5, 4}, DType::F64, d, stream), db({5}, DType::F64, d, stream);
    fused_linear_cross_entropy(
        on_x, on_w, on_b, on_labels, one, loss, dx, dw, db,
        {.label_smoothing = 0.1, .logits_multiplier = 0.5, .z_loss_scale = 1e-2}, chunk, stream);
    expect_near(loss, {2.8553904047758474}, what + "a loss");
    expect_near(dx, a_dx, what + "a dx");
    expect_near(dw, a_dw, what + "a dw");
    expect_near(db, a_db, what + "a db");
    const Tensor losses({3}, DType::F64, d, stream);
    fused_linear_cross_entropy(on_x, on_w, {}, on_labels, upstream, losses, dx, dw, {},
                               {.reduction = Reduction::None}, chunk, stream);
    expect_near(losses, b_loss, what + "b loss");
    expect_near(dx, b_dx, what + "b dx");
    expect_near(dw, b_dw, what + "b dw");
  }
}

INSTANTIATE_TEST_SUITE_P(, FusedLinearCrossEntropyTorch, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

TEST(FusedLinearCrossEntropy, WorkspaceLogitsAreChunkRowsTimesVocabTimesFourBytes) {
  // The cpu backend allocates exactly these parts (cpu.cpp sizes its buffers from the same plan).
  FusedLinearCrossEntropyShape s{DType::BF16,     512,   2048, 32000, 128,
                                 Reduction::Mean, false, true, true,  false};
  FusedLinearCrossEntropyWorkspace ws = fused_linear_cross_entropy_workspace(s);
  EXPECT_EQ(ws.logits, 128 * 32000 * 4);
  EXPECT_EQ(ws.per_row, 512 * (8 + 8));
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
  EXPECT_EQ(ws.per_row, 512 * (8 + 8 + 8));  // + the per-row upstream of `none`
  EXPECT_EQ(ws.staging, 0);
  EXPECT_EQ(ws.grad_bias, 32000 * 8);
  s.dtype = DType::F64;
  EXPECT_EQ(fused_linear_cross_entropy_workspace(s).logits, 128 * 32000 * 8);
  // Loss only: no gradient buffers.
  s = {DType::BF16, 512, 2048, 32000, 128, Reduction::None, true, false, false, false};
  ws = fused_linear_cross_entropy_workspace(s);
  EXPECT_EQ(ws.per_row, 512 * (8 + 8));
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
  expect_error(call(p.x, p.weight, p.bias, p.labels, p.grad_loss, loss, dx, dw, db,
                    {.vocab_start = 10, .vocab_size = 20}),
               ErrorCode::InvalidArgument, {op, "vocabulary shard", "got 10 and 20"});
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
  // loss: the input's dtype, or f32 for 16-bit inputs; grad_loss: the loss's.
  expect_error(call(h.x, h.weight, h.bias, h.labels, h.grad_loss, Tensor({}, DType::F16), hdx, {},
                    {}),
               ErrorCode::DTypeMismatch, {op, "'loss'", "'x' (bf16) or f32", "got f16"});
  expect_error(call(h.x, h.weight, h.bias, h.labels, h.grad_loss, Tensor({}, DType::F32), hdx, {},
                    {}),
               ErrorCode::DTypeMismatch, {op, "'grad_loss'", "'loss' (f32)", "got bf16"});
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

TEST(CudaFusedLinearCrossEntropy, PeakExtraMemoryIsOneChunkOfFp32LogitsAndNoGradWeightCopy) {
  // bf16, N = 1024, H = 2048, V = 16384 in chunks of 256: the chunk's fp32 logits are 16 MiB;
  // besides them only per-row statistics (N x 24 bytes) and cuBLASLt's workspace (<= 32 MiB). A
  // V x H fp32 grad_weight accumulator (128 MiB) or the bf16 (N, V) logits (32 MiB) and their
  // gradient would not fit the bound, with a bf16 or an f32 grad_weight. Inputs and outputs are
  // allocated before the measure.
  MESHFUSE_REQUIRE_CUDA();
  const Device cuda = test::kCuda;
  const Stream stream{cuda};
  const std::int64_t n = 1024, h = 2048, v = 16384, chunk = 256;
  const Tensor x = on(randn({n, h}, DType::BF16, 15), cuda, stream),
               w = on(randn({v, h}, DType::BF16, 16, 0.02), cuda, stream),
               y = on(make_labels(n, v, DType::I64, 17), cuda, stream),
               g = on(test::full({}, DType::BF16, 1), cuda, stream);
  const std::int64_t logits = chunk * v * 4, bound = logits + n * 24 + (std::int64_t{34} << 20);
  for (DType gdt : {DType::BF16, DType::F32}) {
    const Tensor loss({}, DType::BF16, cuda, stream), dx({n, h}, DType::BF16, cuda, stream),
        dw({v, h}, gdt, cuda, stream);
    synchronize(stream);
    reset_peak_memory_stats(cuda);
    const std::int64_t before = device_memory_stats(cuda).allocated;
    fused_linear_cross_entropy(x, w, {}, y, g, loss, dx, dw, {}, {}, chunk, stream);
    synchronize(stream);
    const DeviceMemoryStats after = device_memory_stats(cuda);
    EXPECT_EQ(after.allocated, before) << to_string(gdt);  // all scratch released
    const std::int64_t extra = after.peak_allocated - before;
    EXPECT_GE(extra, logits) << to_string(gdt);
    EXPECT_LE(extra, bound) << to_string(gdt);
  }
}

#ifdef MESHFUSE_WITH_CUDA
TEST(CudaFusedLinearCrossEntropy, BothDirectionsHaveACudaKernel) {
  for (std::string op : {"fused_linear_cross_entropy", "fused_linear_cross_entropy_backward"}) {
    int found = 0;
    for (const KernelInfo& k : registered_kernels())
      if (k.op == op && k.backend == KernelBackend::CUDA) ++found;
    EXPECT_EQ(found, 1) << op;
  }
}
#endif

}  // namespace
}  // namespace meshfuse
