// gemm, bmm, linear and linear_backward on every backend the build has (cpu; cuda through
// cuBLASLt) against the reference backend on the CPU; CUDA cases skip without a GPU.
#include <sys/mman.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "ops/gemm/gemm_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::randn;
using test::to_cpu;
using test::values;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

template <typename F>
auto on_reference(F&& f) {
  ForceKernelBackend force(KernelBackend::Reference);
  return f();
}

// fp32 (f64) accumulation against the double reference: a sum of k products of O(1) values is
// O(sqrt(k)), and so are the accumulation errors; the absolute tolerance scales by sqrt(k). At
// 256 x 384 x 520 the f32 tolerance (about 6e-4 on values near 34) also tells full fp32 from
// TF32, whose 10-bit inputs would be off by about 3e-2.
void expect_gemm_close(const TensorView& actual, const TensorView& expected, std::int64_t k,
                       const std::string& what) {
  const double tol = testing::default_tolerance(expected.dtype());
  const testing::Diff d =
      testing::compare(actual, expected, tol * std::sqrt(std::max<double>(k, 1)), tol);
  EXPECT_EQ(d.violations, 0) << what << ": max abs err " << d.max_abs_err << ", max rel err "
                             << d.max_rel_err << ", non-finite mismatches "
                             << d.mismatched_nonfinite;
}

// gemm (2-D) or bmm (3-D) into a fresh output on a's device.
Tensor run_matmul(const TensorView& a, const TensorView& b, const TensorView& c,
                  const GemmOptions& o, const Stream& stream = {}) {
  const std::int64_t m = a.size(o.transpose_a ? -1 : -2), n = b.size(o.transpose_b ? -2 : -1);
  if (a.dim() == 2) {
    Tensor d({m, n}, a.dtype(), a.device(), stream);
    gemm(a, b, c, d, o, stream);
    return d;
  }
  Tensor d({a.size(0), m, n}, a.dtype(), a.device(), stream);
  bmm(a, b, c, d, o, stream);
  return d;
}

struct LinearGrads {
  Tensor out, grad_x, grad_weight, grad_bias;
};

// linear and linear_backward with every output on x's device.
LinearGrads run_linear(const TensorView& x, const TensorView& w, const TensorView& bias,
                       const TensorView& dy, const Stream& stream = {}) {
  const Device dev = x.device();
  Shape out_shape = x.shape();
  out_shape.back() = w.size(0);
  LinearGrads g{Tensor(out_shape, x.dtype(), dev, stream),
                Tensor(x.shape(), x.dtype(), dev, stream),
                Tensor(w.shape(), x.dtype(), dev, stream),
                {}};
  if (bias.defined()) g.grad_bias = Tensor({w.size(0)}, x.dtype(), dev, stream);
  linear(x, w, bias, g.out, stream);
  linear_backward(dy, x, w, g.grad_x, g.grad_weight, g.grad_bias, stream);
  return g;
}

LinearGrads to_host(const LinearGrads& g, const Stream& stream) {
  return {to_cpu(g.out, stream), to_cpu(g.grad_x, stream), to_cpu(g.grad_weight, stream),
          g.grad_bias.defined() ? to_cpu(g.grad_bias, stream) : Tensor{}};
}

void expect_linear_bitwise(const LinearGrads& a, const LinearGrads& b, const std::string& what) {
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out)) << what << " out";
  EXPECT_TRUE(testing::bitwise_equal(a.grad_x, b.grad_x)) << what << " grad_x";
  EXPECT_TRUE(testing::bitwise_equal(a.grad_weight, b.grad_weight)) << what << " grad_weight";
  EXPECT_TRUE(testing::bitwise_equal(a.grad_bias, b.grad_bias)) << what << " grad_bias";
}

// One case of the cross-backend suites: the target's backend is forced for the whole test (the
// oracle's on_reference nests its own guard), its tensors live on the target's device and its
// work runs on `stream`.
class GemmCase : public ::testing::TestWithParam<test::OpCase> {
 protected:
  void SetUp() override { MESHFUSE_REQUIRE_TARGET(target); }

  // A copy of a CPU tensor on the target's device (undefined stays undefined), and back.
  Tensor on(const TensorView& t) const { return test::on(t, target.device, stream); }
  Tensor back(const TensorView& t) const { return to_cpu(t, stream); }

  // run_matmul on the target's copies of CPU inputs against the reference on the inputs.
  void expect_matmul_matches_reference(const Tensor& a, const Tensor& b, const Tensor& c,
                                       const GemmOptions& o, const std::string& what) const {
    const Tensor ref = on_reference([&] { return run_matmul(a, b, c, o); });
    const Tensor got = run_matmul(on(a), on(b), on(c), o, stream);
    EXPECT_EQ(got.device(), target.device);
    expect_gemm_close(back(got), ref, a.size(o.transpose_a ? -2 : -1), what);
  }

  // linear and its gradients on the target's copies of CPU inputs against the reference.
  void expect_linear_matches_reference(const Tensor& x, const Tensor& w, const Tensor& bias,
                                       const Tensor& dy) const {
    const LinearGrads ref = on_reference([&] { return run_linear(x, w, bias, dy); });
    const LinearGrads got = to_host(run_linear(on(x), on(w), on(bias), on(dy), stream), stream);
    expect_linear_close(got, ref, x.numel() / x.size(-1), x.size(-1), w.size(0));
  }

  // Each sum has its own length: over K for out, N for grad_x, the rows for the others.
  static void expect_linear_close(const LinearGrads& got, const LinearGrads& ref, std::int64_t rows,
                                  std::int64_t k, std::int64_t n) {
    expect_gemm_close(got.out, ref.out, k, "out");
    expect_gemm_close(got.grad_x, ref.grad_x, n, "grad_x");
    expect_gemm_close(got.grad_weight, ref.grad_weight, rows, "grad_weight");
    if (ref.grad_bias.defined()) expect_gemm_close(got.grad_bias, ref.grad_bias, rows, "grad_bias");
  }

  const test::Target target = GetParam().target;
  const DType dt = GetParam().dtype;
  const Stream stream{target.device};

 private:
  ForceKernelBackend force_{target.backend};
};

// cpu and cuda against the reference.
class GemmBackends : public GemmCase {};
// Every target, the reference on CPU and CUDA tensors included: known results and edge cases.
class GemmAllTargets : public GemmCase {};
// Layout invariances particular to the cpu backend.
class GemmCpu : public GemmCase {};

TEST_P(GemmBackends, EveryTransposeWithAndWithoutCMatchesTheReferenceAtOddAndMediumSizes) {
  struct Size {
    std::int64_t m, n, k;
  };
  // 20 x 1504 x 1100: a 16-bit B large enough for the cpu backend to widen with streaming stores,
  // in whole 16-column lines when not transposed and with partial 16 x 16 tiles when transposed.
  for (const Size s : {Size{1, 1, 1}, Size{7, 13, 33}, Size{65, 17, 130}, Size{3, 40, 1},
                       Size{256, 384, 520}, Size{20, 1504, 1100}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        const Tensor a = randn(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, dt, 1);
        const Tensor b = randn(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, dt, 2);
        const Tensor c = randn({s.m, s.n}, dt, 3);
        for (const bool with_c : {false, true})
          expect_matmul_matches_reference(
              a, b, with_c ? c : Tensor{}, {ta, tb, 1.5, with_c ? -0.5 : 0.0},
              fmt::format("{}x{}x{} ta={} tb={} c={}", s.m, s.n, s.k, ta, tb, with_c));
      }
}

TEST_P(GemmBackends, CInEveryLayoutMatchesTheReference) {
  const std::int64_t m = 19, n = 24, k = 40;
  const Tensor a = randn({m, k}, dt, 4), b = randn({k, n}, dt, 5), c = randn({m, n}, dt, 6);
  const GemmOptions o{false, false, 0.5, 2.0};
  const Tensor ref = on_reference([&] { return run_matmul(a, b, c, o); });
  const Tensor ta = on(a), tb = on(b);
  // A wider leading dimension (its own cuBLASLt layout).
  const Tensor wide = on(randn({m, n + 5}, dt, 7));
  copy(on(c), wide.view().narrow(1, 2, n), stream);
  expect_gemm_close(back(run_matmul(ta, tb, wide.view().narrow(1, 2, n), o, stream)), ref, k,
                    "wide ld");
  // Transposed storage (cuda copies it into D first).
  const Tensor ct = on(Tensor::copy_of(c.view().transpose(0, 1)));
  expect_gemm_close(back(run_matmul(ta, tb, ct.view().transpose(0, 1), o, stream)), ref, k,
                    "transposed");
  // In place: D is C.
  const Tensor d = on(c);
  gemm(ta, tb, d, d, o, stream);
  expect_gemm_close(back(d), ref, k, "in place");
  // bmm with one C for every batch item (batch stride 0).
  const Tensor a3 = randn({3, m, k}, dt, 8), b3 = randn({3, k, n}, dt, 9);
  const TensorView c_all(c.view().data(), dt, {3, m, n}, {0, n, 1});
  const Tensor tc = on(c);
  const TensorView tc_all(tc.view().data(), dt, {3, m, n}, {0, n, 1}, target.device);
  const Tensor ref3 = on_reference([&] { return run_matmul(a3, b3, c_all, o); });
  expect_gemm_close(back(run_matmul(on(a3), on(b3), tc_all, o, stream)), ref3, k,
                    "bmm broadcast C");
}

TEST_P(GemmBackends, InPlaceDEqualsCAccumulates) {
  const Tensor a = on(randn({6, 12}, dt, 25)), b = on(randn({12, 7}, dt, 26)),
               c = on(randn({6, 7}, dt, 27));
  const GemmOptions o{false, false, 1.0, 1.0};
  const Tensor expected = run_matmul(a, b, c, o, stream);
  const Tensor d = c.clone(stream);
  gemm(a, b, d, d, o, stream);
  EXPECT_TRUE(testing::bitwise_equal(back(d), back(expected)));
}

TEST_P(GemmBackends, BmmMatchesTheReferenceWithTransposesAndC) {
  const std::int64_t l = 3, m = 5, n = 9, k = 17;
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      const Tensor a = randn(ta ? Shape{l, k, m} : Shape{l, m, k}, dt, 10);
      const Tensor b = randn(tb ? Shape{l, n, k} : Shape{l, k, n}, dt, 11);
      expect_matmul_matches_reference(a, b, randn({l, m, n}, dt, 12), {ta, tb, 0.75, 2.0},
                                      fmt::format("bmm ta={} tb={}", ta, tb));
    }
  expect_matmul_matches_reference(randn({4, 64, 136}, dt, 13), randn({4, 72, 136}, dt, 14), {},
                                  {false, true, 1.0, 0.0}, "bmm 4 x 64 x 72 x 136");
}

TEST_P(GemmBackends, BmmBroadcastsAOrBWithBatchStrideZero) {
  const Tensor a = randn({4, 6, 10}, dt, 15), b = randn({10, 3}, dt, 16);
  const Tensor a1 = randn({6, 10}, dt, 17), b3 = randn({4, 10, 3}, dt, 18);
  const Tensor ta = on(a), tb = on(b), ta1 = on(a1);
  const auto every = [&](const TensorView& t, std::int64_t l) {
    return TensorView(t.data(), dt, {l, t.size(0), t.size(1)}, {0, t.size(1), 1}, t.device());
  };
  // B shared by every batch item.
  const Tensor ref_b = on_reference([&] { return run_matmul(a, every(b, 4), {}, {}); });
  const Tensor got_b = back(run_matmul(ta, every(tb, 4), {}, {}, stream));
  expect_gemm_close(got_b, ref_b, 10, "broadcast b");
  // The cpu backend runs each batch item as the gemm of that one matrix: bitwise the same.
  if (target.backend == KernelBackend::CPU)
    for (std::int64_t i = 0; i < 4; ++i) {
      const TensorView ai(a.view().narrow(0, i, 1).data(), dt, {6, 10});
      EXPECT_TRUE(testing::bitwise_equal(
          TensorView(got_b.view().narrow(0, i, 1).data(), dt, {6, 3}), run_matmul(ai, b, {}, {})))
          << "batch " << i;
    }
  // A shared, B transposed.
  const GemmOptions trans_b{false, true, 1.0, 0.0};
  const Tensor bt = Tensor::copy_of(b3.view().transpose(1, 2));
  const Tensor ref_a = on_reference([&] { return run_matmul(every(a1, 4), bt, {}, trans_b); });
  expect_gemm_close(back(run_matmul(every(ta1, 4), on(bt), {}, trans_b, stream)), ref_a, 10,
                    "broadcast a");
}

TEST_P(GemmBackends, LinearAndEveryGradientMatchTheReferenceWithAndWithoutBias) {
  struct Case {
    Shape x;
    std::int64_t n;
  };
  std::uint64_t seed = 20;
  for (const Case& c : {Case{{2, 3, 20}, 11}, Case{{4, 33, 136}, 72}})
    for (const bool with_bias : {false, true}) {
      SCOPED_TRACE(fmt::format("{} n={} bias={}", shape_str(c.x), c.n, with_bias));
      Shape out_shape = c.x;
      out_shape.back() = c.n;
      const Tensor x = randn(c.x, dt, seed++), w = randn({c.n, c.x.back()}, dt, seed++),
                   dy = randn(out_shape, dt, seed++);
      expect_linear_matches_reference(x, w, with_bias ? randn({c.n}, dt, seed++) : Tensor{}, dy);
    }
}

TEST_P(GemmBackends, LinearOfOneRowAndOfOneDimensionalInputMatchesTheReference) {
  const Tensor w = randn({5, 129}, dt, 13), bias = randn({5}, dt, 14);
  for (const Shape& shape : {Shape{1, 129}, Shape{129}})
    for (const bool with_bias : {false, true}) {
      SCOPED_TRACE(fmt::format("{} bias={}", shape_str(shape), with_bias));
      Shape out_shape = shape;
      out_shape.back() = 5;
      expect_linear_matches_reference(randn(shape, dt, 15), w, with_bias ? bias : Tensor{},
                                      randn(out_shape, dt, 16));
    }
}

TEST_P(GemmBackends, MisalignedAndTransposedViewsMatchTheReference) {
  // Operands one element into wider rows: odd leading dimensions and 2- or 4-byte aligned
  // pointers, which cuBLASLt's heuristic must be told about.
  const std::int64_t m = 33, n = 17, k = 65;
  const Tensor a = randn({m, k + 1}, dt, 30), b = randn({k, n + 1}, dt, 31),
               c = randn({m, n + 1}, dt, 32);
  const GemmOptions o{false, false, 1.0, 1.0};
  const auto inner = [](const TensorView& t) { return t.narrow(1, 1, t.size(1) - 1); };
  const Tensor ref = on_reference([&] { return run_matmul(inner(a), inner(b), inner(c), o); });
  const Tensor ta = on(a), tb = on(b), tc = on(c);
  expect_gemm_close(back(run_matmul(inner(ta), inner(tb), inner(tc), o, stream)), ref, k,
                    "misaligned");
  // linear with a misaligned bias (cuBLASLt's epilogue bias pointer), and transposed x, weight and
  // grad_out: the transposed grad_out gives the bits of grad_bias, whose order is fixed.
  const Tensor x = randn({40, 24}, dt, 33), w = randn({10, 24}, dt, 34),
               dy = randn({40, 10}, dt, 35), bias = randn({11}, dt, 36);
  const LinearGrads ref_l =
      on_reference([&] { return run_linear(x, w, bias.view().narrow(0, 1, 10), dy); });
  const auto transposed = [&](const Tensor& t) {
    return on(Tensor::copy_of(t.view().transpose(0, 1)));
  };
  const Tensor xt = transposed(x), wt = transposed(w), dyt = transposed(dy), tbias = on(bias);
  const LinearGrads g =
      to_host(run_linear(xt.view().transpose(0, 1), wt.view().transpose(0, 1),
                         tbias.view().narrow(0, 1, 10), dyt.view().transpose(0, 1), stream),
              stream);
  expect_linear_close(g, ref_l, 40, 24, 10);
  const LinearGrads contiguous =
      to_host(run_linear(on(x), on(w), tbias.view().narrow(0, 1, 10), on(dy), stream), stream);
  EXPECT_TRUE(testing::bitwise_equal(g.grad_bias, contiguous.grad_bias));
}

TEST_P(GemmAllTargets, ZeroSizedDimensionsFollowBlasSemantics) {
  const auto empty = [&](Shape s) { return Tensor(std::move(s), dt, target.device, stream); };
  // M = 0, N = 0 and batch = 0: empty outputs.
  EXPECT_EQ(run_matmul(empty({0, 4}), on(randn({4, 3}, dt, 1)), {}, {}, stream).shape(),
            (Shape{0, 3}));
  EXPECT_EQ(run_matmul(on(randn({2, 4}, dt, 2)), empty({4, 0}), {}, {}, stream).shape(),
            (Shape{2, 0}));
  EXPECT_EQ(run_matmul(empty({0, 2, 4}), empty({0, 4, 3}), {}, {}, stream).shape(),
            (Shape{0, 2, 3}));
  // K = 0: the product is empty, so D = beta * C (zeros without C), into an output holding NaN.
  const Tensor c = randn({2, 3}, dt, 3);
  const Tensor d = on(test::full({2, 3}, dt, kNan));
  gemm(empty({2, 0}), empty({0, 3}), on(c), d, {false, false, 1.0, 2.0}, stream);
  const std::vector<double> cv = values(c), dv = values(back(d));
  for (std::size_t i = 0; i < cv.size(); ++i) EXPECT_EQ(dv[i], 2.0 * cv[i]);
  gemm(empty({2, 0}), empty({0, 3}), {}, d, {}, stream);
  for (double v : values(back(d))) EXPECT_EQ(v, 0.0);
  // linear over zero rows: empty out and grad_x, zero grad_weight and grad_bias.
  const LinearGrads g = run_linear(empty({0, 4}), on(randn({3, 4}, dt, 4)), on(randn({3}, dt, 5)),
                                   empty({0, 3}), stream);
  EXPECT_EQ(g.out.shape(), (Shape{0, 3}));
  for (double v : values(back(g.grad_weight))) EXPECT_EQ(v, 0.0);
  for (double v : values(back(g.grad_bias))) EXPECT_EQ(v, 0.0);
}

TEST_P(GemmAllTargets, ZeroAlphaAndZeroBetaDoNotReadTheirOperands) {
  // As in BLAS and torch.addmm: NaN in A and B is ignored when alpha = 0, NaN in C when beta = 0,
  // and an output holding NaN is overwritten (cuBLASLt gets D as C with beta = 0).
  const Tensor nans = on(test::full({3, 3}, dt, kNan)), ones = on(test::full({3, 3}, dt, 1.0));
  for (double v : values(back(run_matmul(nans, nans, ones, {false, false, 0.0, 3.0}, stream))))
    EXPECT_EQ(v, 3.0);
  for (double v : values(back(run_matmul(ones, ones, nans, {false, false, 2.0, 0.0}, stream))))
    EXPECT_EQ(v, 6.0);
  const Tensor d = nans.clone(stream);
  gemm(ones, ones, {}, d, {}, stream);
  for (double v : values(back(d))) EXPECT_EQ(v, 3.0);
}

TEST_P(GemmBackends, NanAndInfPropagateLikeTheReference) {
  Tensor a = randn({4, 8}, dt, 40);
  const Tensor b = randn({8, 5}, dt, 41);
  fill(a.view().narrow(0, 0, 1).narrow(1, 3, 1), kNan);  // row 0 of D is NaN
  fill(a.view().narrow(0, 2, 1).narrow(1, 0, 1),
       std::numeric_limits<double>::infinity());  // row 2 of D is +-inf
  expect_matmul_matches_reference(a, b, {}, {}, "non-finite");
  const std::vector<double> d = values(back(run_matmul(on(a), on(b), {}, {}, stream)));
  for (int j = 0; j < 5; ++j) {
    EXPECT_TRUE(std::isnan(d[j])) << j;
    EXPECT_TRUE(std::isinf(d[2 * 5 + j])) << j;
    EXPECT_TRUE(std::isfinite(d[1 * 5 + j])) << j;
  }
}

TEST_P(GemmBackends, LinearBackwardComputesOnlyTheRequestedGradients) {
  const Tensor x = on(randn({5, 8}, dt, 37)), w = on(randn({6, 8}, dt, 38)),
               dy = on(randn({5, 6}, dt, 39));
  const LinearGrads all = run_linear(x, w, on(randn({6}, dt, 40)), dy, stream);
  const Tensor grad_weight({6, 8}, dt, target.device, stream);
  linear_backward(dy, x, w, {}, grad_weight, {}, stream);
  EXPECT_TRUE(testing::bitwise_equal(back(grad_weight), back(all.grad_weight)));
}

TEST_P(GemmBackends, DeterministicRunToRunOnAStream) {
  // A stream of its own on CUDA (non-blocking with respect to the default stream).
  std::optional<CudaStream> cuda_stream;
  if (target.device.type == DeviceType::CUDA) cuda_stream.emplace(target.device.index);
  const Stream own = cuda_stream ? cuda_stream->stream() : stream;
  const auto here = [&](const Tensor& t) { return test::on(t, target.device, own); };
  const auto twice_equal = [&](const Tensor& a, const Tensor& b, const Tensor& c,
                               const GemmOptions& o) {
    const Tensor ta = here(a), tb = here(b), tc = here(c);
    return testing::bitwise_equal(to_cpu(run_matmul(ta, tb, tc, o, own), own),
                                  to_cpu(run_matmul(ta, tb, tc, o, own), own));
  };
  EXPECT_TRUE(twice_equal(randn({70, 300}, dt, 28), randn({90, 300}, dt, 29),
                          randn({70, 90}, dt, 30), {false, true, 0.5, 0.25}));
  // Small M and N with a long K: the shape where cuBLASLt chooses split-K algorithms.
  const Tensor a = randn({64, 32768}, dt, 50), b = randn({64, 32768}, dt, 51);
  const GemmOptions trans_b{false, true, 1.0, 0.0};
  EXPECT_TRUE(twice_equal(a, b, {}, trans_b));
  expect_gemm_close(to_cpu(run_matmul(here(a), here(b), {}, trans_b, own), own),
                    on_reference([&] { return run_matmul(a, b, {}, trans_b); }), 32768, "long K");
  const Tensor big = randn({1024, 1024}, dt, 52);
  EXPECT_TRUE(twice_equal(big, big, {}, {}));
  // linear forward and backward with a bias.
  for (const auto& [rows, k, n] :
       {std::array<std::int64_t, 3>{200, 64, 40}, std::array<std::int64_t, 3>{1024, 512, 384}}) {
    const Tensor x = here(randn({4, rows / 4, k}, dt, 53)), w = here(randn({n, k}, dt, 54)),
                 bias = here(randn({n}, dt, 55)), dy = here(randn({4, rows / 4, n}, dt, 56));
    expect_linear_bitwise(to_host(run_linear(x, w, bias, dy, own), own),
                          to_host(run_linear(x, w, bias, dy, own), own),
                          fmt::format("linear {} x {} x {}", rows, k, n));
  }
}

TEST_P(GemmCpu, TransposedAndStridedViewsGiveBitwiseTheContiguousResult) {
  const GemmOptions o{false, false, 1.0, 1.0};
  // A transposed view gives bitwise the contiguous result: f32 and 16-bit operands reach sgemm as
  // the same row-major blocks either way, and f64's dgemm packs both layouts for one kernel. The
  // larger shapes have K past a kernel's block, where sgemm's sums follow its transpose flags.
  for (const auto& [m, k, n] :
       {std::array<std::int64_t, 3>{9, 33, 21}, {64, 1024, 96}, {20, 1100, 1504}}) {
    const Tensor a = randn({m, k}, dt, 17), b = randn({k, n}, dt, 18), c = randn({m, n}, dt, 19);
    const auto at = test::non_contiguous(a), bt = test::non_contiguous(b),
               ct = test::non_contiguous(c);
    EXPECT_TRUE(
        testing::bitwise_equal(run_matmul(at.view, bt.view, ct.view, o), run_matmul(a, b, c, o)))
        << m << " x " << k << " x " << n;
  }
  {  // Rows further apart than their length are read in place (f32) or widened: bitwise too.
    const std::int64_t m = 20, k = 1100, n = 1504;
    const Tensor a = randn({m, k}, dt, 17), b = randn({k, n}, dt, 18);
    Tensor wide_a({m, k + 3}, dt), wide_b({k, n + 5}, dt);
    const TensorView an = wide_a.view().narrow(1, 0, k), bn = wide_b.view().narrow(1, 0, n);
    copy(a, an);
    copy(b, bn);
    EXPECT_TRUE(testing::bitwise_equal(run_matmul(an, bn, {}, {}), run_matmul(a, b, {}, {})));
  }
  const Tensor a = randn({9, 33}, dt, 17), b = randn({33, 21}, dt, 18), c = randn({9, 21}, dt, 19);
  const Tensor expected = run_matmul(a, b, c, o);
  // A view with no unit stride is copied: bitwise the contiguous result.
  Tensor wide({9, 66}, dt);
  const TensorView every_other(wide.view().data(), dt, {9, 33}, {66, 2});
  copy(a, every_other);
  EXPECT_TRUE(testing::bitwise_equal(run_matmul(every_other, b, c, o), expected));
  // linear and its backward on transposed 2-D views of x, weight and grad_out.
  const Tensor x = randn({7, 24}, dt, 20), w = randn({10, 24}, dt, 21), dy = randn({7, 10}, dt, 22);
  const auto xt = test::non_contiguous(x), wt = test::non_contiguous(w),
             dyt = test::non_contiguous(dy);
  const Tensor bias = randn({10}, dt, 23);
  expect_linear_bitwise(run_linear(xt.view, wt.view, bias, dyt.view), run_linear(x, w, bias, dy),
                        "transposed views");
}

TEST_P(GemmAllTargets, MatchesTorchAddmmOnKnownValues) {
  // torch.addmm(C, A, B, beta=0.5, alpha=2.0) in float64. Every value is a short binary fraction,
  // so every dtype and backend gets these bits.
  const Tensor a = test::from({2, 3}, dt, {1, 2, 3, 4, 5, 6}),
               b = test::from({3, 2}, dt, {1, 0.5, -1, 2, 0.25, -3}),
               c = on(test::from({2, 2}, dt, {1, -1, 2, 0.5}));
  const std::vector<double> expected = {0.0, -9.5, 2.0, -11.75};
  EXPECT_EQ(values(back(run_matmul(on(a), on(b), c, {false, false, 2.0, 0.5}, stream))), expected);
  // The same through transpose flags: A^T^T and B^T^T.
  const Tensor at = test::from({3, 2}, dt, {1, 4, 2, 5, 3, 6}),
               bt = test::from({2, 3}, dt, {1, -1, 0.25, 0.5, 2, -3});
  EXPECT_EQ(values(back(run_matmul(on(at), on(bt), c, {true, true, 2.0, 0.5}, stream))), expected);
}

// Integer values in [-8, 8) of dtype dt (exact in every dtype), shaped `shape`.
Tensor integers(Shape shape, DType dt, std::uint64_t seed) {
  Tensor i64(std::move(shape), DType::I64), t(i64.shape(), dt);
  testing::fill_uniform_int(i64, seed, -8, 8);
  copy(i64, t);
  return t;
}

TEST_P(GemmAllTargets, AlphaScalesTheAccumulatedSumOnce) {
  // Integer-valued A and B in [-8, 8): every product and partial sum is an exact integer S in the
  // fp32 (f64) accumulator, so only the scaling rounds. alpha = 0.3 is not representable, and the
  // result must be alpha * S rounded once to the output dtype, as cuBLAS and torch do: alpha in the
  // accumulator's type (f32, or f64) on cpu and cuda, in double on the reference, which computes
  // in double. Scaling the operands before the sums (as BLAS packs them) rounds at every partial
  // sum and misses these bits.
  const double alpha = 0.3;
  for (const std::int64_t k : {256, 257, 1024}) {
    const Tensor a = integers({17, k}, dt, 60 + k), b = integers({k, 23}, dt, 61 + k);
    const std::vector<double> av = values(a), bv = values(b);
    const bool in_double = target.backend == KernelBackend::Reference || dt == DType::F64;
    Tensor expected_f64({17, 23}, DType::F64);
    for (std::int64_t i = 0; i < 17; ++i)
      for (std::int64_t j = 0; j < 23; ++j) {
        double sum = 0;  // exact: integers below 2^24
        for (std::int64_t l = 0; l < k; ++l) sum += av[i * k + l] * bv[l * 23 + j];
        expected_f64.data_ptr<double>()[i * 23 + j] =
            in_double ? alpha * sum
                      : static_cast<double>(static_cast<float>(alpha) * static_cast<float>(sum));
      }
    Tensor expected(expected_f64.shape(), dt);
    copy(expected_f64, expected);  // the one rounding to 16-bit (or to f32 from double)
    EXPECT_EQ(values(back(run_matmul(on(a), on(b), {}, {false, false, alpha, 0.0}, stream))),
              values(expected))
        << "k = " << k;
  }
}

TEST_P(GemmAllTargets, SixteenBitOperandsWithAnF32OutputKeepTheFp32SumUnrounded) {
  if (dt != DType::BF16 && dt != DType::F16) GTEST_SKIP() << "an f32 output of 16-bit operands";
  // Integer A and B with k = 257: every sum S is an exact integer up to 16448, and C (quarters
  // in f32) adds exactly, so the f32 output holds S + C exactly, bits that no 16-bit output has
  // (bf16 keeps 8 significant bits, f16 11). The 16-bit output of the same call is that value
  // rounded once.
  constexpr std::int64_t m = 9, k = 257, n = 13;
  const Tensor a = integers({m, k}, dt, 70), b = integers({k, n}, dt, 71),
               w = integers({n, k}, dt, 73);
  const std::vector<double> av = values(a), bv = values(b), wv = values(w);
  const auto quarters = [](Shape shape, DType dtype, std::uint64_t seed) {
    Tensor q = integers(shape, DType::F64, seed), t(std::move(shape), dtype);
    for (std::int64_t i = 0; i < q.numel(); ++i) q.data_ptr<double>()[i] /= 4;
    copy(q, t);
    return t;
  };
  const Tensor c = quarters({m, n}, DType::F32, 72), bias = quarters({n}, dt, 74);
  const std::vector<double> cv = values(c), biasv = values(bias);
  // The exact results (below 2^24 in magnitude, quarters: exact in f32).
  std::vector<double> product(m * n), lin(m * n);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0, t = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        s += av[i * k + l] * bv[l * n + j];
        t += av[i * k + l] * wv[j * k + l];
      }
      product[i * n + j] = s + cv[i * n + j];
      lin[i * n + j] = t + biasv[j];
    }

  Tensor d({m, n}, DType::F32, target.device, stream);
  gemm(on(a), on(b), on(c), d, {.beta = 1.0}, stream);
  EXPECT_EQ(values(back(d)), product) << "gemm";

  // bmm of two items, B given transposed (b^T's storage read through transpose_b).
  Tensor a3({2, m, k}, dt), bt3({2, n, k}, dt), c3({2, m, n}, DType::F32);
  for (std::int64_t l = 0; l < 2; ++l) {
    copy(a, a3.view().narrow(0, l, 1).reshape({m, k}));
    copy(b.view().transpose(0, 1), bt3.view().narrow(0, l, 1).reshape({n, k}));
    copy(c, c3.view().narrow(0, l, 1).reshape({m, n}));
  }
  Tensor d3({2, m, n}, DType::F32, target.device, stream);
  bmm(on(a3), on(bt3), on(c3), d3, {.transpose_b = true, .beta = 1.0}, stream);
  std::vector<double> twice = product;
  twice.insert(twice.end(), product.begin(), product.end());
  EXPECT_EQ(values(back(d3)), twice) << "bmm";

  // linear: the 16-bit bias widened exactly; the 16-bit output is the same value rounded once.
  Tensor out({m, n}, DType::F32, target.device, stream), out16({m, n}, dt, target.device, stream);
  linear(on(a), on(w), on(bias), out, stream);
  linear(on(a), on(w), on(bias), out16, stream);
  EXPECT_EQ(values(back(out)), lin) << "linear";
  Tensor lin16({m, n}, dt);
  copy(back(out), lin16);
  EXPECT_EQ(values(back(out16)), values(lin16)) << "linear, 16-bit output";

  // Without C (the product straight into D), alpha = 0.5 and D = C in place (exact halves),
  // K = 0 and alpha = 0 (D = beta * C; A and B are not read); linear without a bias and with an
  // f32 one.
  std::vector<double> sums(product), halves(product), doubled(cv);
  for (std::size_t i = 0; i < sums.size(); ++i) {
    sums[i] -= cv[i];
    halves[i] = 0.5 * sums[i] + cv[i];
    doubled[i] *= 2;
  }
  Tensor plain({m, n}, DType::F32, target.device, stream);
  gemm(on(a), on(b), {}, plain, {}, stream);
  EXPECT_EQ(values(back(plain)), sums) << "no c";
  const Tensor in_place = on(c);
  gemm(on(a), on(b), in_place, in_place, {.alpha = 0.5, .beta = 1.0}, stream);
  EXPECT_EQ(values(back(in_place)), halves) << "alpha = 0.5, d = c";
  Tensor k0({m, n}, DType::F32, target.device, stream), a0({m, 0}, dt), b0({0, n}, dt);
  gemm(on(a0), on(b0), on(c), k0, {.beta = 2.0}, stream);
  EXPECT_EQ(values(back(k0)), doubled) << "k = 0";
  Tensor d0({m, n}, DType::F32, target.device, stream);
  gemm(on(a), on(b), on(c), d0, {.alpha = 0.0, .beta = 2.0}, stream);
  EXPECT_EQ(values(back(d0)), doubled) << "alpha = 0";
  Tensor no_bias({m, n}, DType::F32, target.device, stream), bias32({n}, DType::F32);
  linear(on(a), on(w), {}, no_bias, stream);
  copy(bias, bias32);
  linear(on(a), on(w), on(bias32), out, stream);
  EXPECT_EQ(values(back(out)), lin) << "linear, f32 bias";
  std::vector<double> lin_sums(lin);
  for (std::int64_t i = 0; i < m * n; ++i) lin_sums[i] -= biasv[i % n];
  EXPECT_EQ(values(back(no_bias)), lin_sums) << "linear, no bias";
}

TEST_P(GemmAllTargets, LinearMatchesTorchOnKnownValues) {
  // torch.nn.functional.linear(x, W, b) and its autograd gradients for dy, in float64: short
  // binary fractions again, exact in every dtype.
  const Tensor x = test::from({2, 2, 3}, dt, {1, 2, 3, 0, -1, 0.5, 2, 2, 2, -3, 1, 0}),
               w = test::from({2, 3}, dt, {0.5, -1, 2, 1, 1, 1}),
               b = test::from({2}, dt, {0.25, -2}),
               dy = test::from({2, 2, 2}, dt, {1, -1, 2, 0.5, 0, 1, -1, 3});
  const LinearGrads g = to_host(run_linear(on(x), on(w), on(b), on(dy), stream), stream);
  EXPECT_EQ(values(g.out), (std::vector<double>{4.75, 4, 2.25, -2.5, 3.25, 4, -2.25, -4}));
  EXPECT_EQ(values(g.grad_x),
            (std::vector<double>{-0.5, -2, 1, 1.5, -1.5, 4.5, 1, 1, 1, 2.5, 4, 1}));
  EXPECT_EQ(values(g.grad_weight), (std::vector<double>{4, -1, 4, -8, 2.5, -0.75}));
  EXPECT_EQ(values(g.grad_bias), (std::vector<double>{2, 3.5}));
}

// grad_bias alone calls no cuBLAS: cuda's column-sum kernel on its own, so that racecheck checks
// it (scripts/gpu_check.sh leaves the tests that call cuBLAS out of racecheck).
class LinearGradBias : public GemmCase {};

TEST_P(LinearGradBias, AloneMatchesTheReference) {
  std::uint64_t seed = 70;
  constexpr std::int64_t n = 19;
  for (const Shape& x_shape : {Shape{1, 5}, Shape{3, 37, 24}, Shape{1000, 8}}) {
    SCOPED_TRACE(shape_str(x_shape));
    Shape out_shape = x_shape;
    out_shape.back() = n;
    const Tensor x = randn(x_shape, dt, seed++), w = randn({n, x_shape.back()}, dt, seed++),
                 dy = randn(out_shape, dt, seed++);
    Tensor expected({n}, dt);
    on_reference([&] { linear_backward(dy, x, w, {}, {}, expected); });
    const Tensor got({n}, dt, target.device, stream);
    linear_backward(on(dy), on(x), on(w), {}, {}, got, stream);
    expect_gemm_close(back(got), expected, x.numel() / x.size(-1), "grad_bias");
  }
}

// grad_bias is the exact column sum rounded once to the dtype: within its unit roundoff u of the
// exact sum (the reference on an f64 copy), whatever the row count. Values in [0.5, 1.5) so that
// no cancellation hides the error of the sum; fp32 sums over 20000 rows in row order are ~50 u off.
TEST_P(LinearGradBias, IsTheExactColumnSumRoundedOnce) {
  constexpr std::int64_t rows = 20000, n = 33;
  std::mt19937_64 rng(71);
  std::uniform_real_distribution<double> uniform(0.5, 1.5);
  Tensor wide({rows, n}, DType::F64), dy({rows, n}, dt);
  for (std::int64_t i = 0; i < rows * n; ++i) wide.data_ptr<double>()[i] = uniform(rng);
  copy(wide, dy);
  copy(dy, wide);  // the values dy holds
  const Tensor x = randn({rows, 4}, dt, 72), w = randn({n, 4}, dt, 73);
  Tensor exact({n}, DType::F64), x64({rows, 4}, DType::F64), w64({n, 4}, DType::F64);
  copy(x, x64);
  copy(w, w64);
  on_reference([&] { linear_backward(wide, x64, w64, {}, {}, exact); });
  const Tensor got({n}, dt, target.device, stream);
  linear_backward(on(dy), on(x), on(w), {}, {}, got, stream);
  const double u = dt == DType::F64   ? 1e-13  // the reference's own double sum
                   : dt == DType::F32 ? 0x1p-24
                   : dt == DType::F16 ? 0x1p-11
                                      : 0x1p-8;
  const std::vector<double> g = test::values(back(got)), e = test::values(exact);
  for (std::int64_t j = 0; j < n; ++j) ASSERT_LE(std::abs(g[j] - e[j]), u * std::abs(e[j])) << j;
}

INSTANTIATE_TEST_SUITE_P(, GemmBackends,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);
INSTANTIATE_TEST_SUITE_P(, LinearGradBias,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);
INSTANTIATE_TEST_SUITE_P(, GemmAllTargets, ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);
INSTANTIATE_TEST_SUITE_P(, GemmCpu,
                         ::testing::ValuesIn(test::op_cases({{KernelBackend::CPU, Device{}}})),
                         test::op_case_name);

TEST(Gemm, GemmLargerThanOneScratchBlockMatchesReferenceAndItsViews) {
  // The f32 and 16-bit cpu paths prepare A and B in blocks of max(256, 2^23 / K) rows and columns:
  // with K = 2^15 both 260 x K operands cross a block edge in M and in N. (Random 260 x 1024 tiles
  // repeated along K: cheaper to make than 2^23 random values, and as position-dependent.) A
  // transposed view of A and a row-major B (ld 260, two column blocks) give the same bits.
  const std::int64_t k = 32768, tile = 1024;
  for (const DType dt : {DType::F16, DType::F32}) {
    const Tensor ta = randn({260, tile}, dt, 35), tb = randn({260, tile}, dt, 36);
    Tensor a({260, k}, dt), b({260, k}, dt);
    for (std::int64_t q = 0; q < k; q += tile) {
      copy(ta, a.view().narrow(1, q, tile));
      copy(tb, b.view().narrow(1, q, tile));
    }
    const GemmOptions o{false, true, 1.0, 0.0};
    const Tensor cpu = run_matmul(a, b, {}, o);
    const Tensor ref =
        on_reference([&] { return run_matmul(a.view().narrow(0, 255, 2), b, {}, o); });
    expect_gemm_close(cpu.view().narrow(0, 255, 2), ref, k,
                      fmt::format("{} rows 255 and 256", to_string(dt)));
    const auto av = test::non_contiguous(a), bv = test::non_contiguous(b);
    EXPECT_TRUE(testing::bitwise_equal(run_matmul(av.view, bv.view, {}, o), cpu)) << to_string(dt);
  }
}

// Fused linear cross-entropy's f32 GEMMs sum a K of 1024 or more as two halves (an odd K's last
// product added with them), a tile of at most 2^22 floats of both halves at a time (cpu.cpp). With
// integer-valued operands every partial sum is exact, so each case must give the exact product bit
// for bit: every layout with padded leading dims, C absent, in place, apart or a broadcast row (the
// logits' bias), odd K, and products of several column and row tiles.
TEST(Gemm, FixedLayoutSplitSumsAreExactForEveryLayoutAndTile) {
  enum class C { None, InPlace, Apart, Row };
  struct Case {
    std::int64_t m, n, k;
    bool a_t, b_t;
    C c;
    std::int64_t pad;  // added to every leading dim
  };
  const Case cases[] = {
      {1024, 2049, 1502, false, false, C::InPlace, 0},  // two column tiles, the last 1 wide
      {1024, 2049, 1502, false, true, C::Row, 0},       // the logits: b is W, the bias broadcast
      {9, 1030, 1502, true, false, C::Apart, 3},
      {9, 1030, 1501, true, true, C::None, 5},         // odd K
      {4096, 1100, 1024, true, false, C::InPlace, 0},  // 2 x 2 tiles (grad_weight's layout)
      {1, 1, 1025, false, false, C::None, 0},
  };
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> value(-8, 7);
  for (const Case& t : cases) {
    const auto stored = [&](std::int64_t rows, std::int64_t cols, bool transposed) {
      const std::int64_t ld = (transposed ? rows : cols) + t.pad;
      std::vector<float> v(static_cast<std::size_t>((transposed ? cols : rows) * ld));
      for (float& x : v) x = static_cast<float>(value(gen));
      return std::pair{v, ld};
    };
    const auto [a, lda] = stored(t.m, t.k, t.a_t);
    const auto [b, ldb] = stored(t.k, t.n, t.b_t);
    const auto [c, ldc] = stored(t.c == C::Row ? 1 : t.m, t.n, false);
    const auto [d0, ldd] = stored(t.m, t.n, false);
    std::vector<float> d = t.c == C::InPlace ? c : d0;
    const detail::GemmMatrix am{const_cast<float*>(a.data()), lda, 0, t.a_t},
        bm{const_cast<float*>(b.data()), ldb, 0, t.b_t}, dm{d.data(), ldd, 0, false},
        cm = t.c == C::None      ? detail::GemmMatrix{}
             : t.c == C::InPlace ? dm
                                 : detail::GemmMatrix{const_cast<float*>(c.data()),
                                                      t.c == C::Row ? 0 : ldc, 0, false};
    detail::cpu::gemm_fixed_layout({DType::F32, 1, t.m, t.n, t.k, 1.0, t.c == C::None ? 0.0 : 1.0},
                                   am, bm, cm, dm, Stream{});
    const auto item = [](const std::vector<float>& x, std::int64_t ld, bool tr, std::int64_t r,
                         std::int64_t col) {
      return static_cast<std::int64_t>(
          x[static_cast<std::size_t>(tr ? col * ld + r : r * ld + col)]);
    };
    for (const std::int64_t i : {std::int64_t{0}, t.m / 2, t.m / 2 + 1, t.m - 1}) {
      if (i >= t.m) continue;
      for (std::int64_t j = 0; j < t.n; ++j) {
        std::int64_t exact = t.c == C::None ? 0 : item(c, ldc, false, t.c == C::Row ? 0 : i, j);
        for (std::int64_t p = 0; p < t.k; ++p)
          exact += item(a, lda, t.a_t, i, p) * item(b, ldb, t.b_t, p, j);
        ASSERT_EQ(d[static_cast<std::size_t>(i * ldd + j)], static_cast<float>(exact))
            << "m " << t.m << " n " << t.n << " k " << t.k << " a_t " << t.a_t << " b_t " << t.b_t
            << " c " << static_cast<int>(t.c) << " at " << i << "," << j;
      }
    }
  }
}

// cuBLASLt is opened at run time, not linked (gemm.h): no GPU is needed to open it.
TEST(Gemm, CublasLtIsOpenedAtRunTimeAndNamesItsVersion) {
#ifdef MESHFUSE_WITH_CUDA
  const std::string library = cublaslt_library();
  EXPECT_TRUE(library.starts_with("cuBLASLt ")) << library;
  EXPECT_NE(library.find("libcublasLt"), std::string::npos) << library;
#else
  test::expect_error([] { cublaslt_library(); }, ErrorCode::BackendUnavailable,
                     {"cublaslt_library", "no CUDA support"});
#endif
}

TEST(Gemm, OffsetsPast2To31AreExact) {
  // Row 70000 of a (V = 128256, H) weight read transposed starts at element 8'977'920'000 > 2^31.
  const detail::GemmMatrix w{nullptr, 128256, 0, true};
  EXPECT_EQ(detail::offset(w, 0, 3, 70000), std::int64_t{8'977'920'003});
  const detail::GemmMatrix batched{nullptr, 4096, std::int64_t{1} << 26, false};
  EXPECT_EQ(detail::offset(batched, 64, 1, 2), (std::int64_t{64} << 26) + 4096 + 2);
}

// f64 views whose rows (or, transposed, columns) lie 2^31 + 64 elements apart, in a 32 GiB mapping
// of which a few pages are touched: OpenBLAS takes leading dims as int, and the cpu backend
// refused them as Unsupported; it copies such an operand first, so the result is bitwise the
// contiguous operands'.
TEST(Gemm, F64LeadingDimsPastOpenBlasIntAreCopiedFirst) {
  const std::int64_t ld = (std::int64_t{1} << 31) + 64;
  const std::size_t bytes = static_cast<std::size_t>(2 * ld + 64) * sizeof(double);
  void* region = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) GTEST_SKIP() << "no 32 GiB of address space";
  auto* base = static_cast<double*>(region);
  const TensorView a(base, DType::F64, {2, 8}, {ld, 1});
  const TensorView b(base + 16, DType::F64, {8, 3}, {1, ld});  // a (3, 8) matrix, transposed
  const Tensor a_whole = randn({2, 8}, DType::F64, 80), b_whole = randn({8, 3}, DType::F64, 81);
  copy(a_whole, a);
  copy(b_whole, b);
  for (const GemmOptions& o : {GemmOptions{}, GemmOptions{.alpha = 0.3}}) {
    const Tensor expected = run_matmul(a_whole, b_whole, {}, o);
    const Tensor got({2, 3}, DType::F64);
    gemm(a, b, {}, got, o);
    EXPECT_TRUE(testing::bitwise_equal(got, expected)) << "alpha " << o.alpha;
  }
  ::munmap(region, bytes);
}

TEST(Gemm, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor a = randn({2, 3}, DType::F32, 1), b = randn({4, 5}, DType::F32, 2),
               b3 = randn({3, 5}, DType::F32, 3), d({2, 5}, DType::F32);
  test::expect_error([&] { gemm(a, b, {}, d); }, ErrorCode::ShapeMismatch,
                     {"gemm", "'a'", "[2, 3]", "'b'", "[4, 5]"});
  test::expect_error(
      [&] {
        gemm(a, b3, {}, d, {false, false, 1.0, 0.5});
      },
      ErrorCode::InvalidArgument, {"gemm", "beta", "0.5", "'c'"});
  const Tensor b16 = randn({3, 5}, DType::BF16, 4);
  test::expect_error([&] { gemm(a, b16, {}, d); }, ErrorCode::DTypeMismatch,
                     {"gemm", "'b'", "f32", "bf16"});
  const Tensor c_wrong = randn({5, 2}, DType::F32, 5);
  test::expect_error(
      [&] {
        gemm(a, b3, c_wrong, d, {false, false, 1.0, 1.0});
      },
      ErrorCode::ShapeMismatch, {"gemm", "'c'", "[2, 5]", "[5, 2]"});
  Tensor d_wrong({5, 2}, DType::F32);
  test::expect_error([&] { gemm(a, b3, {}, d_wrong); }, ErrorCode::ShapeMismatch,
                     {"gemm", "'d'", "[2, 5]", "[5, 2]"});
  test::expect_error([&] { gemm(a, b3, {}, d_wrong.view().transpose(0, 1)); },
                     ErrorCode::InvalidArgument, {"gemm", "'d'", "contiguous"});
  // An f32 output takes 16-bit operands only; C has the output's dtype.
  const Tensor a64 = randn({2, 3}, DType::F64, 14), b64 = randn({3, 5}, DType::F64, 15);
  test::expect_error([&] { gemm(a64, b64, {}, d); }, ErrorCode::DTypeMismatch,
                     {"gemm", "'d'", "'a'", "f64", "f32"});
  const Tensor a16 = randn({2, 3}, DType::BF16, 16);
  test::expect_error(
      [&] {
        gemm(a16, b16, randn({2, 5}, DType::BF16, 17), d, {.beta = 1.0});
      },
      ErrorCode::DTypeMismatch, {"gemm", "'c'", "'d'", "f32", "bf16"});
  test::expect_error(
      [&] {
        gemm(a16, b16, {}, Tensor({2, 5}, DType::F16));
      },
      ErrorCode::DTypeMismatch, {"gemm", "'d'", "(bf16) or f32", "f16"});
  test::expect_error(
      [&] {
        bmm(randn({1, 2, 3}, DType::F64, 18), randn({1, 3, 5}, DType::F64, 19), {},
            Tensor({1, 2, 5}, DType::F32));
      },
      ErrorCode::DTypeMismatch, {"bmm", "'d'", "'a' (f64)", "f32"});
  test::expect_error(
      [&] {
        linear(a16, randn({5, 3}, DType::BF16, 20), randn({5}, DType::F16, 21), d);
      },
      ErrorCode::DTypeMismatch, {"linear", "'bias'", "'x' (bf16) or of 'out' (f32)", "f16"});
  test::expect_error(
      [&] {
        linear(a16, randn({5, 3}, DType::BF16, 20), randn({5}, DType::F32, 21),
               Tensor({2, 5}, DType::BF16));
      },
      ErrorCode::DTypeMismatch, {"linear", "'bias'", "'x' (bf16), got f32"});
  const Tensor labels = Tensor::zeros({2, 3}, DType::I64);
  test::expect_error([&] { gemm(labels, b3, {}, d); }, ErrorCode::DTypeMismatch,
                     {"gemm", "'a'", "i64"});
  test::expect_error(
      [&] {
        gemm(randn({2, 3, 1}, DType::F32, 6), b3, {}, d);
      },
      ErrorCode::InvalidArgument, {"gemm", "'a'", "2 dimensions", "[2, 3, 1]"});

  const Tensor a3 = randn({2, 4, 3}, DType::F32, 7), bb = randn({3, 3, 5}, DType::F32, 8);
  Tensor d3({2, 4, 5}, DType::F32);
  test::expect_error([&] { bmm(a3, bb, {}, d3); }, ErrorCode::ShapeMismatch,
                     {"bmm", "batch", "[2, 4, 3]", "[3, 3, 5]"});

  const Tensor x = randn({2, 3, 4}, DType::F32, 9), w = randn({6, 5}, DType::F32, 10);
  Tensor out({2, 3, 6}, DType::F32);
  test::expect_error([&] { linear(x, w, {}, out); }, ErrorCode::ShapeMismatch,
                     {"linear", "'weight'", "[6, 5]", "'x'", "[2, 3, 4]"});
  const Tensor w4 = randn({6, 4}, DType::F32, 11), bias5 = randn({5}, DType::F32, 12);
  test::expect_error([&] { linear(x, w4, bias5, out); }, ErrorCode::ShapeMismatch,
                     {"linear", "'bias'", "[6]", "[5]"});
  const Tensor dy = randn({2, 3, 5}, DType::F32, 13);
  Tensor gx({2, 3, 4}, DType::F32);
  test::expect_error([&] { linear_backward(dy, x, w4, gx, {}, {}); }, ErrorCode::ShapeMismatch,
                     {"linear_backward", "'grad_out'", "[2, 3, 6]", "[2, 3, 5]"});
}

// The reference backend forced on CUDA tensors runs through host copies: bitwise the CPU's.
TEST(CudaGemm, ForcedReferenceOnCudaTensorsGivesTheBitsOfTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{kCuda};
  const auto cuda = [&](const Tensor& t) { return test::on(t, kCuda, stream); };
  const DType dt = DType::BF16;
  const Tensor a = randn({3, 7, 12}, dt, 60), b = randn({3, 12, 5}, dt, 61),
               c = randn({3, 7, 5}, dt, 62);
  const GemmOptions o{false, false, 1.5, 0.5};
  const Tensor ref = on_reference([&] { return run_matmul(a, b, c, o); });
  const Tensor staged =
      on_reference([&] { return run_matmul(cuda(a), cuda(b), cuda(c), o, stream); });
  EXPECT_EQ(staged.device(), kCuda);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged, stream), ref));
  const Tensor x = randn({2, 6, 12}, dt, 63), w = randn({5, 12}, dt, 64), bias = randn({5}, dt, 65),
               dy = randn({2, 6, 5}, dt, 66);
  const LinearGrads rl = on_reference([&] { return run_linear(x, w, bias, dy); });
  const LinearGrads sl =
      on_reference([&] { return run_linear(cuda(x), cuda(w), cuda(bias), cuda(dy), stream); });
  expect_linear_bitwise(to_host(sl, stream), rl, "linear");
}

// A (2, 256) bf16 operand whose second row starts past element 2^31 (a 4 GiB buffer, one row at
// each end): the leading dimension reaches cuBLASLt as 64 bits.
TEST(CudaGemm, RowsPastElementTwoToThe31AreAddressedWith64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{kCuda};
  const std::int64_t k = 256, ld = (std::int64_t{1} << 31) + 64;
  Tensor storage;
  try {
    storage = Tensor({ld + k}, DType::BF16, kCuda, stream);
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  const TensorView a(storage.view().data(), DType::BF16, {2, k}, {ld, 1}, kCuda);
  const Tensor rows = randn({2, k}, DType::BF16, 70), b = randn({k, 48}, DType::BF16, 71);
  copy(rows, a, stream);
  const Tensor ref = on_reference([&] { return run_matmul(rows, b, {}, {}); });
  expect_gemm_close(to_cpu(run_matmul(a, test::on(b, kCuda, stream), {}, {}, stream), stream), ref,
                    k, "rows 2^31 apart");
}

TEST(CudaGemm, TooManyBatchItemsForCublasLtIsAnErrorNamingTheOp) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{kCuda};
  const std::int64_t l = std::int64_t{1} << 31;  // one past cuBLASLt's int32 batch count
  Tensor one, d;
  try {
    one = test::on(test::full({1}, DType::BF16, 1.0), kCuda, stream);
    d = Tensor({l, 1, 1}, DType::BF16, kCuda, stream);
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  const TensorView every(one.view().data(), DType::BF16, {l, 1, 1}, {0, 1, 1}, kCuda);
  test::expect_error([&] { bmm(every, every, {}, d, {}, stream); }, ErrorCode::Unsupported,
                     {"bmm", "cuBLASLt", "batch=2147483648"});
}

#ifdef MESHFUSE_WITH_CUDA
TEST(CudaGemm, EveryGemmOpHasACudaKernelForEveryFloatDtype) {
  for (const char* op : {"gemm", "bmm", "linear", "linear_backward"}) {
    bool found = false;
    for (const KernelInfo& k : registered_kernels())
      found |= k.op == op && k.backend == KernelBackend::CUDA && k.dtypes.size() == 4;
    EXPECT_TRUE(found) << op;
  }
}
#endif

}  // namespace
}  // namespace meshfuse
