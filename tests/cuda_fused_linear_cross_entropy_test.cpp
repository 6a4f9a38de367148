// fused_linear_cross_entropy on CUDA tensors against the reference backend on the CPU. Skipped
// without a GPU.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "meshfuse/core/memory.h"
#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::make_labels;
using test::values;

using test::kCuda;
using test::randn;
using test::to_cpu;
using test::to_cuda;

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
                     Reduction r, std::uint64_t seed) {
  return {randn({n, h}, dtype, seed), randn({v, h}, dtype, seed + 1, 0.3),
          bias ? randn({v}, dtype, seed + 2) : Tensor(), make_labels(n, v, DType::I64, seed + 3),
          r == Reduction::None ? randn({n}, dtype, seed + 4) : test::full({}, dtype, 1.5)};
}

// Outputs, on the CPU.
struct Result {
  Tensor loss, grad_x, grad_weight, grad_bias;
};

Tensor maybe(const Tensor& t, bool want, const Stream& stream) {
  return want && t.defined() ? Tensor(t.shape(), t.dtype(), t.device(), stream) : Tensor();
}

Tensor cpu_or_empty(const Tensor& t, const Stream& stream) {
  return t.defined() ? to_cpu(t, stream) : Tensor();
}

// Runs the op on tensors of `device` (inputs are moved there) with every gradient output
// (grad_bias when there is a bias), or the loss only; outputs come back on the CPU.
Result run_on(Device device, const Problem& p, const CrossEntropyOptions& o,
              std::int64_t chunk_rows, bool grads = true, const Stream& stream = {}) {
  const bool cuda = device.type == DeviceType::CUDA;
  const auto in = [&](const Tensor& t) { return cuda && t.defined() ? to_cuda(t, stream) : t; };
  const Tensor x = in(p.x), w = in(p.weight), b = in(p.bias), y = in(p.labels), g = in(p.grad_loss);
  const Tensor loss(loss_shape(p.x.size(0), o.reduction), p.x.dtype(), device, stream);
  const Tensor dx = maybe(x, grads, stream), dw = maybe(w, grads, stream),
               db = maybe(b, grads, stream);
  fused_linear_cross_entropy(x, w, b, y, grads ? g.view() : TensorView{}, loss, dx, dw, db, o,
                             chunk_rows, stream);
  return {to_cpu(loss, stream), cpu_or_empty(dx, stream), cpu_or_empty(dw, stream),
          cpu_or_empty(db, stream)};
}

Result run_cuda(const Problem& p, const CrossEntropyOptions& o, std::int64_t chunk_rows,
                bool grads = true, const Stream& stream = {}) {
  return run_on(kCuda, p, o, chunk_rows, grads, stream);
}

Result run_reference(const Problem& p, const CrossEntropyOptions& o) {
  ForceKernelBackend force(KernelBackend::Reference);
  return run_on(Device{}, p, o, 1);
}

// Tolerance against the double reference. f32: cuBLASLt's fp32 GEMMs (no TF32) sum over H, V and
// N. bf16 / f16: twice the dtype's default, as the gradient GEMMs take the logits' gradient rounded
// to the dtype (cuda.cu) on top of the outputs' own rounding.
double tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return 1e-10;
    case DType::F32:
      return 1e-4;
    default:
      return 2 * testing::default_tolerance(dtype);
  }
}

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

// Plain options, and label smoothing with a logit multiplier and the z-loss.
std::vector<CrossEntropyOptions> option_sets(Reduction r) {
  return {{-100, r, 0.0, 1.0, 0.0}, {-100, r, 0.1, 0.7, 1e-3}};
}

class CudaFusedLinearCrossEntropyTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { MESHFUSE_REQUIRE_CUDA(); }
};

TEST_P(CudaFusedLinearCrossEntropyTest, MatchesReferenceForEveryReductionBiasOptionAndChunking) {
  // N = 11 rows in chunks of 1, 3 (the last one partial) and N; H and V odd (scalar row kernels).
  for (bool bias : {false, true})
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      const Problem p = make_problem(GetParam(), 11, 19, 37, bias, r, 1);
      for (const CrossEntropyOptions& o : option_sets(r)) {
        const Result ref = run_reference(p, o);
        for (std::int64_t chunk : {1, 3, 11})
          expect_close(run_cuda(p, o, chunk), ref, tolerance(GetParam()),
                       fmt::format("bias={} {} eps={} chunk={}", bias, to_string(r),
                                   o.label_smoothing, chunk));
      }
    }
}

TEST_P(CudaFusedLinearCrossEntropyTest, WideVocabularyRowsMatchReference) {
  // V = 2504: 16-byte vectorised row kernels, and rows of several 1024-element tiles for the
  // in-place rounding of the 16-bit logit gradient.
  for (Reduction r : {Reduction::None, Reduction::Mean}) {
    const Problem p = make_problem(GetParam(), 24, 64, 2504, true, r, 2);
    const CrossEntropyOptions o = option_sets(r)[1];
    const Result ref = run_reference(p, o);
    for (std::int64_t chunk : {7, 24})
      expect_close(run_cuda(p, o, chunk), ref, tolerance(GetParam()),
                   fmt::format("{} chunk={}", to_string(r), chunk));
  }
}

TEST_P(CudaFusedLinearCrossEntropyTest, ChunksOfNOrMoreAreBitwiseEqual) {
  const Problem p = make_problem(GetParam(), 10, 24, 50, true, Reduction::Mean, 3);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const Result whole = run_cuda(p, o, 10);
  expect_bitwise(run_cuda(p, o, 11), whole, "chunk 11");
  expect_bitwise(run_cuda(p, o, 1000), whole, "chunk 1000");
}

TEST_P(CudaFusedLinearCrossEntropyTest, AllLabelsIgnoredGiveZeroNoneNanMeanZeroSumAndZeroGrads) {
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    Problem p = make_problem(GetParam(), 5, 12, 20, true, r, 4);
    for (std::int64_t i = 0; i < 5; ++i) set(p.labels, i, -100);
    const Result out =
        run_cuda(p, {.reduction = r, .label_smoothing = 0.2, .z_loss_scale = 1e-4}, 2);
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

TEST_P(CudaFusedLinearCrossEntropyTest, ZeroRowsGiveEmptyOrNanOrZeroLossAndZeroWeightGradients) {
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    const Problem p = make_problem(GetParam(), 0, 8, 6, true, r, 5);
    const Tensor loss(loss_shape(0, r), GetParam(), kCuda), dx({0, 8}, GetParam(), kCuda),
        dw = to_cuda(test::full({6, 8}, GetParam(), 7)),
        db = to_cuda(test::full({6}, GetParam(), 7));
    fused_linear_cross_entropy(to_cuda(p.x), to_cuda(p.weight), to_cuda(p.bias), to_cuda(p.labels),
                               to_cuda(p.grad_loss), loss, dx, dw, db, {.reduction = r});
    const std::string what(to_string(r));
    const std::vector<double> l = values(to_cpu(loss));
    if (r == Reduction::None)
      EXPECT_TRUE(l.empty()) << what;
    else
      EXPECT_TRUE(r == Reduction::Mean ? std::isnan(l[0]) : l[0] == 0.0) << what;
    for (double g : values(to_cpu(dw))) ASSERT_EQ(g, 0.0) << what;
    for (double g : values(to_cpu(db))) ASSERT_EQ(g, 0.0) << what;
  }
}

TEST_P(CudaFusedLinearCrossEntropyTest, ReductionNoneUsesThePerRowUpstreamGradient) {
  // Upstream 2 at row 4 and 0 elsewhere: the gradients of 2 * loss_4 alone, i.e. those of the
  // sum reduction with upstream 2 and every other label ignored.
  const std::int64_t n = 8;
  Problem none = make_problem(GetParam(), n, 14, 25, true, Reduction::None, 6);
  none.grad_loss = Tensor::zeros({n}, GetParam());
  set(none.grad_loss, 4, 2);
  Problem one_row = none;
  one_row.labels = Tensor::copy_of(none.labels);
  for (std::int64_t i = 0; i < n; ++i)
    if (i != 4) set(one_row.labels, i, -100);
  one_row.grad_loss = test::full({}, GetParam(), 2);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  CrossEntropyOptions sum = o;
  sum.reduction = Reduction::Sum;
  Result a = run_cuda(none, o, 3), b = run_cuda(one_row, sum, 3);
  a.loss = b.loss = Tensor();  // different shapes; the gradients are the point
  expect_close(a, b, tolerance(GetParam()), "upstream at row 4 only");
}

TEST_P(CudaFusedLinearCrossEntropyTest, LossOnlyEqualsTheLossComputedWithGradients) {
  const Problem p = make_problem(GetParam(), 10, 12, 40, true, Reduction::None, 7);
  const CrossEntropyOptions o = option_sets(Reduction::None)[1];
  const Result loss_only = run_cuda(p, o, 3, false);
  EXPECT_FALSE(loss_only.grad_x.defined());
  EXPECT_TRUE(testing::bitwise_equal(loss_only.loss, run_cuda(p, o, 3).loss));
}

TEST_P(CudaFusedLinearCrossEntropyTest, NonContiguousInputsGiveTheContiguousResult) {
  const Problem p = make_problem(GetParam(), 9, 20, 31, true, Reduction::None, 8);
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  const Result a = run_cuda(p, o, 4);
  // Transposed views of CUDA storage holding x and weight.
  const auto transposed_on_cuda = [](const Tensor& t) {
    const Tensor storage({t.size(1), t.size(0)}, t.dtype(), kCuda);
    copy(t, storage.view().transpose(0, 1));
    return storage;
  };
  const Tensor xs = transposed_on_cuda(p.x), ws = transposed_on_cuda(p.weight);
  const Tensor loss({9}, GetParam(), kCuda), dx(p.x.shape(), GetParam(), kCuda),
      dw(p.weight.shape(), GetParam(), kCuda), db({31}, GetParam(), kCuda);
  fused_linear_cross_entropy(xs.view().transpose(0, 1), ws.view().transpose(0, 1), to_cuda(p.bias),
                             to_cuda(p.labels), to_cuda(p.grad_loss), loss, dx, dw, db, o, 4);
  expect_bitwise(a, {to_cpu(loss), to_cpu(dx), to_cpu(dw), to_cpu(db)}, "transposed x and weight");
}

TEST_P(CudaFusedLinearCrossEntropyTest, DeterministicRunToRunOnAStream) {
  const Problem p = make_problem(GetParam(), 40, 64, 300, true, Reduction::Mean, 9);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  CudaStream stream;
  const Result first = run_cuda(p, o, 16, true, stream);
  for (int i = 0; i < 3; ++i) expect_bitwise(run_cuda(p, o, 16, true, stream), first, "rerun");
}

TEST_P(CudaFusedLinearCrossEntropyTest, ForcedReferenceOnCudaTensorsMatchesTheCpuReference) {
  const Problem p = make_problem(GetParam(), 7, 10, 15, true, Reduction::Sum, 10);
  const CrossEntropyOptions o = option_sets(Reduction::Sum)[1];
  Result staged;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    staged = run_cuda(p, o, 3);
  }
  expect_bitwise(staged, run_reference(p, o), "reference through host staging");
}

// grad_weight and grad_bias of 16-bit inputs in f32 over 16 chunks (the GEMM accumulates in the
// caller's f32 buffer), against the reference's exact gradients rounded to f32. The tolerance is
// that of the 16-bit outputs: the GEMMs take the logits' gradient rounded to the dtype.
TEST_P(CudaFusedLinearCrossEntropyTest, AnF32GradWeightOfSixteenBitWeightsMatchesTheReference) {
  const DType dt = GetParam();
  if (dt != DType::BF16 && dt != DType::F16) GTEST_SKIP() << "16-bit weights only";
  const std::int64_t n = 64, h = 40, v = 300;
  const Problem p = make_problem(dt, n, h, v, true, Reduction::Mean, 12);
  const CrossEntropyOptions o = option_sets(Reduction::Mean)[1];
  const auto run_f32_grads = [&](Device device) {
    const bool cuda = device.type == DeviceType::CUDA;
    const auto in = [&](const Tensor& t) { return cuda ? to_cuda(t) : t; };
    const Tensor loss({}, dt, device), dw({v, h}, DType::F32, device), db({v}, DType::F32, device);
    fused_linear_cross_entropy(in(p.x), in(p.weight), in(p.bias), in(p.labels), in(p.grad_loss),
                               loss, {}, dw, db, o, 4);
    return std::pair{to_cpu(dw), to_cpu(db)};
  };
  const auto [dw, db] = run_f32_grads(kCuda);
  std::pair<Tensor, Tensor> ref;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref = run_f32_grads(Device{});
  }
  test::expect_close(dw, ref.first, tolerance(dt), "f32 grad_weight");
  test::expect_close(db, ref.second, tolerance(dt), "f32 grad_bias");
}

// A 16-bit grad_weight takes each chunk's fp32 product added to its 16-bit running sum and rounded
// once per chunk: against the f32 grad_weight of the same chunks (same products), the difference
// at each element is at most sum over k of u |s_k| (u the dtype's unit roundoff, s_k the running
// sum after chunk k, from the f32 runs on the first k chunks; x1.1 for the rounding of the sums
// themselves), plus fp32-level differences between the two GEMMs' algorithms (1e-5 of the largest).
TEST_P(CudaFusedLinearCrossEntropyTest, ASixteenBitGradWeightRoundsOncePerChunkAndNoMore) {
  const DType dt = GetParam();
  if (dt != DType::BF16 && dt != DType::F16) GTEST_SKIP() << "16-bit weights only";
  const std::int64_t n = 64, h = 24, v = 50, chunk = 4, chunks = n / chunk;
  const Problem p = make_problem(dt, n, h, v, false, Reduction::Sum, 13);
  const CrossEntropyOptions o{.reduction = Reduction::Sum};
  const Tensor x = to_cuda(p.x), w = to_cuda(p.weight), y = to_cuda(p.labels),
               g = to_cuda(p.grad_loss);
  const auto grad_weight = [&](std::int64_t rows, DType gdt) {
    const Tensor loss({}, dt, kCuda), dw({v, h}, gdt, kCuda);
    fused_linear_cross_entropy(x.view().narrow(0, 0, rows), w, {}, y.view().narrow(0, 0, rows), g,
                               loss, {}, dw, {}, o, chunk);
    return values(to_cpu(dw));
  };
  std::vector<std::vector<double>> partial;  // s_1 .. s_chunks
  for (std::int64_t k = 1; k <= chunks; ++k) partial.push_back(grad_weight(k * chunk, DType::F32));
  const std::vector<double>& f32 = partial.back();
  const std::vector<double> narrow = grad_weight(n, dt);
  double largest = 0;
  for (double e : f32) largest = std::max(largest, std::fabs(e));
  const double u = dt == DType::BF16 ? 0x1p-8 : 0x1p-11;
  for (std::size_t i = 0; i < f32.size(); ++i) {
    double sum = 0;
    for (const std::vector<double>& s : partial) sum += std::fabs(s[i]);
    ASSERT_LE(std::fabs(narrow[i] - f32[i]), 1.1 * u * sum + 1e-5 * largest) << "element " << i;
  }
}

TEST_P(CudaFusedLinearCrossEntropyTest, ChunkRowsZeroRunsTheCudaDefaultChunk) {
  // V = 300: the default is far more than N rows, so one chunk, bitwise that of chunk_rows = N.
  const Problem p = make_problem(GetParam(), 40, 16, 300, true, Reduction::Mean, 14);
  ASSERT_GT(fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, 300), 40);
  expect_bitwise(run_cuda(p, {}, 0), run_cuda(p, {}, 40), "0 vs 40");
}

INSTANTIATE_TEST_SUITE_P(DTypes, CudaFusedLinearCrossEntropyTest,
                         ::testing::ValuesIn(test::kFloatDTypes), test::dtype_name);

TEST(CudaFusedLinearCrossEntropy, BadLabelNamesTheRowAndValue) {
  MESHFUSE_REQUIRE_CUDA();
  Problem p = make_problem(DType::F32, 6, 8, 10, false, Reduction::Mean, 11);
  set(p.labels, 4, 10);
  test::expect_error([&] { run_cuda(p, {}, 2); }, ErrorCode::InvalidArgument,
                     {"fused_linear_cross_entropy", "4", "10"});
}

TEST(CudaFusedLinearCrossEntropy, PeakExtraMemoryIsOneChunkOfFp32LogitsAndNoGradWeightCopy) {
  // bf16, N = 1024, H = 2048, V = 16384 in chunks of 256: the chunk's fp32 logits are 16 MiB;
  // besides them only per-row statistics (N x 20 bytes) and cuBLASLt's workspace (<= 32 MiB). A
  // V x H fp32 grad_weight accumulator (128 MiB) or the bf16 (N, V) logits (32 MiB) and their
  // gradient would not fit the bound, with a bf16 or an f32 grad_weight. Inputs and outputs are
  // allocated before the measure.
  MESHFUSE_REQUIRE_CUDA();
  const std::int64_t n = 1024, h = 2048, v = 16384, chunk = 256;
  const Tensor x = to_cuda(randn({n, h}, DType::BF16, 15)),
               w = to_cuda(randn({v, h}, DType::BF16, 16, 0.02)),
               y = to_cuda(make_labels(n, v, DType::I64, 17)),
               g = to_cuda(test::full({}, DType::BF16, 1));
  const std::int64_t logits = chunk * v * 4, bound = logits + n * 20 + (std::int64_t{34} << 20);
  for (DType gdt : {DType::BF16, DType::F32}) {
    const Tensor loss({}, DType::BF16, kCuda), dx({n, h}, DType::BF16, kCuda),
        dw({v, h}, gdt, kCuda);
    synchronize(Stream{kCuda});
    reset_peak_memory_stats(kCuda);
    const std::int64_t before = device_memory_stats(kCuda).allocated;
    fused_linear_cross_entropy(x, w, {}, y, g, loss, dx, dw, {}, {}, chunk);
    synchronize(Stream{kCuda});
    const DeviceMemoryStats after = device_memory_stats(kCuda);
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
