// rmsnorm and fused_residual_add_rmsnorm on CUDA tensors against the reference backend on the CPU.
// Skipped without a GPU (the registration test runs in every CUDA build).
#include <cmath>
#include <limits>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::kCuda;
using test::to_cpu;
using test::to_cuda;

constexpr double kEps = 1e-5;

struct Flags {
  bool weight = false, residual = false, grad_r = false;
  double multiplier = 1.0;
};

// Every combination of the optional arguments that the API allows.
const Flags kCases[] = {{},
                        {.weight = true},
                        {.multiplier = 0.5},
                        {.weight = true, .residual = true},
                        {.residual = true, .grad_r = true},
                        {.weight = true, .residual = true, .grad_r = true, .multiplier = 2.0},
                        {.weight = true, .multiplier = 3.0}};

// One call's inputs, all on one device; undefined tensors are absent optional arguments.
struct Inputs {
  Tensor x, residual, weight, grad_y, grad_r;
  double multiplier = 1.0;
};

Inputs make_inputs(const Shape& shape, DType dtype, Flags f, std::uint64_t seed) {
  Inputs in;
  in.x = test::randn(shape, dtype, seed);
  in.grad_y = test::randn(shape, dtype, seed + 1);
  if (f.residual) in.residual = test::randn(shape, dtype, seed + 2);
  if (f.weight) in.weight = test::randn({shape.back()}, dtype, seed + 3);
  if (f.grad_r) in.grad_r = test::randn(shape, dtype, seed + 4);
  in.multiplier = f.multiplier;
  return in;
}

Tensor on(const Tensor& t, Device device) { return t.defined() ? t.to(device) : Tensor{}; }

Inputs on(const Inputs& in, Device device) {
  return {on(in.x, device),      on(in.residual, device), on(in.weight, device),
          on(in.grad_y, device), on(in.grad_r, device),   in.multiplier};
}

struct Forward {
  Tensor y, r, rstd;
};
struct Backward {
  Tensor dx, dresidual, dweight;
};

Forward on(const Forward& f, Device device) {
  return {on(f.y, device), on(f.r, device), on(f.rstd, device)};
}

// rmsnorm when there is no residual and no multiplier, else the fused op; outputs on x's device.
Forward forward(const Inputs& in, const Stream& stream = {}) {
  const TensorView& x = in.x;
  const Device d = x.device();
  Forward f{Tensor(x.shape(), x.dtype(), d, stream),
            {},
            Tensor({x.numel() / x.size(-1)}, DType::F32, d, stream)};
  if (in.residual.defined()) f.r = Tensor(x.shape(), x.dtype(), d, stream);
  if (!in.residual.defined() && in.multiplier == 1.0)
    rmsnorm(in.x, in.weight, f.y, f.rstd, kEps, stream);
  else
    fused_residual_add_rmsnorm(in.x, in.residual, in.weight, f.y, f.r, f.rstd, kEps, in.multiplier,
                               stream);
  return f;
}

// The backward from saved forward outputs (r, rstd), so that backends can be compared on the same
// saved tensors.
Backward backward(const Inputs& in, const Forward& saved, const Stream& stream = {}) {
  const TensorView& x = in.x;
  const Device d = x.device();
  Backward b{Tensor(x.shape(), x.dtype(), d, stream), {}, {}};
  if (in.residual.defined()) b.dresidual = Tensor(x.shape(), x.dtype(), d, stream);
  if (in.weight.defined()) b.dweight = Tensor({x.size(-1)}, x.dtype(), d, stream);
  if (!in.residual.defined() && in.multiplier == 1.0)
    rmsnorm_backward(in.grad_y, in.x, in.weight, saved.rstd, b.dx, b.dweight, stream);
  else
    fused_residual_add_rmsnorm_backward(
        in.grad_y, in.grad_r, in.residual.defined() ? saved.r : in.x, in.weight, saved.rstd, b.dx,
        b.dresidual, b.dweight, in.multiplier, stream);
  return b;
}

template <typename F>
auto on_reference(F&& f) {
  ForceKernelBackend force(KernelBackend::Reference);
  return f();
}

// dweight sums over rows in fp32: allow for that on top of the dtype's rounding.
double dweight_tolerance(DType dtype) { return std::max(testing::default_tolerance(dtype), 1e-4); }

// The cuda backend on copies of the CPU inputs `in` against the reference on `in`.
void expect_matches_reference(const Inputs& in) {
  const Forward ref = on_reference([&] { return forward(in); });
  const Inputs gpu_in = on(in, kCuda);
  const Forward gpu = forward(gpu_in);
  expect_close(to_cpu(gpu.y), ref.y, "y");
  expect_close(to_cpu(gpu.rstd), ref.rstd, "rstd");
  if (in.residual.defined()) expect_close(to_cpu(gpu.r), ref.r, "r");
  const Backward rb = on_reference([&] { return backward(in, ref); });
  const Backward gb = backward(gpu_in, on(ref, kCuda));
  expect_close(to_cpu(gb.dx), rb.dx, "dx");
  if (in.residual.defined()) expect_close(to_cpu(gb.dresidual), rb.dresidual, "dresidual");
  if (in.weight.defined())
    expect_close(to_cpu(gb.dweight), rb.dweight, dweight_tolerance(in.x.dtype()), "dweight");
}

class CudaRmsNormTest : public ::testing::TestWithParam<DType> {};

// 1, 7, 33, 4097: one element per vector; 40, 4104: 16-byte vectors; 4097, 16384 (backward),
// 16392: rows too wide for registers.
TEST_P(CudaRmsNormTest, EveryOptionalArgumentCombinationMatchesTheReferenceAtOddAndVectorWidths) {
  MESHFUSE_REQUIRE_CUDA();
  for (std::int64_t cols : {1, 7, 33, 40, 4104, 4097, 16384, 16392})
    for (const Flags& f : kCases) {
      SCOPED_TRACE(::testing::Message()
                   << "cols " << cols << " weight " << f.weight << " residual " << f.residual
                   << " grad_r " << f.grad_r << " multiplier " << f.multiplier);
      expect_matches_reference(make_inputs({5, cols}, GetParam(), f, 10 * cols));
    }
}

TEST_P(CudaRmsNormTest, LlamaWidthsManyRowsOneRowAndThreeDimensionsMatchTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 0.5};
  const Flags weight{.weight = true};
  const struct {
    Shape shape;
    Flags flags;
  } cases[] = {{{1, 4096}, all},   {{384, 4096}, all},  {{256, 4096}, weight},
               {{77, 8192}, all},  {{3, 8192}, weight}, {{4096, 33}, all},
               {{100, 4104}, all}, {{129}, weight},     {{2, 3, 17}, all}};
  std::uint64_t seed = 100;
  for (const auto& c : cases) {
    SCOPED_TRACE(shape_str(c.shape) + (c.flags.residual ? " all" : " weight"));
    expect_matches_reference(make_inputs(c.shape, GetParam(), c.flags, seed += 10));
  }
}

TEST_P(CudaRmsNormTest, ZeroRowsWriteNothingAndGiveZeroDweight) {
  MESHFUSE_REQUIRE_CUDA();
  const Inputs in =
      on(make_inputs({0, 16}, GetParam(), {.weight = true, .residual = true}, 1), kCuda);
  const Forward f = forward(in);
  EXPECT_EQ(f.y.shape(), (Shape{0, 16}));
  Backward b = backward(in, f);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(b.dweight), Tensor::zeros({16}, GetParam())));
}

// A (rows, cols) CUDA view holding t's values with transposed storage.
struct Transposed {
  Tensor storage;
  TensorView view;
};
Transposed transposed_on_cuda(const Tensor& t) {
  Transposed nc{to_cuda(Tensor::copy_of(t.view().transpose(0, 1))), {}};
  nc.view = nc.storage.view().transpose(0, 1);
  return nc;
}

TEST_P(CudaRmsNormTest, NonContiguousInputsGiveTheBitsOfTheirContiguousCopies) {
  MESHFUSE_REQUIRE_CUDA();
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 2.0};
  const Inputs cpu = make_inputs({24, 40}, GetParam(), all, 2);
  const Inputs in = on(cpu, kCuda);
  const Transposed x = transposed_on_cuda(cpu.x), res = transposed_on_cuda(cpu.residual),
                   dy = transposed_on_cuda(cpu.grad_y), dr = transposed_on_cuda(cpu.grad_r);
  const Forward a = forward(in);
  Forward b{Tensor({24, 40}, GetParam(), kCuda), Tensor({24, 40}, GetParam(), kCuda),
            Tensor({24}, DType::F32, kCuda)};
  fused_residual_add_rmsnorm(x.view, res.view, in.weight, b.y, b.r, b.rstd, kEps, 2.0);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.y), to_cpu(b.y)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.r), to_cpu(b.r)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.rstd), to_cpu(b.rstd)));
  const Backward ga = backward(in, a);
  const Transposed r = transposed_on_cuda(to_cpu(a.r));
  Backward gb{Tensor({24, 40}, GetParam(), kCuda), Tensor({24, 40}, GetParam(), kCuda),
              Tensor({40}, GetParam(), kCuda)};
  fused_residual_add_rmsnorm_backward(dy.view, dr.view, r.view, in.weight, a.rstd, gb.dx,
                                      gb.dresidual, gb.dweight, 2.0);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga.dx), to_cpu(gb.dx)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga.dresidual), to_cpu(gb.dresidual)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga.dweight), to_cpu(gb.dweight)));
}

// With multiplier 1 the residual's gradient is dx: dresidual given as dx itself gets the same
// bits written once.
TEST_P(CudaRmsNormTest, DresidualAsDxItselfWithMultiplierOneGivesTheSameBits) {
  MESHFUSE_REQUIRE_CUDA();
  const Flags f{.weight = true, .residual = true, .grad_r = true};
  for (const std::int64_t cols : {std::int64_t{40}, std::int64_t{4096}}) {
    const Inputs in = on(make_inputs({24, cols}, GetParam(), f, 3), kCuda);
    const Forward a = forward(in);
    const Backward full = backward(in, a);
    Tensor dx({24, cols}, GetParam(), kCuda), dweight({cols}, GetParam(), kCuda);
    fused_residual_add_rmsnorm_backward(in.grad_y, in.grad_r, a.r, in.weight, a.rstd, dx, dx,
                                        dweight);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(dx), to_cpu(full.dx)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(full.dresidual), to_cpu(full.dx)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(dweight), to_cpu(full.dweight)));
  }
}

// A CUDA copy of t starting one element past a 16-byte boundary: the kernels fall back to one
// element per access.
struct Misaligned {
  Tensor storage;
  TensorView view;
};
Misaligned misaligned_on_cuda(const Tensor& t) {
  Misaligned m{Tensor({t.numel() + 1}, t.dtype(), kCuda), {}};
  m.view =
      TensorView(m.storage.data_ptr<char>() + element_size(t.dtype()), t.dtype(), t.shape(), kCuda);
  copy(t, m.view);
  return m;
}

// At H = 4096 the aligned rows take the vector kernels (resident in registers) and the misaligned
// ones the scalar streaming kernels: results agree, and dweight, whose summation order is a
// function of the shape only, agrees bit for bit.
TEST_P(CudaRmsNormTest, MisalignedRowsTakeTheScalarPathAndGiveTheSameDweightBits) {
  MESHFUSE_REQUIRE_CUDA();
  const Inputs cpu = make_inputs({300, 4096}, GetParam(), {.weight = true}, 3);
  const Inputs in = on(cpu, kCuda);
  const Misaligned x = misaligned_on_cuda(cpu.x), dy = misaligned_on_cuda(cpu.grad_y);
  const Forward a = forward(in);
  Tensor y({300, 4096}, GetParam(), kCuda), rstd({300}, DType::F32, kCuda);
  rmsnorm(x.view, in.weight, y, rstd, kEps);
  expect_close(to_cpu(y), to_cpu(a.y), "y");
  expect_close(to_cpu(rstd), to_cpu(a.rstd), "rstd");
  const Backward ga = backward(in, a);
  Tensor dx({300, 4096}, GetParam(), kCuda), dweight({4096}, GetParam(), kCuda);
  rmsnorm_backward(dy.view, x.view, in.weight, a.rstd, dx, dweight);
  expect_close(to_cpu(dx), to_cpu(ga.dx), "dx");
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(dweight), to_cpu(ga.dweight)));
}

bool row_finite(const Tensor& t, std::int64_t row) {
  const Tensor host = to_cpu(t.view().narrow(0, row, 1));
  Tensor d(host.shape(), DType::F64);
  copy(host, d);
  for (std::int64_t c = 0; c < d.numel(); ++c)
    if (!std::isfinite(d.data_ptr<double>()[c])) return false;
  return true;
}

TEST_P(CudaRmsNormTest, NanOrInfInARowPoisonsOnlyThatRow) {
  MESHFUSE_REQUIRE_CUDA();
  for (std::int64_t cols : {33, 40}) {
    SCOPED_TRACE(::testing::Message() << "cols " << cols);
    Inputs cpu = make_inputs({4, cols}, GetParam(), {.weight = true, .residual = true}, 4);
    const Inputs clean_in = on(cpu, kCuda);
    const Forward clean = forward(clean_in);
    const Backward clean_b = backward(clean_in, clean);
    testing::fill(cpu.x.view().narrow(0, 1, 1).narrow(1, 5, 1), std::nan(""));
    testing::fill(cpu.residual.view().narrow(0, 2, 1).narrow(1, cols - 1, 1),
                  std::numeric_limits<double>::infinity());
    const Inputs in = on(cpu, kCuda);
    const Forward f = forward(in);
    const Backward b = backward(in, f);
    for (std::int64_t row : {1, 2}) {
      EXPECT_FALSE(row_finite(f.y, row)) << "row " << row;
      EXPECT_FALSE(row_finite(b.dx, row)) << "row " << row;
    }
    for (std::int64_t row : {0, 3}) {
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(f.y.view().narrow(0, row, 1)),
                                         to_cpu(clean.y.view().narrow(0, row, 1))));
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(b.dx.view().narrow(0, row, 1)),
                                         to_cpu(clean_b.dx.view().narrow(0, row, 1))));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaRmsNormTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

TEST(CudaRmsNorm, ForcedReferenceOnCudaTensorsGivesTheBitsOfTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 0.5};
  const Inputs cpu = make_inputs({6, 40}, DType::BF16, all, 5);
  const Inputs in = on(cpu, kCuda);
  const Forward ref = on_reference([&] { return forward(cpu); });
  const Forward staged = on_reference([&] { return forward(in); });
  EXPECT_EQ(staged.y.device(), kCuda);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.y), ref.y));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.r), ref.r));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.rstd), ref.rstd));
  const Backward rb = on_reference([&] { return backward(cpu, ref); });
  const Backward sb = on_reference([&] { return backward(in, staged); });
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sb.dx), rb.dx));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sb.dresidual), rb.dresidual));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sb.dweight), rb.dweight));
}

TEST(CudaRmsNorm, ForwardAndBackwardAreBitwiseDeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  for (const Shape& shape : {Shape{1024, 4096}, Shape{256, 16392}}) {
    SCOPED_TRACE(shape_str(shape));
    // One random tensor serves as x, residual and both gradients (host randn is the slow part).
    const Tensor data = to_cuda(test::randn(shape, DType::BF16, 6), stream);
    const Inputs in{data, data, to_cuda(test::randn({shape[1]}, DType::BF16, 7), stream),
                    data, data, 0.5};
    const Forward f1 = forward(in, stream), f2 = forward(in, stream);
    const Backward b1 = backward(in, f1, stream), b2 = backward(in, f1, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(f1.y, stream), to_cpu(f2.y, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(f1.r, stream), to_cpu(f2.r, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(f1.rstd, stream), to_cpu(f2.rstd, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(b1.dx, stream), to_cpu(b2.dx, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(b1.dresidual, stream), to_cpu(b2.dresidual, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(b1.dweight, stream), to_cpu(b2.dweight, stream)));
  }
}

// Zeros written on the device (Tensor::zeros goes through host memory): a copy from one zero
// element broadcast with zero strides.
Tensor cuda_zeros(const Shape& shape, DType dtype) {
  const Tensor zero = Tensor::zeros({1}, dtype, kCuda);
  Tensor t(shape, dtype, kCuda);
  copy(TensorView(zero.data_ptr<char>(), dtype, shape, Shape(shape.size(), 0), kCuda), t);
  return t;
}

// 524290 rows of 4096 bf16: the last rows start past element 2^31 (4 GiB per tensor, 16 GiB in
// all). Only the first and last rows are non-zero; zero rows add nothing to dweight.
TEST(CudaRmsNorm, RowsPastElementTwoToThe31AreAddressedWith64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  constexpr std::int64_t kCols = 4096, kRows = (std::int64_t{1} << 31) / kCols + 2;
  const Shape shape{kRows, kCols};
  const Inputs rows = make_inputs({2, kCols}, DType::BF16, {.weight = true}, 7);
  Inputs in;
  try {
    in.x = cuda_zeros(shape, DType::BF16);
    in.grad_y = cuda_zeros(shape, DType::BF16);
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  in.weight = to_cuda(rows.weight);
  for (std::int64_t i : {0, 1}) {
    const std::int64_t row = i == 0 ? 0 : kRows - 1;
    copy(rows.x.view().narrow(0, i, 1), in.x.view().narrow(0, row, 1));
    copy(rows.grad_y.view().narrow(0, i, 1), in.grad_y.view().narrow(0, row, 1));
  }
  const Forward f = forward(in);
  const Backward b = backward(in, f);
  const Forward ref = on_reference([&] { return forward(rows); });
  const Backward rb = on_reference([&] { return backward(rows, ref); });
  for (std::int64_t i : {0, 1}) {
    const std::int64_t row = i == 0 ? 0 : kRows - 1;
    SCOPED_TRACE(::testing::Message() << "row " << row);
    expect_close(to_cpu(f.y.view().narrow(0, row, 1)), ref.y.view().narrow(0, i, 1), "y");
    expect_close(to_cpu(b.dx.view().narrow(0, row, 1)), rb.dx.view().narrow(0, i, 1), "dx");
  }
  expect_close(to_cpu(b.dweight), rb.dweight, dweight_tolerance(DType::BF16), "dweight");
}

#ifdef MESHFUSE_WITH_CUDA
TEST(CudaRmsNorm, BothOpsHaveACudaKernelForBothDirectionsAndEveryFloatDtype) {
  for (const char* op : {"rmsnorm", "rmsnorm_backward", "fused_residual_add_rmsnorm",
                         "fused_residual_add_rmsnorm_backward"}) {
    bool found = false;
    for (const KernelInfo& k : registered_kernels())
      found |= k.op == op && k.backend == KernelBackend::CUDA && k.dtypes.size() == 4;
    EXPECT_TRUE(found) << op;
  }
}
#endif

}  // namespace
}  // namespace meshfuse
