// swiglu and swiglu_packed on every backend against the reference backend on the CPU, plus known
// values and errors. CUDA cases skip without a GPU.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::on;
using test::randn;
using test::to_cpu;

struct Grads {
  Tensor out, grad_gate, grad_up;
};

// swiglu and its backward, outputs on gate's device.
Grads run(const TensorView& gate, const TensorView& up, const TensorView& dy,
          const Stream& stream = {}) {
  const Device d = gate.device();
  Grads g{Tensor(gate.shape(), gate.dtype(), d, stream),
          Tensor(gate.shape(), gate.dtype(), d, stream),
          Tensor(gate.shape(), gate.dtype(), d, stream)};
  swiglu(gate, up, g.out, stream);
  swiglu_backward(dy, gate, up, g.grad_gate, g.grad_up, stream);
  return g;
}

Grads run_reference(const TensorView& gate, const TensorView& up, const TensorView& dy) {
  ForceKernelBackend force(KernelBackend::Reference);
  return run(gate, up, dy);
}

// The target's backend on copies of the CPU tensors against the reference on them.
void expect_matches_reference(const test::Target& target, const Tensor& gate, const Tensor& up,
                              const Tensor& dy) {
  const Grads ref = run_reference(gate, up, dy);
  const Stream stream{target.device};
  const Tensor g = on(gate, target.device, stream), u = on(up, target.device, stream),
               d = on(dy, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Grads r = run(g, u, d, stream);
  expect_close(to_cpu(r.out, stream), ref.out, "out");
  expect_close(to_cpu(r.grad_gate, stream), ref.grad_gate, "grad_gate");
  expect_close(to_cpu(r.grad_up, stream), ref.grad_up, "grad_up");
}

// The optimised backends (cpu, cuda) against the reference on the CPU.
class SwigluBackends : public ::testing::TestWithParam<test::OpCase> {};

// 8 and 4104: CUDA vectors; 1, 7, 33: one element per access; 1000: the cpu backend's loops.
TEST_P(SwigluBackends, MatchesTheReferenceAtVectorAndOddWidths) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  for (std::int64_t cols : {1, 7, 8, 33, 1000, 4104}) {
    SCOPED_TRACE(::testing::Message() << "cols " << cols);
    expect_matches_reference(target, randn({9, cols}, dtype, 1, 3.0), randn({9, cols}, dtype, 2),
                             randn({9, cols}, dtype, 3));
  }
}

TEST_P(SwigluBackends, OneRowAndThreeDimensionalInputsMatchTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  expect_matches_reference(target, randn({1, 129}, dtype, 4), randn({1, 129}, dtype, 5),
                           randn({1, 129}, dtype, 6));
  expect_matches_reference(target, randn({2, 3, 17}, dtype, 7), randn({2, 3, 17}, dtype, 8),
                           randn({2, 3, 17}, dtype, 9));
}

// 70000 rows: the CUDA grid's y dimension stops at 65535, the kernels loop over the rest; 8 and 3
// columns take the vector and the one-element paths.
TEST_P(SwigluBackends, RowsPastTheGridsSixtyFiveThousandAreCovered) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  for (std::int64_t cols : {8, 3}) {
    SCOPED_TRACE(::testing::Message() << "cols " << cols);
    expect_matches_reference(target, randn({70000, cols}, dtype, 6, 3.0),
                             randn({70000, cols}, dtype, 7), randn({70000, cols}, dtype, 8));
  }
}

// The packed layouts run the kernels of the separate op with strides: the same bits, and the
// reference's values.
TEST_P(SwigluBackends, PackedLayoutsGiveTheBitsOfSeparateGateAndUp) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{3, 21}, {5, 40}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    const Tensor g = randn({rows, cols}, dtype, 13), u = randn({rows, cols}, dtype, 14),
                 dy = randn({rows, cols}, dtype, 15);
    const Grads ref = run_reference(g, u, dy);
    const Tensor dev_dy = on(dy, d, stream);
    const Grads separate = run(on(g, d, stream), on(u, d, stream), dev_dy, stream);
    for (SwigluLayout layout : {SwigluLayout::Halves, SwigluLayout::Interleaved}) {
      const bool halves = layout == SwigluLayout::Halves;
      const auto gate_col = [&](std::int64_t c) { return halves ? c : 2 * c; };
      const auto up_col = [&](std::int64_t c) { return halves ? cols + c : 2 * c + 1; };
      Tensor x({rows, 2 * cols}, dtype);
      for (std::int64_t c = 0; c < cols; ++c) {  // pack column by column as the layout says
        copy(g.view().narrow(1, c, 1), x.view().narrow(1, gate_col(c), 1));
        copy(u.view().narrow(1, c, 1), x.view().narrow(1, up_col(c), 1));
      }
      const Tensor dev_x = on(x, d, stream);
      Tensor out({rows, cols}, dtype, d, stream), grad_x({rows, 2 * cols}, dtype, d, stream);
      swiglu_packed(dev_x, layout, out, stream);
      swiglu_packed_backward(dev_dy, dev_x, layout, grad_x, stream);
      const Tensor host_out = to_cpu(out, stream), host_grad_x = to_cpu(grad_x, stream);
      expect_close(host_out, ref.out, "out");
      EXPECT_TRUE(testing::bitwise_equal(host_out, to_cpu(separate.out, stream)));
      const Tensor grad_gate = to_cpu(separate.grad_gate, stream),
                   grad_up = to_cpu(separate.grad_up, stream);
      for (std::int64_t c = 0; c < cols; ++c) {
        const TensorView dg = host_grad_x.view().narrow(1, gate_col(c), 1),
                         du = host_grad_x.view().narrow(1, up_col(c), 1);
        expect_close(dg, ref.grad_gate.view().narrow(1, c, 1), "grad_x (gate)");
        expect_close(du, ref.grad_up.view().narrow(1, c, 1), "grad_x (up)");
        EXPECT_TRUE(testing::bitwise_equal(dg, grad_gate.view().narrow(1, c, 1)));
        EXPECT_TRUE(testing::bitwise_equal(du, grad_up.view().narrow(1, c, 1)));
      }
    }
  }
}

TEST_P(SwigluBackends, DeterministicRunToRun) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking, as in training); declared before the tensors that
  // it must outlive.
  std::optional<CudaStream> cuda_stream;
  if (target.device.type == DeviceType::CUDA) cuda_stream.emplace(target.device.index);
  const Stream stream = cuda_stream ? cuda_stream->stream() : Stream{target.device};
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{64, 513}, Shape{512, 4096}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor g = on(randn(shape, dtype, 16), target.device, stream),
                 u = on(randn(shape, dtype, 17), target.device, stream),
                 dy = on(randn(shape, dtype, 18), target.device, stream);
    const Grads a = run(g, u, dy, stream), b = run(g, u, dy, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.out, stream), to_cpu(b.out, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.grad_gate, stream), to_cpu(b.grad_gate, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.grad_up, stream), to_cpu(b.grad_up, stream)));
  }
}

INSTANTIATE_TEST_SUITE_P(, SwigluBackends,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);

// Every backend, the reference included (on the CPU and on CUDA tensors through host copies).
class SwigluEveryBackend : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(SwigluEveryBackend, ZeroRowsGiveEmptyOutputs) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor empty({0, 16}, dtype, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Grads r = run(empty, empty, empty, stream);
  EXPECT_EQ(r.out.shape(), (Shape{0, 16}));
  EXPECT_EQ(r.grad_gate.shape(), (Shape{0, 16}));
}

TEST_P(SwigluEveryBackend, NonContiguousInputsGiveTheContiguousResult) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{6, 40}, Shape{24, 16}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor g = randn(shape, dtype, 10), u = randn(shape, dtype, 11),
                 dy = randn(shape, dtype, 12);
    // Transposed storage on the device, viewed back as `shape`.
    const auto transposed = [&](const Tensor& t) {
      return on(Tensor::copy_of(t.view().transpose(0, 1)), d, stream);
    };
    const Tensor gt = transposed(g), ut = transposed(u), dyt = transposed(dy);
    const Grads a = run(on(g, d, stream), on(u, d, stream), on(dy, d, stream), stream),
                b = run(gt.view().transpose(0, 1), ut.view().transpose(0, 1),
                        dyt.view().transpose(0, 1), stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.out, stream), to_cpu(b.out, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.grad_gate, stream), to_cpu(b.grad_gate, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.grad_up, stream), to_cpu(b.grad_up, stream)));
  }
}

// The backward in place: gradients written over the inputs they come from (grad_gate over gate
// and grad_up over up, as the MLP does; grad_up over grad_out) are the bits of separate outputs,
// at a width of vector loops with a tail and at a tiny one.
TEST_P(SwigluEveryBackend, BackwardInPlaceGivesTheBitsOfSeparateOutputs) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{64, 1000}, Shape{3, 5}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor g = on(randn(shape, dtype, 13), target.device, stream),
                 u = on(randn(shape, dtype, 14), target.device, stream),
                 dy = on(randn(shape, dtype, 15), target.device, stream);
    const Grads separate = run(g, u, dy, stream);
    const Tensor gate = g.clone(stream), up = u.clone(stream);
    swiglu_backward(dy, gate, up, gate, up, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(gate, stream), to_cpu(separate.grad_gate, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(up, stream), to_cpu(separate.grad_up, stream)));
    const Tensor grad_out = dy.clone(stream), grad_gate(shape, dtype, target.device, stream);
    swiglu_backward(grad_out, g, u, grad_gate, grad_out, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(grad_out, stream), to_cpu(separate.grad_up, stream)));
    EXPECT_TRUE(
        testing::bitwise_equal(to_cpu(grad_gate, stream), to_cpu(separate.grad_gate, stream)));
  }
}

INSTANTIATE_TEST_SUITE_P(, SwigluEveryBackend,
                         ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);

// Known values, on every backend.
class SwigluTargets : public ::testing::TestWithParam<test::Target> {};

TEST_P(SwigluTargets, MatchesTorchSiluTimesUpOnKnownValues) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // torch.nn.functional.silu(g) * u for g = [0, 1, -2, 20], u = [3, 2, 1, 0.5].
  const Tensor g = on(test::from({4}, DType::F64, {0, 1, -2, 20}), target.device, stream),
               u = on(test::from({4}, DType::F64, {3, 2, 1, 0.5}), target.device, stream);
  Tensor out({4}, DType::F64, target.device, stream);
  ForceKernelBackend force(target.backend);
  swiglu(g, u, out, stream);
  const double expected[] = {0.0, 2 * 0.7310585786300049, -0.2384058440442351,
                             0.5 * 19.999999958776925};
  const std::vector<double> v = test::values(to_cpu(out, stream));
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(v[i], expected[i], 1e-12);
}

TEST_P(SwigluTargets, NanAndInfPropagateLikeTorch) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor g = test::from({4}, DType::F32, {std::nan(""), inf, -inf, 1.0}),
               u = test::from({4}, DType::F32, {1.0, 1.0, 1.0, inf});
  Tensor ref({4}, DType::F32);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    swiglu(g, u, ref);
  }
  Tensor dev_out({4}, DType::F32, target.device, stream);
  {
    ForceKernelBackend force(target.backend);
    swiglu(on(g, target.device, stream), on(u, target.device, stream), dev_out, stream);
  }
  const Tensor out = to_cpu(dev_out, stream);
  // torch.nn.functional.silu gives nan, inf, nan (-inf / inf) for nan, inf, -inf; silu(1)*inf =
  // inf.
  const float* o = out.data_ptr<float>();
  EXPECT_TRUE(std::isnan(o[0]));
  EXPECT_EQ(o[1], inf);
  EXPECT_TRUE(std::isnan(o[2]));
  EXPECT_EQ(o[3], inf);
  expect_close(out, ref, "non-finite");
}

INSTANTIATE_TEST_SUITE_P(, SwigluTargets, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

// The cpu backend takes silu and its derivative of a 16-bit gate from tables of their 65536
// values: every one of them, times up = 1 and times random up (and dy), within one ulp of the
// type of the reference (which rounds once from double; one subnormal step near zero), NaN where
// the reference gives NaN; the interleaved layout (strided loops) gives the same bits.
TEST(Swiglu, EverySixteenBitGateValueMatchesTheReference) {
  constexpr std::int64_t kRows = 2, kCols = 32768;
  for (const DType dtype : {DType::BF16, DType::F16}) {
    Tensor g({kRows, kCols}, dtype);
    auto* bits = static_cast<std::uint16_t*>(g.view().data());
    for (std::uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<std::uint16_t>(i);
    const bool bf16 = dtype == DType::BF16;
    const double ulp = bf16 ? 0x1p-7 : 0x1p-10, smallest = bf16 ? 0x1p-133 : 0x1p-24;
    const Tensor dy = randn({kRows, kCols}, dtype, 20);
    for (const Tensor& u :
         {test::full({kRows, kCols}, dtype, 1.0), randn({kRows, kCols}, dtype, 19)}) {
      const Grads cpu = run(g, u, dy), ref = run_reference(g, u, dy);
      const std::string what = std::string(to_string(dtype)) + " every gate value: ";
      for (const auto& [name, a, e] : {std::tuple{"out", &cpu.out, &ref.out},
                                       std::tuple{"grad_gate", &cpu.grad_gate, &ref.grad_gate},
                                       std::tuple{"grad_up", &cpu.grad_up, &ref.grad_up}}) {
        const testing::Diff d = testing::compare(*a, *e, smallest, ulp);
        EXPECT_EQ(d.violations, 0) << what << name << ": max rel err " << d.max_rel_err
                                   << ", non-finite mismatches " << d.mismatched_nonfinite;
      }
      Tensor x({kRows, 2 * kCols}, dtype), out({kRows, kCols}, dtype),
          grad_x({kRows, 2 * kCols}, dtype);
      // The even (gate) or odd (up) columns of an interleaved (kRows, 2 kCols) tensor.
      const auto columns = [&](const Tensor& t, std::int64_t parity) {
        return TensorView(static_cast<char*>(t.view().data()) + parity * element_size(dtype), dtype,
                          {kRows, kCols}, {2 * kCols, 2});
      };
      copy(g, columns(x, 0));
      copy(u, columns(x, 1));
      swiglu_packed(x, SwigluLayout::Interleaved, out);
      swiglu_packed_backward(dy, x, SwigluLayout::Interleaved, grad_x);
      EXPECT_TRUE(testing::bitwise_equal(out, cpu.out)) << what << "interleaved out";
      EXPECT_TRUE(testing::bitwise_equal(columns(grad_x, 0), cpu.grad_gate))
          << what << "interleaved grad_gate";
      EXPECT_TRUE(testing::bitwise_equal(columns(grad_x, 1), cpu.grad_up))
          << what << "interleaved grad_up";
    }
  }
}

// f32 rows against the f64 reference on the same inputs: the output and both gradients are
// rounded once, within half an ulp (a relative 2^-24; f32 arithmetic rounds each five times or
// more), on CUDA and on every CPU target (ctest's cpu_target_* runs). Vector loads (4096 columns),
// a row's tail (1001) and a gate past exp's range in double (-800); the interleaved layout gives
// the same bits (PackedLayoutsGiveTheBitsOfSeparateGateAndUp).
class SwigluKernels : public ::testing::TestWithParam<test::Target> {};

TEST_P(SwigluKernels, F32OutputsAndGradientsAreTheF64ResultRoundedOnce) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device dev = target.device;
  ForceKernelBackend force(target.backend);
  for (const std::int64_t cols : {4096, 1001}) {
    Tensor g = randn({4, cols}, DType::F32, 41, 3.0);
    g.data_ptr<float>()[5] = -800.0f;
    const Tensor u = randn({4, cols}, DType::F32, 42), dy = randn({4, cols}, DType::F32, 43);
    const Grads got = run(on(g, dev, stream), on(u, dev, stream), on(dy, dev, stream), stream);
    Grads truth;
    {
      ForceKernelBackend reference(KernelBackend::Reference);
      truth = run(test::converted(g, DType::F64), test::converted(u, DType::F64),
                  test::converted(dy, DType::F64));
    }
    const std::string what = "cols=" + std::to_string(cols);
    const double half_ulp = 0.5 * (1 + 0x1p-10);
    test::expect_within_f32_ulps(to_cpu(got.out, stream), truth.out, half_ulp, what + " out");
    test::expect_within_f32_ulps(to_cpu(got.grad_gate, stream), truth.grad_gate, half_ulp,
                                 what + " grad_gate");
    test::expect_within_f32_ulps(to_cpu(got.grad_up, stream), truth.grad_up, half_ulp,
                                 what + " grad_up");
  }
}

INSTANTIATE_TEST_SUITE_P(, SwigluKernels, ::testing::ValuesIn(test::kernel_targets()),
                         test::target_param_name);

TEST(Swiglu, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor g = randn({2, 8}, DType::F32, 1), u16 = randn({2, 8}, DType::BF16, 2),
               u9 = randn({2, 9}, DType::F32, 3), out({2, 8}, DType::F32);
  test::expect_error([&] { swiglu(g, u16, out); }, ErrorCode::DTypeMismatch,
                     {"swiglu", "'up'", "f32", "bf16"});
  test::expect_error([&] { swiglu(g, u9, out); }, ErrorCode::ShapeMismatch,
                     {"swiglu", "'up'", "[2, 8]", "[2, 9]"});
  const Tensor odd = randn({2, 7}, DType::F32, 4);
  Tensor out3({2, 3}, DType::F32);
  test::expect_error([&] { swiglu_packed(odd, SwigluLayout::Halves, out3); },
                     ErrorCode::InvalidArgument, {"swiglu_packed", "even", "7"});
  const Tensor labels = Tensor::zeros({2, 8}, DType::I64);
  test::expect_error([&] { swiglu(labels, labels, out); }, ErrorCode::DTypeMismatch,
                     {"swiglu", "'gate'", "i64"});
  Tensor wide({8, 2}, DType::F32);
  test::expect_error([&] { swiglu(g, g, wide.view().transpose(0, 1)); }, ErrorCode::InvalidArgument,
                     {"swiglu", "'out'", "contiguous"});
}

}  // namespace
}  // namespace meshfuse
