// rmsnorm and fused_residual_add_rmsnorm on every backend against the reference backend on the CPU,
// plus known values, errors and registration. CUDA cases skip without a GPU.
#include <cmath>
#include <limits>
#include <optional>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::on;
using test::randn;
using test::to_cpu;

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
  double eps = kEps;
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

Inputs on(const Inputs& in, Device device, const Stream& stream) {
  return {on(in.x, device, stream),
          on(in.residual, device, stream),
          on(in.weight, device, stream),
          on(in.grad_y, device, stream),
          on(in.grad_r, device, stream),
          in.multiplier,
          in.eps};
}

struct Forward {
  Tensor y, r, rstd;
};
struct Backward {
  Tensor dx, dresidual, dweight;
};

Forward on(const Forward& f, Device device, const Stream& stream) {
  return {on(f.y, device, stream), on(f.r, device, stream), on(f.rstd, device, stream)};
}

// rmsnorm when there is no residual and no multiplier, else the fused op.
bool plain(const Inputs& in) { return !in.residual.defined() && in.multiplier == 1.0; }

// The forward with outputs on x's device.
Forward forward(const Inputs& in, const Stream& stream) {
  const TensorView& x = in.x;
  const Device d = x.device();
  Forward f{Tensor(x.shape(), x.dtype(), d, stream),
            {},
            Tensor({x.numel() / x.size(-1)}, rmsnorm_rstd_dtype(x.dtype()), d, stream)};
  if (in.residual.defined()) f.r = Tensor(x.shape(), x.dtype(), d, stream);
  if (plain(in))
    rmsnorm(in.x, in.weight, f.y, f.rstd, in.eps, stream);
  else
    fused_residual_add_rmsnorm(in.x, in.residual, in.weight, f.y, f.r, f.rstd, in.eps,
                               in.multiplier, stream);
  return f;
}

// The backward from saved forward outputs (r, rstd), so that backends can be compared on the same
// saved tensors.
Backward backward(const Inputs& in, const Forward& saved, const Stream& stream) {
  const TensorView& x = in.x;
  const Device d = x.device();
  Backward b{Tensor(x.shape(), x.dtype(), d, stream), {}, {}};
  if (in.residual.defined()) b.dresidual = Tensor(x.shape(), x.dtype(), d, stream);
  if (in.weight.defined()) b.dweight = Tensor({x.size(-1)}, x.dtype(), d, stream);
  if (plain(in))
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

// The target's backend on copies of the CPU inputs `in` against the reference on `in`; the
// backward of both reads the reference's saved tensors.
void expect_matches_reference(const test::Target& target, const Inputs& in) {
  const Forward ref = on_reference([&] { return forward(in, {}); });
  const Backward rb = on_reference([&] { return backward(in, ref, {}); });
  const Stream stream{target.device};
  const Inputs dev_in = on(in, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Forward f = forward(dev_in, stream);
  expect_close(to_cpu(f.y, stream), ref.y, "y");
  expect_close(to_cpu(f.rstd, stream), ref.rstd, "rstd");
  if (in.residual.defined()) expect_close(to_cpu(f.r, stream), ref.r, "r");
  const Backward b = backward(dev_in, on(ref, target.device, stream), stream);
  expect_close(to_cpu(b.dx, stream), rb.dx, "dx");
  if (in.residual.defined()) expect_close(to_cpu(b.dresidual, stream), rb.dresidual, "dresidual");
  if (in.weight.defined()) expect_close(to_cpu(b.dweight, stream), rb.dweight, "dweight");
}

// A view on `device` holding t's (rows, cols) values with transposed storage.
struct Strided {
  Tensor storage;
  TensorView view;
};
Strided transposed_on(const Tensor& t, Device device, const Stream& stream) {
  Strided nc{on(Tensor::copy_of(t.view().transpose(0, 1)), device, stream), {}};
  nc.view = nc.storage.view().transpose(0, 1);
  return nc;
}

// A copy of t on `device` starting one element past a 16-byte boundary: the CUDA kernels fall
// back to one element per access.
Strided misaligned_on(const Tensor& t, Device device, const Stream& stream) {
  Strided m{Tensor({t.numel() + 1}, t.dtype(), device, stream), {}};
  m.view = TensorView(m.storage.data_ptr<char>() + element_size(t.dtype()), t.dtype(), t.shape(),
                      device);
  copy(t, m.view, stream);
  return m;
}

bool row_finite(const Tensor& t, std::int64_t row, const Stream& stream) {
  for (double v : test::values(to_cpu(t.view().narrow(0, row, 1), stream)))
    if (!std::isfinite(v)) return false;
  return true;
}

// The optimised backends (cpu, cuda) against the reference on the CPU.
class RmsNormBackends : public ::testing::TestWithParam<test::OpCase> {};

// 1, 7, 33, 4097: one element per CUDA vector; 40, 4104: 16-byte vectors; 4097, 16384
// (backward), 16392: rows too wide for CUDA registers; 1025 and 4100: past the cpu backend's
// 1024-column blocks of the fused statistics pass.
TEST_P(RmsNormBackends, EveryOptionalArgumentCombinationMatchesTheReferenceAtOddAndVectorWidths) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  for (std::int64_t cols : {1, 7, 33, 40, 1000, 1025, 4097, 4100, 4104, 16384, 16392})
    for (const Flags& f : kCases) {
      SCOPED_TRACE(::testing::Message()
                   << "cols " << cols << " weight " << f.weight << " residual " << f.residual
                   << " grad_r " << f.grad_r << " multiplier " << f.multiplier);
      expect_matches_reference(target, make_inputs({5, cols}, dtype, f, 10 * cols));
    }
}

TEST_P(RmsNormBackends, LlamaWidthsManyRowsOneRowAndOneAndThreeDimensionsMatchTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 0.5};
  const Flags weight{.weight = true};
  const struct {
    Shape shape;
    Flags flags;
  } cases[] = {{{1, 129}, all},   {{1, 4096}, all},    {{384, 4096}, all},   {{256, 4096}, weight},
               {{77, 8192}, all}, {{3, 8192}, weight}, {{4096, 33}, all},    {{100, 4104}, all},
               {{129}, weight},   {{2, 3, 17}, all},   {{600, 8200}, weight}};
  std::uint64_t seed = 100;
  for (const auto& c : cases) {
    SCOPED_TRACE(shape_str(c.shape) + (c.flags.residual ? " all" : " weight"));
    expect_matches_reference(target, make_inputs(c.shape, dtype, c.flags, seed += 10));
  }
}

TEST_P(RmsNormBackends, ZeroRowsGiveEmptyOutputsAndZeroDweight) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Inputs in =
      on(make_inputs({0, 16}, dtype, {.weight = true, .residual = true}, 4), target.device, stream);
  ForceKernelBackend force(target.backend);
  const Forward f = forward(in, stream);
  EXPECT_EQ(f.y.shape(), (Shape{0, 16}));
  EXPECT_EQ(f.rstd.shape(), (Shape{0}));
  const Backward b = backward(in, f, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(b.dweight, stream), Tensor::zeros({16}, dtype)));
}

TEST_P(RmsNormBackends, NonContiguousInputsGiveTheBitsOfTheirContiguousCopies) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 2.0};
  ForceKernelBackend force(target.backend);
  for (const std::int64_t rows : {6, 24}) {
    SCOPED_TRACE(::testing::Message() << "rows " << rows);
    const Inputs cpu = make_inputs({rows, 40}, dtype, all, 5);
    const Inputs in = on(cpu, d, stream);
    const Strided x = transposed_on(cpu.x, d, stream), res = transposed_on(cpu.residual, d, stream),
                  dy = transposed_on(cpu.grad_y, d, stream),
                  dr = transposed_on(cpu.grad_r, d, stream);
    const Forward a = forward(in, stream);
    Forward b{Tensor({rows, 40}, dtype, d, stream), Tensor({rows, 40}, dtype, d, stream),
              Tensor({rows}, rmsnorm_rstd_dtype(dtype), d, stream)};
    fused_residual_add_rmsnorm(x.view, res.view, in.weight, b.y, b.r, b.rstd, kEps, 2.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.y, stream), to_cpu(b.y, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.r, stream), to_cpu(b.r, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.rstd, stream), to_cpu(b.rstd, stream)));
    const Backward ga = backward(in, a, stream);
    const Strided r = transposed_on(to_cpu(a.r, stream), d, stream);
    Backward gb{Tensor({rows, 40}, dtype, d, stream), Tensor({rows, 40}, dtype, d, stream),
                Tensor({40}, dtype, d, stream)};
    fused_residual_add_rmsnorm_backward(dy.view, dr.view, r.view, in.weight, a.rstd, gb.dx,
                                        gb.dresidual, gb.dweight, 2.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga.dx, stream), to_cpu(gb.dx, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga.dresidual, stream), to_cpu(gb.dresidual, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga.dweight, stream), to_cpu(gb.dweight, stream)));
  }
}

// At H = 4096 the aligned rows take the CUDA vector kernels (resident in registers) and the
// misaligned ones the scalar streaming kernels: results agree, and dweight, whose summation order
// is a function of the shape only, agrees bit for bit.
TEST_P(RmsNormBackends, MisalignedRowsGiveTheResultAndTheDweightBitsOfAlignedOnes) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Inputs cpu = make_inputs({300, 4096}, dtype, {.weight = true}, 3);
  const Inputs in = on(cpu, d, stream);
  const Strided x = misaligned_on(cpu.x, d, stream), dy = misaligned_on(cpu.grad_y, d, stream);
  ForceKernelBackend force(target.backend);
  const Forward a = forward(in, stream);
  Tensor y({300, 4096}, dtype, d, stream), rstd({300}, rmsnorm_rstd_dtype(dtype), d, stream);
  rmsnorm(x.view, in.weight, y, rstd, kEps, stream);
  expect_close(to_cpu(y, stream), to_cpu(a.y, stream), "y");
  expect_close(to_cpu(rstd, stream), to_cpu(a.rstd, stream), "rstd");
  const Backward ga = backward(in, a, stream);
  Tensor dx({300, 4096}, dtype, d, stream), dweight({4096}, dtype, d, stream);
  rmsnorm_backward(dy.view, x.view, in.weight, a.rstd, dx, dweight, stream);
  expect_close(to_cpu(dx, stream), to_cpu(ga.dx, stream), "dx");
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(dweight, stream), to_cpu(ga.dweight, stream)));
}

TEST_P(RmsNormBackends, ForwardAndBackwardAreBitwiseDeterministicRunToRun) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking, as in training); declared before the tensors that
  // it must outlive.
  std::optional<CudaStream> cuda_stream;
  if (target.device.type == DeviceType::CUDA) cuda_stream.emplace(target.device.index);
  const Stream stream = cuda_stream ? cuda_stream->stream() : Stream{target.device};
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 0.5};
  const struct {
    Shape shape;
    Flags flags;
  } cases[] = {
      {{1000, 300}, {.weight = true, .residual = true}}, {{1024, 4096}, all}, {{256, 16392}, all}};
  for (const auto& c : cases) {
    SCOPED_TRACE(shape_str(c.shape));
    // One random tensor serves as x, residual and both gradients (host randn is the slow part).
    const Tensor data = on(randn(c.shape, dtype, 6), target.device, stream);
    const Inputs in{data,
                    c.flags.residual ? data : Tensor{},
                    on(randn({c.shape[1]}, dtype, 7), target.device, stream),
                    data,
                    c.flags.grad_r ? data : Tensor{},
                    c.flags.multiplier};
    ForceKernelBackend force(target.backend);
    const Forward f1 = forward(in, stream), f2 = forward(in, stream);
    const Backward b1 = backward(in, f1, stream), b2 = backward(in, f1, stream);
    const auto same = [&](const Tensor& a, const Tensor& b) {
      return !a.defined() || testing::bitwise_equal(to_cpu(a, stream), to_cpu(b, stream));
    };
    EXPECT_TRUE(same(f1.y, f2.y));
    EXPECT_TRUE(same(f1.r, f2.r));
    EXPECT_TRUE(same(f1.rstd, f2.rstd));
    EXPECT_TRUE(same(b1.dx, b2.dx));
    EXPECT_TRUE(same(b1.dresidual, b2.dresidual));
    EXPECT_TRUE(same(b1.dweight, b2.dweight));
  }
}

INSTANTIATE_TEST_SUITE_P(, RmsNormBackends,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);

// Every backend, the reference included (on the CPU and on CUDA tensors through host copies).
class RmsNormEveryBackend : public ::testing::TestWithParam<test::OpCase> {};

// With multiplier 1 the residual's gradient is dx: dresidual given as dx itself gets the same
// bits written once.
TEST_P(RmsNormEveryBackend, DresidualAsDxItselfWithMultiplierOneGivesTheSameBits) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Flags f{.weight = true, .residual = true, .grad_r = true};
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{3, 40}, Shape{24, 40}, Shape{24, 4096}}) {
    SCOPED_TRACE(shape_str(shape));
    const Inputs in = on(make_inputs(shape, dtype, f, 3), d, stream);
    const Forward a = forward(in, stream);
    const Backward full = backward(in, a, stream);
    Tensor dx(shape, dtype, d, stream), dweight({shape[1]}, dtype, d, stream);
    fused_residual_add_rmsnorm_backward(in.grad_y, in.grad_r, a.r, in.weight, a.rstd, dx, dx,
                                        dweight, 1.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(dx, stream), to_cpu(full.dx, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(full.dresidual, stream), to_cpu(full.dx, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(dweight, stream), to_cpu(full.dweight, stream)));
  }
}

// In place: y over x (rmsnorm, and the fused op), or over residual, gives the bits of separate
// memory (y is written element by element after its row's sum).
TEST_P(RmsNormEveryBackend, YOverXOrResidualGivesTheBitsOfSeparateOutputs) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{3, 40}, Shape{24, 4096}}) {
    SCOPED_TRACE(shape_str(shape));
    const Inputs plain_in = on(make_inputs(shape, dtype, {.weight = true}, 5), d, stream);
    const Forward plain_out = forward(plain_in, stream);
    const Tensor y = plain_in.x.clone(stream);
    Tensor rstd({shape[0]}, rmsnorm_rstd_dtype(dtype), d, stream);
    rmsnorm(y, plain_in.weight, y, rstd, plain_in.eps, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(y, stream), to_cpu(plain_out.y, stream)));
    const Inputs in =
        on(make_inputs(shape, dtype, {.weight = true, .residual = true, .multiplier = 0.5}, 6), d,
           stream);
    const Forward out = forward(in, stream);
    for (const bool over_x : {true, false}) {
      const Tensor x = in.x.clone(stream), residual = in.residual.clone(stream);
      const Tensor& over = over_x ? x : residual;
      Tensor r(shape, dtype, d, stream);
      fused_residual_add_rmsnorm(x, residual, in.weight, over, r, rstd, in.eps, in.multiplier,
                                 stream);
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(over, stream), to_cpu(out.y, stream))) << over_x;
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(r, stream), to_cpu(out.r, stream))) << over_x;
    }
  }
}

// 33: one element per CUDA vector; 40: 16-byte vectors.
TEST_P(RmsNormEveryBackend, NanOrInfInARowPoisonsOnlyThatRow) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  ForceKernelBackend force(target.backend);
  for (std::int64_t cols : {33, 40}) {
    SCOPED_TRACE(::testing::Message() << "cols " << cols);
    Inputs cpu = make_inputs({4, cols}, dtype, {.weight = true, .residual = true}, 4);
    const Inputs clean_in = on(cpu, target.device, stream);
    const Forward clean = forward(clean_in, stream);
    const Backward clean_b = backward(clean_in, clean, stream);
    fill(cpu.x.view().narrow(0, 1, 1).narrow(1, 5, 1), std::nan(""));
    fill(cpu.residual.view().narrow(0, 2, 1).narrow(1, cols - 1, 1),
         std::numeric_limits<double>::infinity());
    const Inputs in = on(cpu, target.device, stream);
    const Forward f = forward(in, stream);
    const Backward b = backward(in, f, stream);
    for (std::int64_t row : {1, 2}) {
      EXPECT_FALSE(row_finite(f.y, row, stream)) << "row " << row;
      EXPECT_FALSE(row_finite(b.dx, row, stream)) << "row " << row;
    }
    for (std::int64_t row : {0, 3}) {
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(f.y.view().narrow(0, row, 1), stream),
                                         to_cpu(clean.y.view().narrow(0, row, 1), stream)));
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(b.dx.view().narrow(0, row, 1), stream),
                                         to_cpu(clean_b.dx.view().narrow(0, row, 1), stream)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, RmsNormEveryBackend,
                         ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);

// Known values, on every backend.
class RmsNormTargets : public ::testing::TestWithParam<test::Target> {};

Tensor f64(const Shape& shape, std::initializer_list<double> values) {
  return test::from(shape, DType::F64, values);
}

// The values of t (on any device) within tol of expected.
void expect_values(const Tensor& t, std::initializer_list<double> expected, double tol,
                   const char* what, const Stream& stream) {
  SCOPED_TRACE(what);
  const std::vector<double> v = test::values(to_cpu(t, stream));
  ASSERT_EQ(v.size(), expected.size());
  std::size_t i = 0;
  for (double e : expected) EXPECT_NEAR(v[i++], e, tol) << "element " << i;
}

// Expected numbers from torch 2.x in float64:
//   y = F.rms_norm(x, (4,), w, eps); y.backward(dy)  (and r = x*0.5 + res for the fused case,
//   torch.autograd.backward([y, r], [dy, grad_r])).
// In f64 the saved rstd is f64 too, so the gradients are as exact as the forward.
TEST_P(RmsNormTargets, MatchesTorchRmsNormOnKnownValues) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Inputs cpu;
  cpu.x = f64({2, 4}, {1, 2, 3, 4, -0.5, 0.25, 0, 2});
  cpu.weight = f64({4}, {0.5, 1, -2, 1.5});
  cpu.grad_y = f64({2, 4}, {1, -1, 0.5, 2, 0.25, 3, -1, 1});
  const Inputs in = on(cpu, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Forward f = forward(in, stream);
  expect_values(f.y,
                {0.1825740641190532, 0.7302962564762128, -2.1908887694286383, 2.1908887694286383,
                 -0.2407705895569007, 0.2407705895569007, 0.0, 2.8892470746828085},
                1e-12, "y", stream);
  const Backward b = backward(in, f, stream);
  expect_values(b.dx,
                {0.09128715377540705, -0.5477219489253986, -0.6390088592690448, 0.7302967433397346,
                 0.5321340780899425, 2.6833726830270623, 1.9261647164552056, -0.20237159590456444},
                1e-12, "dx", stream);
  expect_values(
      b.dweight,
      {0.24476283345965605, -0.007984487805510643, 0.5477221923571596, 4.8473497423600564}, 1e-12,
      "dweight", stream);
}

TEST_P(RmsNormTargets, FusedResidualAddMatchesTorchWithMultiplierAndGradR) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Inputs cpu;
  cpu.x = f64({2, 4}, {1, 2, 3, 4, -0.5, 0.25, 0, 2});
  cpu.residual = f64({2, 4}, {0.5, -1, 1, 0, 2, 0, -3, 1});
  cpu.weight = f64({4}, {0.5, 1, -2, 1.5});
  cpu.grad_y = f64({2, 4}, {1, -1, 0.5, 2, 0.25, 3, -1, 1});
  cpu.grad_r = f64({2, 4}, {0.1, 0.2, 0.3, 0.4, -1, 0, 1, 0.5});
  cpu.multiplier = 0.5;
  cpu.eps = 1e-6;
  const Inputs in = on(cpu, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Forward f = forward(in, stream);
  expect_values(f.r, {1.0, 0.0, 2.5, 2.0, 1.75, 0.125, -3.0, 2.0}, 0, "r", stream);
  expect_values(f.y,
                {0.29814234399689327, 0.0, -2.9814234399689328, 1.7888540639813595,
                 0.4364357261826073, 0.06234796088322961, 2.992702122395021, 1.4963510611975106},
                1e-12, "y", stream);
  const Backward b = backward(in, f, stream);
  expect_values(
      b.dx,
      {0.09306504293506383, -0.19814234399689326, -0.41315766665535036, 0.8824147738639141,
       -0.4035091244067852, 0.7528410231095839, 0.8868118668059513, 0.6987356454726348},
      1e-12, "dx", stream);
  expect_values(b.dresidual,
                {0.18613008587012767, -0.3962846879937865, -0.8263153333107007, 1.7648295477278282,
                 -0.8070182488135704, 1.5056820462191678, 1.7736237336119025, 1.3974712909452696},
                1e-12, "dresidual", stream);
  expect_values(b.dweight,
                {0.8145025510850902, 0.18704388264968883, 2.241706921189744, 3.38270612610682},
                1e-12, "dweight", stream);
}

TEST_P(RmsNormTargets, AllZeroRowGivesZeroOutputAndFiniteGradientsThanksToEps) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Inputs cpu = make_inputs({2, 24}, DType::F32, {.weight = true}, 8);
  fill(cpu.x.view().narrow(0, 0, 1), 0.0);
  const Inputs in = on(cpu, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Forward f = forward(in, stream);
  // 0 * rstd * weight: +-0, the sign following the weight.
  expect_close(to_cpu(f.y.view().narrow(0, 0, 1), stream), Tensor::zeros({1, 24}, DType::F32), 0.0,
               "y");
  EXPECT_FLOAT_EQ(to_cpu(f.rstd, stream).data_ptr<float>()[0],
                  static_cast<float>(1 / std::sqrt(kEps)));
  const Backward b = backward(in, f, stream);
  EXPECT_TRUE(row_finite(b.dx, 0, stream));
}

// dweight of f32 inputs is the exact sum over rows of its terms dy * n rounded once (cpu), or
// rounded per block of rows and once more (cuda): within 3 units of f32's roundoff u = 2^-24 of
// the exact result (the reference on f64 copies of the inputs, with the same f32 rstd), where up
// to 2u go to n = x * (multiplier * rstd) in f32 and the rest to the roundings of the sums. The
// 600 x 8200 case takes cuda's streaming kernel with 3 rows per block. grad_y = x makes every term
// positive, so no cancellation hides the error of the sum: fp32 sums over the 79 rows per block and
// 256 blocks of the 20000-row case are ~10 u off.
TEST_P(RmsNormTargets, F32DweightIsWithinThreeUnitsOfTheExactSum) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (const Shape& shape :
       {Shape{400, 68}, Shape{20000, 68}, Shape{3000, 4096}, Shape{600, 8200}}) {
    for (double multiplier : {1.0, 0.9}) {
      SCOPED_TRACE(fmt::format("{} multiplier {}", shape_str(shape), multiplier));
      Inputs cpu = make_inputs(shape, DType::F32, {.weight = true, .multiplier = multiplier}, 9);
      cpu.grad_y = Tensor::copy_of(cpu.x);
      const Forward saved = on_reference([&] { return forward(cpu, {}); });
      Inputs wide = cpu;
      Forward saved_wide = saved;  // the same f32 rstd, as the f64 rstd that f64 inputs take
      for (Tensor* t : {&wide.x, &wide.weight, &wide.grad_y, &saved_wide.rstd}) {
        Tensor f64(t->shape(), DType::F64);
        copy(*t, f64);
        *t = f64;
      }
      const Backward exact = on_reference([&] { return backward(wide, saved_wide, {}); });
      const Inputs in = on(cpu, target.device, stream);
      ForceKernelBackend force(target.backend);
      const Tensor got =
          to_cpu(backward(in, on(saved, target.device, stream), stream).dweight, stream);
      const std::vector<double> g = test::values(got), e = test::values(exact.dweight);
      for (std::size_t c = 0; c < g.size(); ++c)
        ASSERT_LE(std::abs(g[c] - e[c]), 3 * 0x1p-24 * std::abs(e[c])) << "column " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, RmsNormTargets, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

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

// Host staging: the reference on CUDA tensors computes on host copies, bit for bit.
TEST(CudaRmsNorm, ForcedReferenceOnCudaTensorsGivesTheBitsOfTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  const Flags all{.weight = true, .residual = true, .grad_r = true, .multiplier = 0.5};
  const Inputs cpu = make_inputs({6, 40}, DType::BF16, all, 5);
  const Inputs in = on(cpu, test::kCuda, stream);
  const Forward ref = on_reference([&] { return forward(cpu, {}); });
  const Forward staged = on_reference([&] { return forward(in, stream); });
  EXPECT_EQ(staged.y.device(), test::kCuda);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.y, stream), ref.y));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.r, stream), ref.r));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.rstd, stream), ref.rstd));
  const Backward rb = on_reference([&] { return backward(cpu, ref, {}); });
  const Backward sb = on_reference([&] { return backward(in, staged, stream); });
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sb.dx, stream), rb.dx));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sb.dresidual, stream), rb.dresidual));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sb.dweight, stream), rb.dweight));
}

// Zeros written on the device (Tensor::zeros goes through host memory): a copy from one zero
// element broadcast with zero strides.
Tensor cuda_zeros(const Shape& shape, DType dtype, const Stream& stream) {
  const Tensor zero = Tensor::zeros({1}, dtype, test::kCuda, stream);
  Tensor t(shape, dtype, test::kCuda, stream);
  copy(TensorView(zero.data_ptr<char>(), dtype, shape, Shape(shape.size(), 0), test::kCuda), t,
       stream);
  return t;
}

// 524290 rows of 4096 bf16: the last rows start past element 2^31 (4 GiB per tensor, 16 GiB in
// all). Only the first and last rows are non-zero; zero rows add nothing to dweight.
TEST(CudaRmsNorm, RowsPastElementTwoToThe31AreAddressedWith64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  constexpr std::int64_t kCols = 4096, kRows = (std::int64_t{1} << 31) / kCols + 2;
  const Shape shape{kRows, kCols};
  const Inputs rows = make_inputs({2, kCols}, DType::BF16, {.weight = true}, 7);
  Inputs in;
  try {
    in.x = cuda_zeros(shape, DType::BF16, stream);
    in.grad_y = cuda_zeros(shape, DType::BF16, stream);
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  in.weight = on(rows.weight, test::kCuda, stream);
  for (std::int64_t i : {0, 1}) {
    const std::int64_t row = i == 0 ? 0 : kRows - 1;
    copy(rows.x.view().narrow(0, i, 1), in.x.view().narrow(0, row, 1), stream);
    copy(rows.grad_y.view().narrow(0, i, 1), in.grad_y.view().narrow(0, row, 1), stream);
  }
  const Forward f = forward(in, stream);
  const Backward b = backward(in, f, stream);
  const Forward ref = on_reference([&] { return forward(rows, {}); });
  const Backward rb = on_reference([&] { return backward(rows, ref, {}); });
  for (std::int64_t i : {0, 1}) {
    const std::int64_t row = i == 0 ? 0 : kRows - 1;
    SCOPED_TRACE(::testing::Message() << "row " << row);
    expect_close(to_cpu(f.y.view().narrow(0, row, 1), stream), ref.y.view().narrow(0, i, 1), "y");
    expect_close(to_cpu(b.dx.view().narrow(0, row, 1), stream), rb.dx.view().narrow(0, i, 1), "dx");
  }
  expect_close(to_cpu(b.dweight, stream), rb.dweight, "dweight");
}

// f32 rows against the f64 reference on the same inputs: y = x * rstd * weight is rounded once,
// within half an ulp (a relative 2^-24; f32 arithmetic rounds twice and carries rstd's error).
// Rows held in registers by groups of threads (1024), one element at a time (1001), by whole
// blocks (4096) and rows streamed twice (65600); then the ends of f32's range, where the exact
// split of r * w does not hold: a product past FLT_MAX (2e38 * 2, y = 2) and, with eps = 0, a
// row of subnormals whose rstd is past FLT_MAX (y = 1).
TEST(CudaRmsNorm, F32OutputsAreTheF64ResultRoundedOnce) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  const auto expect_rounded_once = [&](const Inputs& in, const std::string& what) {
    const Forward f = forward(on(in, test::kCuda, stream), stream);
    Inputs wide = in;
    wide.x = test::converted(in.x, DType::F64);
    wide.weight = test::converted(in.weight, DType::F64);
    wide.grad_y = test::converted(in.grad_y, DType::F64);
    const Forward truth = on_reference([&] { return forward(wide, {}); });
    test::expect_within_f32_ulps(to_cpu(f.y, stream), truth.y, 0.5 * (1 + 0x1p-10), what);
  };
  for (const std::int64_t cols : {1024, 1001, 4096, 65600})
    expect_rounded_once(make_inputs({3, cols}, DType::F32, {.weight = true}, 31),
                        "cols=" + std::to_string(cols));
  Inputs huge = make_inputs({1, 1}, DType::F32, {.weight = true}, 32);
  huge.x = test::from({1, 1}, DType::F32, {2e38});
  huge.weight = test::from({1}, DType::F32, {2.0});
  expect_rounded_once(huge, "r * w past FLT_MAX");
  Inputs tiny = make_inputs({1, 4}, DType::F32, {.weight = true}, 33);
  tiny.x = test::from({1, 4}, DType::F32, {1e-41, -1e-41, 1e-41, 1e-41});
  tiny.weight = test::from({4}, DType::F32, {1.0, 1.0, 0.5, -3.0});
  tiny.eps = 0.0;
  expect_rounded_once(tiny, "eps 0, subnormal row");
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
