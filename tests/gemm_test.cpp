#include <array>
#include <cmath>
#include <limits>

#include "meshfuse/meshfuse.h"
#include "ops/gemm/gemm_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::randn;

template <typename F>
auto on_reference(F&& f) {
  ForceKernelBackend force(KernelBackend::Reference);
  return f();
}

// cpu against the double reference: a sum of k products of O(1) values is O(sqrt(k)), and fp32
// accumulation errors grow with it, so the absolute tolerance scales by sqrt(k).
void expect_gemm_close(const TensorView& actual, const TensorView& expected, std::int64_t k,
                       const std::string& what) {
  const double tol = testing::default_tolerance(expected.dtype());
  const testing::Diff d =
      testing::compare(actual, expected, tol * std::sqrt(std::max<double>(k, 1)), tol);
  EXPECT_EQ(d.violations, 0) << what << ": max abs err " << d.max_abs_err << ", max rel err "
                             << d.max_rel_err << ", non-finite mismatches "
                             << d.mismatched_nonfinite;
}

Tensor values(Shape shape, std::vector<double> v) {
  Tensor t(std::move(shape), DType::F64);
  std::copy(v.begin(), v.end(), t.data_ptr<double>());
  return t;
}

std::vector<double> as_doubles(const TensorView& t) {
  Tensor d(t.shape(), DType::F64);
  copy(t, d);
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

// d = gemm(...) on a fresh output.
Tensor run_gemm(const TensorView& a, const TensorView& b, const TensorView& c,
                const GemmOptions& o) {
  const std::int64_t m = a.size(o.transpose_a ? 1 : 0), n = b.size(o.transpose_b ? 0 : 1);
  Tensor d({m, n}, a.dtype());
  gemm(a, b, c, d, o);
  return d;
}

struct LinearGrads {
  Tensor out, grad_x, grad_weight, grad_bias;
};

LinearGrads run_linear(const TensorView& x, const TensorView& w, const TensorView& bias,
                       const TensorView& dy) {
  Shape out_shape = x.shape();
  out_shape.back() = w.size(0);
  LinearGrads g{
      Tensor(out_shape, x.dtype()), Tensor(x.shape(), x.dtype()), Tensor(w.shape(), x.dtype()), {}};
  if (bias.defined()) g.grad_bias = Tensor({w.size(0)}, x.dtype());
  linear(x, w, bias, g.out);
  linear_backward(dy, x, w, g.grad_x, g.grad_weight, g.grad_bias);
  return g;
}

class GemmTest : public ::testing::TestWithParam<DType> {};

TEST_P(GemmTest, CpuMatchesReferenceForEveryTransposeAtOddSizes) {
  const DType dt = GetParam();
  struct Size {
    std::int64_t m, n, k;
  };
  // 20 x 1504 x 1100: a 16-bit B large enough to be widened with streaming stores, in whole
  // 16-column lines when not transposed and with partial 16 x 16 tiles when transposed.
  for (const Size s :
       {Size{1, 1, 1}, Size{7, 13, 33}, Size{65, 17, 130}, Size{3, 40, 1}, Size{20, 1504, 1100}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        const Tensor a = randn(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, dt, 1);
        const Tensor b = randn(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, dt, 2);
        const Tensor c = randn({s.m, s.n}, dt, 3);
        for (const bool with_c : {false, true}) {
          const GemmOptions o{ta, tb, 1.5, with_c ? -0.5 : 0.0};
          const TensorView cv = with_c ? c.view() : TensorView{};
          const Tensor cpu = run_gemm(a, b, cv, o);
          const Tensor ref = on_reference([&] { return run_gemm(a, b, cv, o); });
          expect_gemm_close(
              cpu, ref, s.k,
              fmt::format("{}x{}x{} ta={} tb={} c={}", s.m, s.n, s.k, ta, tb, with_c));
        }
      }
}

TEST_P(GemmTest, BmmMatchesReferenceWithTransposesAndC) {
  const DType dt = GetParam();
  const std::int64_t l = 3, m = 5, n = 9, k = 17;
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      const Tensor a = randn(ta ? Shape{l, k, m} : Shape{l, m, k}, dt, 4);
      const Tensor b = randn(tb ? Shape{l, n, k} : Shape{l, k, n}, dt, 5);
      const Tensor c = randn({l, m, n}, dt, 6);
      const GemmOptions o{ta, tb, 0.75, 2.0};
      Tensor cpu({l, m, n}, dt), ref({l, m, n}, dt);
      bmm(a, b, c, cpu, o);
      on_reference([&] {
        bmm(a, b, c, ref, o);
        return 0;
      });
      expect_gemm_close(cpu, ref, k, fmt::format("bmm ta={} tb={}", ta, tb));
    }
}

TEST_P(GemmTest, BmmBroadcastsAMatrixWithBatchStrideZero) {
  const DType dt = GetParam();
  const Tensor a = randn({4, 6, 10}, dt, 7), b = randn({10, 3}, dt, 8);
  const TensorView b_batched(b.view().data(), dt, {4, 10, 3}, {0, 3, 1});  // b for every l
  Tensor d({4, 6, 3}, dt);
  bmm(a, b_batched, {}, d);
  for (std::int64_t i = 0; i < 4; ++i) {
    const TensorView ai(a.view().narrow(0, i, 1).data(), dt, {6, 10});
    const Tensor expected = run_gemm(ai, b, {}, {});
    EXPECT_TRUE(
        testing::bitwise_equal(TensorView(d.view().narrow(0, i, 1).data(), dt, {6, 3}), expected))
        << "batch " << i;
  }
}

TEST_P(GemmTest, LinearOverThreeDimensionalInputsMatchesReferenceWithAndWithoutBias) {
  const DType dt = GetParam();
  const std::int64_t k = 20, n = 11;
  const Tensor x = randn({2, 3, k}, dt, 9), w = randn({n, k}, dt, 10), bias = randn({n}, dt, 11),
               dy = randn({2, 3, n}, dt, 12);
  for (const bool with_bias : {false, true}) {
    const TensorView bv = with_bias ? bias.view() : TensorView{};
    const LinearGrads cpu = run_linear(x, w, bv, dy);
    const LinearGrads ref = on_reference([&] { return run_linear(x, w, bv, dy); });
    expect_gemm_close(cpu.out, ref.out, k, "out");
    expect_gemm_close(cpu.grad_x, ref.grad_x, n, "grad_x");
    expect_gemm_close(cpu.grad_weight, ref.grad_weight, 6, "grad_weight");
    if (with_bias) expect_gemm_close(cpu.grad_bias, ref.grad_bias, 6, "grad_bias");
  }
}

TEST_P(GemmTest, LinearOfOneRowAndOfOneDimensionalInput) {
  const DType dt = GetParam();
  const Tensor w = randn({5, 129}, dt, 13), bias = randn({5}, dt, 14);
  for (const Shape& shape : {Shape{1, 129}, Shape{129}}) {
    const Tensor x = randn(shape, dt, 15);
    Shape out_shape = shape;
    out_shape.back() = 5;
    const Tensor dy = randn(out_shape, dt, 16);
    const LinearGrads cpu = run_linear(x, w, bias, dy);
    const LinearGrads ref = on_reference([&] { return run_linear(x, w, bias, dy); });
    expect_gemm_close(cpu.out, ref.out, 129, "out");
    expect_gemm_close(cpu.grad_x, ref.grad_x, 5, "grad_x");
    expect_gemm_close(cpu.grad_weight, ref.grad_weight, 1, "grad_weight");
    expect_gemm_close(cpu.grad_bias, ref.grad_bias, 1, "grad_bias");
  }
}

TEST_P(GemmTest, TransposedAndStridedViewsGiveBitwiseTheContiguousResult) {
  const DType dt = GetParam();
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
        testing::bitwise_equal(run_gemm(at.view, bt.view, ct.view, o), run_gemm(a, b, c, o)))
        << m << " x " << k << " x " << n;
  }
  {  // Rows further apart than their length are read in place (f32) or widened: bitwise too.
    const std::int64_t m = 20, k = 1100, n = 1504;
    const Tensor a = randn({m, k}, dt, 17), b = randn({k, n}, dt, 18);
    Tensor wide_a({m, k + 3}, dt), wide_b({k, n + 5}, dt);
    const TensorView an = wide_a.view().narrow(1, 0, k), bn = wide_b.view().narrow(1, 0, n);
    copy(a, an);
    copy(b, bn);
    EXPECT_TRUE(testing::bitwise_equal(run_gemm(an, bn, {}, {}), run_gemm(a, b, {}, {})));
  }
  const Tensor a = randn({9, 33}, dt, 17), b = randn({33, 21}, dt, 18), c = randn({9, 21}, dt, 19);
  const Tensor expected = run_gemm(a, b, c, o);
  // A view with no unit stride is copied: bitwise the contiguous result.
  Tensor wide({9, 66}, dt);
  const TensorView every_other(wide.view().data(), dt, {9, 33}, {66, 2});
  copy(a, every_other);
  EXPECT_TRUE(testing::bitwise_equal(run_gemm(every_other, b, c, o), expected));
  // linear and its backward on transposed 2-D views of x, weight and grad_out.
  const Tensor x = randn({7, 24}, dt, 20), w = randn({10, 24}, dt, 21), dy = randn({7, 10}, dt, 22);
  const auto xt = test::non_contiguous(x), wt = test::non_contiguous(w),
             dyt = test::non_contiguous(dy);
  const Tensor bias = randn({10}, dt, 23);
  const LinearGrads g = run_linear(x, w, bias, dy),
                    gt = run_linear(xt.view, wt.view, bias, dyt.view);
  EXPECT_TRUE(testing::bitwise_equal(gt.out, g.out));
  EXPECT_TRUE(testing::bitwise_equal(gt.grad_x, g.grad_x));
  EXPECT_TRUE(testing::bitwise_equal(gt.grad_weight, g.grad_weight));
  EXPECT_TRUE(testing::bitwise_equal(gt.grad_bias, g.grad_bias));
}

TEST_P(GemmTest, ZeroSizedDimensionsFollowBlasSemantics) {
  const DType dt = GetParam();
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    // M = 0 and N = 0: empty outputs.
    EXPECT_EQ(run_gemm(Tensor({0, 4}, dt), randn({4, 3}, dt, 1), {}, {}).shape(), (Shape{0, 3}));
    EXPECT_EQ(run_gemm(randn({2, 4}, dt, 2), Tensor({4, 0}, dt), {}, {}).shape(), (Shape{2, 0}));
    // K = 0: the product is empty, so D = beta * C (zeros without C).
    const Tensor c = randn({2, 3}, dt, 3);
    const Tensor d = run_gemm(Tensor({2, 0}, dt), Tensor({0, 3}, dt), c, {false, false, 1.0, 2.0});
    const std::vector<double> cv = as_doubles(c), dv = as_doubles(d);
    for (std::size_t i = 0; i < cv.size(); ++i) EXPECT_EQ(dv[i], 2.0 * cv[i]);
    for (double v : as_doubles(run_gemm(Tensor({2, 0}, dt), Tensor({0, 3}, dt), {}, {})))
      EXPECT_EQ(v, 0.0);
    // linear over zero rows: empty out and grad_x, zero grad_weight and grad_bias.
    const Tensor x({0, 4}, dt), w = randn({3, 4}, dt, 4), dy({0, 3}, dt);
    const LinearGrads g = run_linear(x, w, randn({3}, dt, 5), dy);
    EXPECT_EQ(g.out.shape(), (Shape{0, 3}));
    for (double v : as_doubles(g.grad_weight)) EXPECT_EQ(v, 0.0);
    for (double v : as_doubles(g.grad_bias)) EXPECT_EQ(v, 0.0);
  }
}

TEST_P(GemmTest, NanAndInfPropagateLikeTheReference) {
  const DType dt = GetParam();
  Tensor a = randn({4, 8}, dt, 23), b = randn({8, 5}, dt, 24);
  const Tensor nan = test::full({1, 1}, dt, std::numeric_limits<double>::quiet_NaN()),
               inf = test::full({1, 1}, dt, std::numeric_limits<double>::infinity());
  copy(nan, a.view().narrow(0, 0, 1).narrow(1, 3, 1));  // row 0 of D is NaN
  copy(inf, a.view().narrow(0, 2, 1).narrow(1, 0, 1));  // row 2 of D is +-inf
  const Tensor cpu = run_gemm(a, b, {}, {});
  const Tensor ref = on_reference([&] { return run_gemm(a, b, {}, {}); });
  expect_gemm_close(cpu, ref, 8, "non-finite");
  const std::vector<double> d = as_doubles(cpu);
  for (int j = 0; j < 5; ++j) {
    EXPECT_TRUE(std::isnan(d[j])) << j;
    EXPECT_TRUE(std::isinf(d[2 * 5 + j])) << j;
    EXPECT_TRUE(std::isfinite(d[1 * 5 + j])) << j;
  }
}

TEST_P(GemmTest, ZeroAlphaAndZeroBetaDoNotReadTheirOperands) {
  // As in BLAS and torch.addmm: NaN in A and B is ignored when alpha = 0, NaN in C when beta = 0.
  const DType dt = GetParam();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor nans = test::full({3, 3}, dt, nan), ones = test::full({3, 3}, dt, 1.0);
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (double v : as_doubles(run_gemm(nans, nans, ones, {false, false, 0.0, 3.0})))
      EXPECT_EQ(v, 3.0);
    for (double v : as_doubles(run_gemm(ones, ones, nans, {false, false, 2.0, 0.0})))
      EXPECT_EQ(v, 6.0);
  }
}

TEST_P(GemmTest, InPlaceDEqualsCAccumulates) {
  const DType dt = GetParam();
  const Tensor a = randn({6, 12}, dt, 25), b = randn({12, 7}, dt, 26), c = randn({6, 7}, dt, 27);
  const GemmOptions o{false, false, 1.0, 1.0};
  const Tensor expected = run_gemm(a, b, c, o);
  const Tensor d = c.clone();
  gemm(a, b, d, d, o);
  EXPECT_TRUE(testing::bitwise_equal(d, expected));
}

TEST_P(GemmTest, DeterministicRunToRun) {
  const DType dt = GetParam();
  const Tensor a = randn({70, 300}, dt, 28), bt = randn({90, 300}, dt, 29),
               c = randn({70, 90}, dt, 30);
  const GemmOptions o{false, true, 0.5, 0.25};
  EXPECT_TRUE(testing::bitwise_equal(run_gemm(a, bt, c, o), run_gemm(a, bt, c, o)));
  const Tensor x = randn({4, 50, 64}, dt, 31), w = randn({40, 64}, dt, 32),
               bias = randn({40}, dt, 33), dy = randn({4, 50, 40}, dt, 34);
  const LinearGrads g1 = run_linear(x, w, bias, dy), g2 = run_linear(x, w, bias, dy);
  EXPECT_TRUE(testing::bitwise_equal(g1.out, g2.out));
  EXPECT_TRUE(testing::bitwise_equal(g1.grad_x, g2.grad_x));
  EXPECT_TRUE(testing::bitwise_equal(g1.grad_weight, g2.grad_weight));
  EXPECT_TRUE(testing::bitwise_equal(g1.grad_bias, g2.grad_bias));
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, GemmTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

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
    const Tensor cpu = run_gemm(a, b, {}, o);
    const Tensor ref = on_reference([&] { return run_gemm(a.view().narrow(0, 255, 2), b, {}, o); });
    expect_gemm_close(cpu.view().narrow(0, 255, 2), ref, k,
                      fmt::format("{} rows 255 and 256", to_string(dt)));
    const auto av = test::non_contiguous(a), bv = test::non_contiguous(b);
    EXPECT_TRUE(testing::bitwise_equal(run_gemm(av.view, bv.view, {}, o), cpu)) << to_string(dt);
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

TEST(Gemm, MatchesTorchAddmmOnKnownValues) {
  // torch.addmm(C, A, B, beta=0.5, alpha=2.0) in float64.
  const Tensor a = values({2, 3}, {1, 2, 3, 4, 5, 6}),
               b = values({3, 2}, {1, 0.5, -1, 2, 0.25, -3}), c = values({2, 2}, {1, -1, 2, 0.5});
  const std::vector<double> expected = {0.0, -9.5, 2.0, -11.75};
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    EXPECT_EQ(as_doubles(run_gemm(a, b, c, {false, false, 2.0, 0.5})), expected);
    // The same through transpose flags: A^T^T and B^T^T.
    const Tensor at = values({3, 2}, {1, 4, 2, 5, 3, 6}),
                 bt = values({2, 3}, {1, -1, 0.25, 0.5, 2, -3});
    EXPECT_EQ(as_doubles(run_gemm(at, bt, c, {true, true, 2.0, 0.5})), expected);
  }
}

TEST(Gemm, LinearMatchesTorchOnKnownValues) {
  // torch.nn.functional.linear(x, W, b) and its autograd gradients for dy, in float64.
  const Tensor x = values({2, 2, 3}, {1, 2, 3, 0, -1, 0.5, 2, 2, 2, -3, 1, 0}),
               w = values({2, 3}, {0.5, -1, 2, 1, 1, 1}), b = values({2}, {0.25, -2}),
               dy = values({2, 2, 2}, {1, -1, 2, 0.5, 0, 1, -1, 3});
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    const LinearGrads g = run_linear(x, w, b, dy);
    EXPECT_EQ(as_doubles(g.out), (std::vector<double>{4.75, 4, 2.25, -2.5, 3.25, 4, -2.25, -4}));
    EXPECT_EQ(as_doubles(g.grad_x),
              (std::vector<double>{-0.5, -2, 1, 1.5, -1.5, 4.5, 1, 1, 1, 2.5, 4, 1}));
    EXPECT_EQ(as_doubles(g.grad_weight), (std::vector<double>{4, -1, 4, -8, 2.5, -0.75}));
    EXPECT_EQ(as_doubles(g.grad_bias), (std::vector<double>{2, 3.5}));
  }
}

TEST(Gemm, LinearBackwardComputesOnlyTheRequestedGradients) {
  const Tensor x = randn({5, 8}, DType::F32, 37), w = randn({6, 8}, DType::F32, 38),
               dy = randn({5, 6}, DType::F32, 39);
  const LinearGrads all = run_linear(x, w, randn({6}, DType::F32, 40), dy);
  Tensor grad_weight({6, 8}, DType::F32);
  linear_backward(dy, x, w, {}, grad_weight, {});
  EXPECT_TRUE(testing::bitwise_equal(grad_weight, all.grad_weight));
}

TEST(Gemm, OffsetsPast2To31AreExact) {
  // Row 70000 of a (V = 128256, H) weight read transposed starts at element 8'977'920'000 > 2^31.
  const detail::GemmMatrix w{nullptr, 128256, 0, true};
  EXPECT_EQ(detail::offset(w, 0, 3, 70000), std::int64_t{8'977'920'003});
  const detail::GemmMatrix batched{nullptr, 4096, std::int64_t{1} << 26, false};
  EXPECT_EQ(detail::offset(batched, 64, 1, 2), (std::int64_t{64} << 26) + 4096 + 2);
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

}  // namespace
}  // namespace meshfuse
