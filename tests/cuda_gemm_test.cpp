// gemm, bmm, linear and linear_backward on CUDA tensors (cuBLASLt) against the reference backend
// on the CPU. Skipped without a GPU (the registration test runs in every CUDA build).
#include <cmath>
#include <limits>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::randn;
using test::to_cpu;
using test::to_cuda;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

template <typename F>
auto on_reference(F&& f) {
  ForceKernelBackend force(KernelBackend::Reference);
  return f();
}

Tensor on(const Tensor& t, Device device) { return t.defined() ? t.to(device) : Tensor{}; }

// fp32 (f64) accumulation against the double reference: a sum of k products of O(1) values is
// O(sqrt(k)), and so are the accumulation errors; the absolute tolerance scales by sqrt(k).
void expect_gemm_close(const TensorView& actual, const TensorView& expected, std::int64_t k,
                       const std::string& what) {
  const double tol = testing::default_tolerance(expected.dtype());
  const testing::Diff d =
      testing::compare(to_cpu(actual), expected, tol * std::sqrt(std::max<double>(k, 1)), tol);
  EXPECT_EQ(d.violations, 0) << what << ": max abs err " << d.max_abs_err << ", max rel err "
                             << d.max_rel_err << ", non-finite mismatches "
                             << d.mismatched_nonfinite;
}

std::vector<double> as_doubles(const TensorView& t) {
  Tensor d(t.shape(), DType::F64);
  copy(t, d);
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
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

// run_matmul on CUDA copies of the CPU inputs against the reference on the inputs.
void expect_matmul_matches_reference(const Tensor& a, const Tensor& b, const Tensor& c,
                                     const GemmOptions& o, const std::string& what) {
  const Tensor ref = on_reference([&] { return run_matmul(a, b, c, o); });
  const Tensor gpu = run_matmul(to_cuda(a), to_cuda(b), on(c, kCuda), o);
  EXPECT_EQ(gpu.device(), kCuda);
  expect_gemm_close(gpu, ref, a.size(o.transpose_a ? -2 : -1), what);
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

void expect_linear_matches_reference(const Tensor& x, const Tensor& w, const Tensor& bias,
                                     const Tensor& dy) {
  const LinearGrads ref = on_reference([&] { return run_linear(x, w, bias, dy); });
  const LinearGrads gpu = run_linear(to_cuda(x), to_cuda(w), on(bias, kCuda), to_cuda(dy));
  const std::int64_t rows = x.numel() / x.size(-1);
  expect_gemm_close(gpu.out, ref.out, x.size(-1), "out");
  expect_gemm_close(gpu.grad_x, ref.grad_x, w.size(0), "grad_x");
  expect_gemm_close(gpu.grad_weight, ref.grad_weight, rows, "grad_weight");
  if (bias.defined()) expect_gemm_close(gpu.grad_bias, ref.grad_bias, rows, "grad_bias");
}

class CudaGemmTest : public ::testing::TestWithParam<DType> {};

// At 256 x 384 x 520 the f32 tolerance (about 6e-4 on values near 34) also tells full fp32 from
// TF32, whose 10-bit inputs would be off by about 3e-2.
TEST_P(CudaGemmTest, EveryTransposeWithAndWithoutCMatchesTheReferenceAtOddAndMediumSizes) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  struct Size {
    std::int64_t m, n, k;
  };
  for (const Size s :
       {Size{1, 1, 1}, Size{7, 13, 33}, Size{65, 17, 130}, Size{3, 40, 1}, Size{256, 384, 520}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        const Tensor a = randn(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, dt, 1);
        const Tensor b = randn(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, dt, 2);
        const Tensor c = randn({s.m, s.n}, dt, 3);
        for (const bool with_c : {false, true})
          expect_matmul_matches_reference(
              a, b, with_c ? c : Tensor{}, {ta, tb, 1.5, with_c ? -0.5 : 0.0},
              ::testing::PrintToString(std::vector<std::int64_t>{s.m, s.n, s.k}) +
                  " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                  " c=" + std::to_string(with_c));
      }
}

TEST_P(CudaGemmTest, CInEveryLayoutMatchesTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  const std::int64_t m = 19, n = 24, k = 40;
  const Tensor a = randn({m, k}, dt, 4), b = randn({k, n}, dt, 5), c = randn({m, n}, dt, 6);
  const GemmOptions o{false, false, 0.5, 2.0};
  const Tensor ref = on_reference([&] { return run_matmul(a, b, c, o); });
  const Tensor ga = to_cuda(a), gb = to_cuda(b);
  // A wider leading dimension (its own cuBLASLt layout).
  const Tensor wide = to_cuda(randn({m, n + 5}, dt, 7));
  copy(to_cuda(c), wide.view().narrow(1, 2, n));
  expect_gemm_close(run_matmul(ga, gb, wide.view().narrow(1, 2, n), o), ref, k, "wide ld");
  // Transposed storage (copied into D first).
  const Tensor ct = to_cuda(Tensor::copy_of(c.view().transpose(0, 1)));
  expect_gemm_close(run_matmul(ga, gb, ct.view().transpose(0, 1), o), ref, k, "transposed");
  // In place: D is C.
  const Tensor d = to_cuda(c);
  gemm(ga, gb, d, d, o);
  expect_gemm_close(d, ref, k, "in place");
  // bmm with one C for every batch item (batch stride 0).
  const Tensor a3 = randn({3, m, k}, dt, 8), b3 = randn({3, k, n}, dt, 9);
  const TensorView c_all(c.view().data(), dt, {3, m, n}, {0, n, 1});
  const Tensor gc = to_cuda(c);
  const TensorView gc_all(gc.view().data(), dt, {3, m, n}, {0, n, 1}, kCuda);
  const Tensor ref3 = on_reference([&] { return run_matmul(a3, b3, c_all, o); });
  expect_gemm_close(run_matmul(to_cuda(a3), to_cuda(b3), gc_all, o), ref3, k, "bmm broadcast C");
}

TEST_P(CudaGemmTest, BmmMatchesTheReferenceWithTransposesAndC) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  const std::int64_t l = 3, m = 5, n = 9, k = 17;
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      const Tensor a = randn(ta ? Shape{l, k, m} : Shape{l, m, k}, dt, 10);
      const Tensor b = randn(tb ? Shape{l, n, k} : Shape{l, k, n}, dt, 11);
      expect_matmul_matches_reference(a, b, randn({l, m, n}, dt, 12), {ta, tb, 0.75, 2.0},
                                      "bmm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
  expect_matmul_matches_reference(randn({4, 64, 136}, dt, 13), randn({4, 72, 136}, dt, 14), {},
                                  {false, true, 1.0, 0.0}, "bmm 4 x 64 x 72 x 136");
}

TEST_P(CudaGemmTest, BmmBroadcastsAOrBWithBatchStrideZero) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  const Tensor a = randn({4, 6, 10}, dt, 15), b = randn({10, 3}, dt, 16);
  const Tensor a1 = randn({6, 10}, dt, 17), b3 = randn({4, 10, 3}, dt, 18);
  const Tensor ga = to_cuda(a), gb = to_cuda(b), ga1 = to_cuda(a1), gb3 = to_cuda(b3);
  const auto every = [&](const TensorView& t, std::int64_t l, Device dev) {
    return TensorView(t.data(), dt, {l, t.size(0), t.size(1)}, {0, t.size(1), 1}, dev);
  };
  // B shared by every batch item.
  const Tensor ref_b = on_reference([&] { return run_matmul(a, every(b, 4, {}), {}, {}); });
  expect_gemm_close(run_matmul(ga, every(gb, 4, kCuda), {}, {}), ref_b, 10, "broadcast b");
  // A shared, B transposed.
  const GemmOptions tb{false, true, 1.0, 0.0};
  const Tensor bt = Tensor::copy_of(b3.view().transpose(1, 2));
  const Tensor ref_a = on_reference([&] { return run_matmul(every(a1, 4, {}), bt, {}, tb); });
  expect_gemm_close(run_matmul(every(ga1, 4, kCuda), to_cuda(bt), {}, tb), ref_a, 10,
                    "broadcast a");
}

TEST_P(CudaGemmTest, LinearAndEveryGradientMatchTheReferenceWithAndWithoutBias) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  struct Case {
    Shape x;
    std::int64_t n;
  };
  std::uint64_t seed = 20;
  for (const Case& c :
       {Case{{2, 3, 20}, 11}, Case{{4, 33, 136}, 72}, Case{{129}, 5}, Case{{1, 129}, 5}})
    for (const bool with_bias : {false, true}) {
      SCOPED_TRACE(shape_str(c.x) + " n=" + std::to_string(c.n) +
                   " bias=" + std::to_string(with_bias));
      Shape out_shape = c.x;
      out_shape.back() = c.n;
      const Tensor x = randn(c.x, dt, seed++), w = randn({c.n, c.x.back()}, dt, seed++),
                   dy = randn(out_shape, dt, seed++);
      expect_linear_matches_reference(x, w, with_bias ? randn({c.n}, dt, seed++) : Tensor{}, dy);
    }
}

TEST_P(CudaGemmTest, MisalignedAndTransposedViewsMatchTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  // Operands one element into wider rows: odd leading dimensions and 2- or 4-byte aligned
  // pointers, which the heuristic must be told about.
  const std::int64_t m = 33, n = 17, k = 65;
  const Tensor a = randn({m, k + 1}, dt, 30), b = randn({k, n + 1}, dt, 31),
               c = randn({m, n + 1}, dt, 32);
  const GemmOptions o{false, false, 1.0, 1.0};
  const auto inner = [](const TensorView& t) { return t.narrow(1, 1, t.size(1) - 1); };
  const Tensor ref = on_reference([&] { return run_matmul(inner(a), inner(b), inner(c), o); });
  const Tensor ga = to_cuda(a), gb = to_cuda(b), gc = to_cuda(c);
  expect_gemm_close(run_matmul(inner(ga), inner(gb), inner(gc), o), ref, k, "misaligned");
  // linear with a misaligned bias (the epilogue's bias pointer), and transposed x, weight and
  // grad_out: the transposed grad_out gives the bits of grad_bias, whose order is fixed.
  const Tensor x = randn({40, 24}, dt, 33), w = randn({10, 24}, dt, 34),
               dy = randn({40, 10}, dt, 35), bias = randn({11}, dt, 36);
  const LinearGrads ref_l =
      on_reference([&] { return run_linear(x, w, bias.view().narrow(0, 1, 10), dy); });
  const auto transposed = [](const Tensor& t) {
    return to_cuda(Tensor::copy_of(t.view().transpose(0, 1)));
  };
  const Tensor xt = transposed(x), wt = transposed(w), dyt = transposed(dy), gbias = to_cuda(bias);
  const LinearGrads g = run_linear(xt.view().transpose(0, 1), wt.view().transpose(0, 1),
                                   gbias.view().narrow(0, 1, 10), dyt.view().transpose(0, 1));
  expect_gemm_close(g.out, ref_l.out, 24, "out");
  expect_gemm_close(g.grad_x, ref_l.grad_x, 10, "grad_x");
  expect_gemm_close(g.grad_weight, ref_l.grad_weight, 40, "grad_weight");
  expect_gemm_close(g.grad_bias, ref_l.grad_bias, 40, "grad_bias");
  const LinearGrads contiguous =
      run_linear(to_cuda(x), to_cuda(w), gbias.view().narrow(0, 1, 10), to_cuda(dy));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(g.grad_bias), to_cpu(contiguous.grad_bias)));
}

TEST_P(CudaGemmTest, ZeroSizedDimensionsFollowBlasSemantics) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  const auto cuda_empty = [&](Shape s) { return Tensor(std::move(s), dt, kCuda); };
  // M = 0, N = 0 and batch = 0: empty outputs.
  EXPECT_EQ(run_matmul(cuda_empty({0, 4}), to_cuda(randn({4, 3}, dt, 1)), {}, {}).shape(),
            (Shape{0, 3}));
  EXPECT_EQ(run_matmul(to_cuda(randn({2, 4}, dt, 2)), cuda_empty({4, 0}), {}, {}).shape(),
            (Shape{2, 0}));
  EXPECT_EQ(run_matmul(cuda_empty({0, 2, 4}), cuda_empty({0, 4, 3}), {}, {}).shape(),
            (Shape{0, 2, 3}));
  // K = 0: D = beta * C, or zeros without C, into an output holding NaN.
  const Tensor c = randn({2, 3}, dt, 3);
  Tensor d = to_cuda(test::full({2, 3}, dt, kNan));
  gemm(cuda_empty({2, 0}), cuda_empty({0, 3}), to_cuda(c), d, {false, false, 1.0, 2.0});
  const std::vector<double> cv = as_doubles(c), dv = as_doubles(to_cpu(d));
  for (std::size_t i = 0; i < cv.size(); ++i) EXPECT_EQ(dv[i], 2.0 * cv[i]);
  gemm(cuda_empty({2, 0}), cuda_empty({0, 3}), {}, d);
  for (double v : as_doubles(to_cpu(d))) EXPECT_EQ(v, 0.0);
  // linear over zero rows: empty out and grad_x, zero grad_weight and grad_bias.
  const LinearGrads g = run_linear(cuda_empty({0, 4}), to_cuda(randn({3, 4}, dt, 4)),
                                   to_cuda(randn({3}, dt, 5)), cuda_empty({0, 3}));
  EXPECT_EQ(g.out.shape(), (Shape{0, 3}));
  for (double v : as_doubles(to_cpu(g.grad_weight))) EXPECT_EQ(v, 0.0);
  for (double v : as_doubles(to_cpu(g.grad_bias))) EXPECT_EQ(v, 0.0);
}

TEST_P(CudaGemmTest, ZeroAlphaAndZeroBetaDoNotReadTheirOperands) {
  // As in BLAS and torch.addmm: NaN in A and B is ignored when alpha = 0, NaN in C when beta = 0,
  // and an output holding NaN is overwritten (cuBLASLt gets D as C with beta = 0).
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  const Tensor nans = to_cuda(test::full({3, 3}, dt, kNan)),
               ones = to_cuda(test::full({3, 3}, dt, 1.0));
  for (double v : as_doubles(to_cpu(run_matmul(nans, nans, ones, {false, false, 0.0, 3.0}))))
    EXPECT_EQ(v, 3.0);
  for (double v : as_doubles(to_cpu(run_matmul(ones, ones, nans, {false, false, 2.0, 0.0}))))
    EXPECT_EQ(v, 6.0);
  Tensor d = to_cuda(test::full({3, 3}, dt, kNan));
  gemm(ones, ones, {}, d);
  for (double v : as_doubles(to_cpu(d))) EXPECT_EQ(v, 3.0);
}

TEST_P(CudaGemmTest, NanAndInfPropagateLikeTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = GetParam();
  Tensor a = randn({4, 8}, dt, 40);
  const Tensor b = randn({8, 5}, dt, 41);
  testing::fill(a.view().narrow(0, 0, 1).narrow(1, 3, 1), kNan);  // row 0 of D is NaN
  testing::fill(a.view().narrow(0, 2, 1).narrow(1, 0, 1),
                std::numeric_limits<double>::infinity());  // row 2 of D is +-inf
  expect_matmul_matches_reference(a, b, {}, {}, "non-finite");
  const std::vector<double> d = as_doubles(to_cpu(run_matmul(to_cuda(a), to_cuda(b), {}, {})));
  for (int j = 0; j < 5; ++j) {
    EXPECT_TRUE(std::isnan(d[j])) << j;
    EXPECT_TRUE(std::isinf(d[2 * 5 + j])) << j;
    EXPECT_TRUE(std::isfinite(d[1 * 5 + j])) << j;
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaGemmTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

// grad_bias alone calls no cuBLAS: the column-sum kernel on its own, so that racecheck checks it
// (scripts/gpu_check.sh leaves the tests that call cuBLAS out of racecheck).
TEST(CudaLinearGradBias, AloneMatchesTheReferenceForEveryFloatDtype) {
  MESHFUSE_REQUIRE_CUDA();
  std::uint64_t seed = 70;
  constexpr std::int64_t n = 19;
  for (const DType dt : test::kFloatDTypes)
    for (const Shape& x_shape : {Shape{1, 5}, Shape{3, 37, 24}, Shape{1000, 8}}) {
      SCOPED_TRACE(std::string(to_string(dt)) + " " + shape_str(x_shape));
      Shape out_shape = x_shape;
      out_shape.back() = n;
      const Tensor x = randn(x_shape, dt, seed++), w = randn({n, x_shape.back()}, dt, seed++),
                   dy = randn(out_shape, dt, seed++);
      Tensor expected({n}, dt), got({n}, dt, kCuda);
      on_reference([&] { linear_backward(dy, x, w, {}, {}, expected); });
      linear_backward(to_cuda(dy), to_cuda(x), to_cuda(w), {}, {}, got);
      expect_gemm_close(got, expected, x.numel() / x.size(-1), "grad_bias");
    }
}

TEST(CudaGemm, DeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const auto twice_equal = [&](const TensorView& a, const TensorView& b, const GemmOptions& o) {
    return testing::bitwise_equal(to_cpu(run_matmul(a, b, {}, o, stream), stream),
                                  to_cpu(run_matmul(a, b, {}, o, stream), stream));
  };
  // Small M and N with a long K: the shape where split-K algorithms are chosen.
  const Tensor a = randn({64, 32768}, DType::BF16, 50), b = randn({64, 32768}, DType::BF16, 51);
  const Tensor ga = to_cuda(a, stream), gb = to_cuda(b, stream);
  const GemmOptions tb{false, true, 1.0, 0.0};
  EXPECT_TRUE(twice_equal(ga, gb, tb));
  expect_gemm_close(run_matmul(ga, gb, {}, tb, stream),
                    on_reference([&] { return run_matmul(a, b, {}, tb); }), 32768, "long K");
  const Tensor big = to_cuda(randn({1024, 1024}, DType::BF16, 52), stream);
  EXPECT_TRUE(twice_equal(big, big, {}));
  // linear forward and backward with a bias.
  const Tensor x = to_cuda(randn({4, 256, 512}, DType::BF16, 53), stream),
               w = to_cuda(randn({384, 512}, DType::BF16, 54), stream),
               bias = to_cuda(randn({384}, DType::BF16, 55), stream),
               dy = to_cuda(randn({4, 256, 384}, DType::BF16, 56), stream);
  const LinearGrads g1 = run_linear(x, w, bias, dy, stream),
                    g2 = run_linear(x, w, bias, dy, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(g1.out, stream), to_cpu(g2.out, stream)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(g1.grad_x, stream), to_cpu(g2.grad_x, stream)));
  EXPECT_TRUE(
      testing::bitwise_equal(to_cpu(g1.grad_weight, stream), to_cpu(g2.grad_weight, stream)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(g1.grad_bias, stream), to_cpu(g2.grad_bias, stream)));
}

TEST(CudaGemm, ForcedReferenceOnCudaTensorsGivesTheBitsOfTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  const DType dt = DType::BF16;
  const Tensor a = randn({3, 7, 12}, dt, 60), b = randn({3, 12, 5}, dt, 61),
               c = randn({3, 7, 5}, dt, 62);
  const GemmOptions o{false, false, 1.5, 0.5};
  const Tensor ref = on_reference([&] { return run_matmul(a, b, c, o); });
  const Tensor staged =
      on_reference([&] { return run_matmul(to_cuda(a), to_cuda(b), to_cuda(c), o); });
  EXPECT_EQ(staged.device(), kCuda);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged), ref));
  const Tensor x = randn({2, 6, 12}, dt, 63), w = randn({5, 12}, dt, 64), bias = randn({5}, dt, 65),
               dy = randn({2, 6, 5}, dt, 66);
  const LinearGrads rl = on_reference([&] { return run_linear(x, w, bias, dy); });
  const LinearGrads sl =
      on_reference([&] { return run_linear(to_cuda(x), to_cuda(w), to_cuda(bias), to_cuda(dy)); });
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sl.out), rl.out));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sl.grad_x), rl.grad_x));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sl.grad_weight), rl.grad_weight));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sl.grad_bias), rl.grad_bias));
}

// A (2, 256) bf16 operand whose second row starts past element 2^31 (a 4 GiB buffer, one row at
// each end): the leading dimension reaches cuBLASLt as 64 bits.
TEST(CudaGemm, RowsPastElementTwoToThe31AreAddressedWith64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const std::int64_t k = 256, ld = (std::int64_t{1} << 31) + 64;
  Tensor storage;
  try {
    storage = Tensor({ld + k}, DType::BF16, kCuda);
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  const TensorView a(storage.view().data(), DType::BF16, {2, k}, {ld, 1}, kCuda);
  const Tensor rows = randn({2, k}, DType::BF16, 70), b = randn({k, 48}, DType::BF16, 71);
  copy(rows, a);
  const Tensor ref = on_reference([&] { return run_matmul(rows, b, {}, {}); });
  expect_gemm_close(run_matmul(a, to_cuda(b), {}, {}), ref, k, "rows 2^31 apart");
}

TEST(CudaGemm, TooManyBatchItemsForCublasLtIsAnErrorNamingTheOp) {
  MESHFUSE_REQUIRE_CUDA();
  const std::int64_t l = std::int64_t{1} << 31;  // one past cuBLASLt's int32 batch count
  Tensor one, d;
  try {
    one = to_cuda(test::full({1}, DType::BF16, 1.0));
    d = Tensor({l, 1, 1}, DType::BF16, kCuda);
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  const TensorView every(one.view().data(), DType::BF16, {l, 1, 1}, {0, 1, 1}, kCuda);
  test::expect_error([&] { bmm(every, every, {}, d); }, ErrorCode::Unsupported,
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
