#include <cmath>
#include <limits>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::randn;

// One call's inputs; undefined tensors are absent optional arguments.
struct Inputs {
  Tensor x, residual, weight, grad_y, grad_r;
  double multiplier = 1.0;
  double eps = 1e-5;
};

struct Flags {
  bool weight = false, residual = false, grad_r = false;
  double multiplier = 1.0;
};

Inputs make_inputs(const Shape& shape, DType dtype, Flags f, std::uint64_t seed) {
  Inputs in;
  in.x = randn(shape, dtype, seed);
  in.grad_y = randn(shape, dtype, seed + 1);
  if (f.residual) in.residual = randn(shape, dtype, seed + 2);
  if (f.weight) in.weight = randn({shape.back()}, dtype, seed + 3);
  if (f.grad_r) in.grad_r = randn(shape, dtype, seed + 4);
  in.multiplier = f.multiplier;
  return in;
}

// rmsnorm when there is no residual and no multiplier, else the fused op.
bool plain(const Inputs& in) { return !in.residual.defined() && in.multiplier == 1.0; }

struct Forward {
  Tensor y, r, rstd;
};
struct Backward {
  Tensor dx, dresidual, dweight;
};

Forward forward(const Inputs& in) {
  const TensorView& x = in.x;
  Forward f{Tensor(x.shape(), x.dtype()), {}, Tensor({x.numel() / x.size(-1)}, DType::F32)};
  if (in.residual.defined()) f.r = Tensor(x.shape(), x.dtype());
  if (plain(in))
    rmsnorm(in.x, in.weight, f.y, f.rstd, in.eps);
  else
    fused_residual_add_rmsnorm(in.x, in.residual, in.weight, f.y, f.r, f.rstd, in.eps,
                               in.multiplier);
  return f;
}

// The backward from saved forward outputs (r, rstd), so that backends can be compared on the same
// saved tensors.
Backward backward(const Inputs& in, const Forward& saved) {
  const TensorView& x = in.x;
  Backward b{Tensor(x.shape(), x.dtype()), {}, {}};
  if (in.residual.defined()) b.dresidual = Tensor(x.shape(), x.dtype());
  if (in.weight.defined()) b.dweight = Tensor({x.size(-1)}, x.dtype());
  if (plain(in))
    rmsnorm_backward(in.grad_y, in.x, in.weight, saved.rstd, b.dx, b.dweight);
  else
    fused_residual_add_rmsnorm_backward(in.grad_y, in.grad_r,
                                        in.residual.defined() ? saved.r : in.x, in.weight,
                                        saved.rstd, b.dx, b.dresidual, b.dweight, in.multiplier);
  return b;
}

template <typename F>
auto on_reference(F&& f) {
  ForceKernelBackend force(KernelBackend::Reference);
  return f();
}

void expect_matches_reference(const Inputs& in) {
  const Forward cpu = forward(in), ref = on_reference([&] { return forward(in); });
  expect_close(cpu.y, ref.y, "y");
  expect_close(cpu.rstd, ref.rstd, "rstd");
  if (in.residual.defined()) expect_close(cpu.r, ref.r, "r");
  const Backward cb = backward(in, ref), rb = on_reference([&] { return backward(in, ref); });
  expect_close(cb.dx, rb.dx, "dx");
  if (in.residual.defined()) expect_close(cb.dresidual, rb.dresidual, "dresidual");
  // dweight sums over rows in fp32: allow for that on top of the dtype's rounding.
  if (in.weight.defined())
    expect_close(cb.dweight, rb.dweight, std::max(testing::default_tolerance(in.x.dtype()), 1e-4),
                 "dweight");
}

class RmsNormTest : public ::testing::TestWithParam<DType> {};

TEST_P(RmsNormTest, CpuMatchesReferenceForEveryCombinationOfOptionalArguments) {
  const Flags cases[] = {{},
                         {.weight = true},
                         {.multiplier = 0.5},
                         {.weight = true, .residual = true},
                         {.residual = true, .grad_r = true},
                         {.weight = true, .residual = true, .grad_r = true, .multiplier = 2.0},
                         {.weight = true, .multiplier = 3.0}};
  // 1025 and 4100: past the cpu backend's 1024-column blocks of the fused statistics pass.
  for (std::int64_t cols : {1, 7, 33, 1000, 1025, 4100})
    for (const Flags& f : cases) {
      SCOPED_TRACE(::testing::Message()
                   << "cols " << cols << " weight " << f.weight << " residual " << f.residual
                   << " grad_r " << f.grad_r << " multiplier " << f.multiplier);
      expect_matches_reference(make_inputs({5, cols}, GetParam(), f, 10 * cols));
    }
}

// With multiplier 1 the residual's gradient is dx: dresidual given as dx itself gets the same
// bits written once.
TEST_P(RmsNormTest, DresidualMayBeDxItselfWhenTheMultiplierIsOne) {
  const Inputs in =
      make_inputs({3, 40}, GetParam(), {.weight = true, .residual = true, .grad_r = true}, 5);
  const Forward f = forward(in);
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    const Backward full = backward(in, f);
    Tensor dx(in.x.shape(), in.x.dtype()), dweight({40}, in.x.dtype());
    fused_residual_add_rmsnorm_backward(in.grad_y, in.grad_r, f.r, in.weight, f.rstd, dx, dx,
                                        dweight);
    EXPECT_EQ(test::values(dx), test::values(full.dx));
    EXPECT_EQ(test::values(full.dresidual), test::values(full.dx));
    EXPECT_EQ(test::values(dweight), test::values(full.dweight));
  }
}

TEST_P(RmsNormTest, OneRowOneDimensionalAndThreeDimensionalInputs) {
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 0.5};
  expect_matches_reference(make_inputs({1, 129}, GetParam(), all, 1));
  expect_matches_reference(make_inputs({129}, GetParam(), {.weight = true}, 2));
  expect_matches_reference(make_inputs({2, 3, 17}, GetParam(), all, 3));
}

TEST_P(RmsNormTest, ZeroRowsGiveEmptyOutputsAndZeroDweight) {
  Inputs in = make_inputs({0, 16}, GetParam(), {.weight = true, .residual = true}, 4);
  const Forward f = forward(in);
  EXPECT_EQ(f.y.shape(), (Shape{0, 16}));
  EXPECT_EQ(f.rstd.shape(), (Shape{0}));
  const Backward b = backward(in, f);
  EXPECT_TRUE(testing::bitwise_equal(b.dweight, Tensor::zeros({16}, GetParam())));
}

TEST_P(RmsNormTest, NonContiguousInputsGiveTheContiguousResult) {
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 2.0};
  const Inputs in = make_inputs({6, 40}, GetParam(), all, 5);
  const auto x = test::non_contiguous(in.x), res = test::non_contiguous(in.residual),
             dy = test::non_contiguous(in.grad_y), dr = test::non_contiguous(in.grad_r);
  const Forward a = forward(in);
  Forward b{Tensor(a.y.shape(), a.y.dtype()), Tensor(a.y.shape(), a.y.dtype()),
            Tensor({6}, DType::F32)};
  fused_residual_add_rmsnorm(x.view, res.view, in.weight, b.y, b.r, b.rstd, in.eps, 2.0);
  EXPECT_TRUE(testing::bitwise_equal(a.y, b.y));
  EXPECT_TRUE(testing::bitwise_equal(a.r, b.r));
  EXPECT_TRUE(testing::bitwise_equal(a.rstd, b.rstd));
  const Backward ga = backward(in, a);
  const auto r = test::non_contiguous(a.r);
  Backward gb{Tensor(a.y.shape(), a.y.dtype()), Tensor(a.y.shape(), a.y.dtype()),
              Tensor({40}, a.y.dtype())};
  fused_residual_add_rmsnorm_backward(dy.view, dr.view, r.view, in.weight, a.rstd, gb.dx,
                                      gb.dresidual, gb.dweight, 2.0);
  EXPECT_TRUE(testing::bitwise_equal(ga.dx, gb.dx));
  EXPECT_TRUE(testing::bitwise_equal(ga.dresidual, gb.dresidual));
  EXPECT_TRUE(testing::bitwise_equal(ga.dweight, gb.dweight));
}

TEST_P(RmsNormTest, DweightIsBitwiseDeterministicRunToRun) {
  const Inputs in = make_inputs({1000, 300}, GetParam(), {.weight = true, .residual = true}, 6);
  const Forward f = forward(in);
  const Backward a = backward(in, f), b = backward(in, f);
  EXPECT_TRUE(testing::bitwise_equal(a.dweight, b.dweight));
  EXPECT_TRUE(testing::bitwise_equal(a.dx, b.dx));
  EXPECT_TRUE(testing::bitwise_equal(forward(in).y, f.y));
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, RmsNormTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

Tensor f64(const Shape& shape, std::initializer_list<double> values) {
  Tensor t(shape, DType::F64);
  std::copy(values.begin(), values.end(), t.data_ptr<double>());
  return t;
}

void expect_values(const Tensor& t, std::initializer_list<double> expected, double tol,
                   const char* what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(t.numel(), static_cast<std::int64_t>(expected.size()));
  std::int64_t i = 0;
  for (double e : expected) EXPECT_NEAR(t.data_ptr<double>()[i++], e, tol) << "element " << i;
}

// Expected numbers from torch 2.x in float64:
//   y = F.rms_norm(x, (4,), w, eps); y.backward(dy)  (and r = x*0.5 + res for the fused case,
//   torch.autograd.backward([y, r], [dy, grad_r])).
// The backward reads the f32 rstd, hence 1e-6 there.
TEST(RmsNorm, MatchesTorchRmsNormOnKnownValues) {
  Inputs in;
  in.x = f64({2, 4}, {1, 2, 3, 4, -0.5, 0.25, 0, 2});
  in.weight = f64({4}, {0.5, 1, -2, 1.5});
  in.grad_y = f64({2, 4}, {1, -1, 0.5, 2, 0.25, 3, -1, 1});
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    SCOPED_TRACE(std::string(to_string(backend)));
    ForceKernelBackend force(backend);
    const Forward f = forward(in);
    expect_values(f.y,
                  {0.1825740641190532, 0.7302962564762128, -2.1908887694286383, 2.1908887694286383,
                   -0.2407705895569007, 0.2407705895569007, 0.0, 2.8892470746828085},
                  1e-12, "y");
    const Backward b = backward(in, f);
    expect_values(
        b.dx,
        {0.09128715377540705, -0.5477219489253986, -0.6390088592690448, 0.7302967433397346,
         0.5321340780899425, 2.6833726830270623, 1.9261647164552056, -0.20237159590456444},
        1e-6, "dx");
    expect_values(
        b.dweight,
        {0.24476283345965605, -0.007984487805510643, 0.5477221923571596, 4.8473497423600564}, 1e-6,
        "dweight");
  }
}

TEST(RmsNorm, FusedResidualAddMatchesTorchWithMultiplierAndGradR) {
  Inputs in;
  in.x = f64({2, 4}, {1, 2, 3, 4, -0.5, 0.25, 0, 2});
  in.residual = f64({2, 4}, {0.5, -1, 1, 0, 2, 0, -3, 1});
  in.weight = f64({4}, {0.5, 1, -2, 1.5});
  in.grad_y = f64({2, 4}, {1, -1, 0.5, 2, 0.25, 3, -1, 1});
  in.grad_r = f64({2, 4}, {0.1, 0.2, 0.3, 0.4, -1, 0, 1, 0.5});
  in.multiplier = 0.5;
  in.eps = 1e-6;
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    SCOPED_TRACE(std::string(to_string(backend)));
    ForceKernelBackend force(backend);
    const Forward f = forward(in);
    expect_values(f.r, {1.0, 0.0, 2.5, 2.0, 1.75, 0.125, -3.0, 2.0}, 0, "r");
    expect_values(f.y,
                  {0.29814234399689327, 0.0, -2.9814234399689328, 1.7888540639813595,
                   0.4364357261826073, 0.06234796088322961, 2.992702122395021, 1.4963510611975106},
                  1e-12, "y");
    const Backward b = backward(in, f);
    expect_values(
        b.dx,
        {0.09306504293506383, -0.19814234399689326, -0.41315766665535036, 0.8824147738639141,
         -0.4035091244067852, 0.7528410231095839, 0.8868118668059513, 0.6987356454726348},
        1e-6, "dx");
    expect_values(
        b.dresidual,
        {0.18613008587012767, -0.3962846879937865, -0.8263153333107007, 1.7648295477278282,
         -0.8070182488135704, 1.5056820462191678, 1.7736237336119025, 1.3974712909452696},
        1e-6, "dresidual");
    expect_values(b.dweight,
                  {0.8145025510850902, 0.18704388264968883, 2.241706921189744, 3.38270612610682},
                  1e-6, "dweight");
  }
}

bool row_finite(const Tensor& t, std::int64_t row) {
  const std::int64_t cols = t.size(-1);
  const Tensor f = Tensor::copy_of(t.view().narrow(0, row, 1));
  Tensor d({1, cols}, DType::F64);
  copy(f, d);
  for (std::int64_t c = 0; c < cols; ++c)
    if (!std::isfinite(d.data_ptr<double>()[c])) return false;
  return true;
}

TEST(RmsNorm, NanOrInfInARowPoisonsOnlyThatRow) {
  for (DType dtype : test::kFloatDTypes)
    for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
      SCOPED_TRACE(std::string(to_string(dtype)) + " " + std::string(to_string(backend)));
      ForceKernelBackend force(backend);
      Inputs in = make_inputs({4, 33}, dtype, {.weight = true, .residual = true}, 7);
      const Forward clean = forward(in);
      const Backward clean_b = backward(in, clean);
      testing::fill(in.x.view().narrow(0, 1, 1).narrow(1, 5, 1), std::nan(""));
      testing::fill(in.residual.view().narrow(0, 2, 1).narrow(1, 32, 1),
                    std::numeric_limits<double>::infinity());
      const Forward f = forward(in);
      const Backward b = backward(in, f);
      for (std::int64_t row : {1, 2}) {
        EXPECT_FALSE(row_finite(f.y, row)) << "row " << row;
        EXPECT_FALSE(row_finite(b.dx, row)) << "row " << row;
      }
      for (std::int64_t row : {0, 3}) {
        EXPECT_TRUE(
            testing::bitwise_equal(f.y.view().narrow(0, row, 1), clean.y.view().narrow(0, row, 1)));
        EXPECT_TRUE(testing::bitwise_equal(b.dx.view().narrow(0, row, 1),
                                           clean_b.dx.view().narrow(0, row, 1)));
      }
    }
}

TEST(RmsNorm, AllZeroRowGivesZeroOutputAndFiniteGradientsThanksToEps) {
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    SCOPED_TRACE(std::string(to_string(backend)));
    ForceKernelBackend force(backend);
    Inputs in = make_inputs({2, 24}, DType::F32, {.weight = true}, 8);
    testing::fill(in.x.view().narrow(0, 0, 1), 0.0);
    const Forward f = forward(in);
    // 0 * rstd * weight: +-0, the sign following the weight.
    expect_close(f.y.view().narrow(0, 0, 1), Tensor::zeros({1, 24}, DType::F32), 0.0, "y");
    EXPECT_FLOAT_EQ(f.rstd.data_ptr<float>()[0], static_cast<float>(1 / std::sqrt(1e-5)));
    const Backward b = backward(in, f);
    EXPECT_TRUE(row_finite(b.dx, 0));
  }
}

TEST(RmsNorm, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor x = randn({2, 8}, DType::F32, 1), y({2, 8}, DType::F32), r({2, 8}, DType::F32),
               rstd({2}, DType::F32);
  const Tensor w9 = randn({9}, DType::F32, 2), res_bf16 = randn({2, 8}, DType::BF16, 3),
               res_wide = randn({2, 9}, DType::F32, 4), rstd_bf16({2}, DType::BF16),
               rstd3({3}, DType::F32), w = randn({8}, DType::F32, 5);
  using test::expect_error;
  expect_error([&] { rmsnorm(x, w9, y, rstd, 1e-5); }, ErrorCode::ShapeMismatch,
               {"rmsnorm", "'weight'", "[8]", "[9]"});
  expect_error([&] { fused_residual_add_rmsnorm(x, res_wide, w, y, r, rstd, 1e-5); },
               ErrorCode::ShapeMismatch, {"fused_residual_add_rmsnorm", "'residual'", "[2, 9]"});
  expect_error([&] { fused_residual_add_rmsnorm(x, res_bf16, w, y, r, rstd, 1e-5); },
               ErrorCode::DTypeMismatch,
               {"fused_residual_add_rmsnorm", "'residual'", "f32", "bf16"});
  expect_error([&] { rmsnorm(x, w, y, rstd_bf16, 1e-5); }, ErrorCode::DTypeMismatch,
               {"rmsnorm", "'rstd'", "f32", "bf16"});
  expect_error([&] { rmsnorm(x, w, y, rstd3, 1e-5); }, ErrorCode::ShapeMismatch,
               {"rmsnorm", "'rstd'", "[2]", "[3]"});
  expect_error([&] { rmsnorm(x, w, y, rstd, -1.0); }, ErrorCode::InvalidArgument,
               {"rmsnorm", "'eps'", "-1"});
  expect_error([&] { rmsnorm(x, w, y, rstd, std::nan("")); }, ErrorCode::InvalidArgument,
               {"rmsnorm", "'eps'", "nan"});
  expect_error([&] { fused_residual_add_rmsnorm(x, {}, w, y, r, rstd, 1e-5); },
               ErrorCode::InvalidArgument, {"fused_residual_add_rmsnorm", "'r'", "'residual'"});
  expect_error([&] { fused_residual_add_rmsnorm(x, x, w, y, {}, rstd, 1e-5); },
               ErrorCode::InvalidArgument, {"fused_residual_add_rmsnorm", "'r'", "required"});
  const Tensor scalar({}, DType::F32);
  expect_error([&] { rmsnorm(scalar, {}, scalar, {}, 1e-5); }, ErrorCode::InvalidArgument,
               {"rmsnorm", "'x'", "0-d"});
  const Tensor labels = Tensor::zeros({2, 8}, DType::I64);
  expect_error([&] { rmsnorm(labels, {}, y, rstd, 1e-5); }, ErrorCode::DTypeMismatch,
               {"rmsnorm", "'x'", "i64"});

  Tensor dx({2, 8}, DType::F32), dw({8}, DType::F32), dres({2, 8}, DType::F32);
  expect_error([&] { rmsnorm_backward(x, x, w, rstd_bf16, dx, dw); }, ErrorCode::DTypeMismatch,
               {"rmsnorm_backward", "'rstd'", "f32", "bf16"});
  expect_error([&] { rmsnorm_backward(x, x, w, rstd3, dx, dw); }, ErrorCode::ShapeMismatch,
               {"rmsnorm_backward", "'rstd'", "[2]", "[3]"});
  expect_error([&] { rmsnorm_backward(x, x, w9, rstd, dx, dw); }, ErrorCode::ShapeMismatch,
               {"rmsnorm_backward", "'weight'", "[8]", "[9]"});
  expect_error([&] { rmsnorm_backward(x, x, {}, rstd, dx, dw); }, ErrorCode::InvalidArgument,
               {"rmsnorm_backward", "'dweight'", "'weight'"});
  expect_error([&] { rmsnorm_backward(x, res_bf16, w, rstd, dx, dw); }, ErrorCode::DTypeMismatch,
               {"rmsnorm_backward", "'x'", "bf16"});
  expect_error([&] { fused_residual_add_rmsnorm_backward(x, x, x, w, rstd, dx, {}, dw); },
               ErrorCode::InvalidArgument,
               {"fused_residual_add_rmsnorm_backward", "'grad_r'", "'dresidual'"});
  expect_error([&] { fused_residual_add_rmsnorm_backward(x, x, x, w, rstd, dx, dx, dw, 2.0); },
               ErrorCode::InvalidArgument,
               {"fused_residual_add_rmsnorm_backward", "'dresidual'", "dx", "multiplier 2"});
  expect_error([&] { fused_residual_add_rmsnorm_backward(x, res_wide, x, w, rstd, dx, dres, dw); },
               ErrorCode::ShapeMismatch,
               {"fused_residual_add_rmsnorm_backward", "'grad_r'", "[2, 9]"});
  Tensor wide({8, 2}, DType::F32);
  expect_error([&] { rmsnorm_backward(x, x, w, rstd, wide.view().transpose(0, 1), dw); },
               ErrorCode::InvalidArgument, {"rmsnorm_backward", "'dx'", "contiguous"});
}

TEST(RmsNorm, BothOpsAreRegisteredForBothDirectionsOnReferenceAndCpu) {
  for (const char* op : {"rmsnorm", "rmsnorm_backward", "fused_residual_add_rmsnorm",
                         "fused_residual_add_rmsnorm_backward"})
    for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
      bool found = false;
      for (const KernelInfo& k : registered_kernels())
        found |= k.op == op && k.backend == backend && k.dtypes.size() == 4;
      EXPECT_TRUE(found) << op << " " << to_string(backend);
    }
}

}  // namespace
}  // namespace meshfuse
