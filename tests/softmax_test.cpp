// softmax on every backend against the reference backend on the CPU, plus known values and
// errors. CUDA cases skip without a GPU.
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>

#include "meshfuse/meshfuse.h"
#include "ops/softmax/softmax_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::from;
using test::on;
using test::randn;
using test::to_cpu;

struct Result {
  Tensor y, grad_x;
};

// y = softmax(x), grad_x = softmax_backward(dy, y), outputs on x's device.
Result run(const TensorView& x, const TensorView& dy, double m, const Stream& stream) {
  Result r{Tensor(x.shape(), x.dtype(), x.device(), stream),
           Tensor(x.shape(), x.dtype(), x.device(), stream)};
  softmax(x, r.y, m, stream);
  softmax_backward(dy, r.y, r.grad_x, m, stream);
  return r;
}

// The reference on the CPU.
Result reference(const TensorView& x, const TensorView& dy, double m) {
  ForceKernelBackend force(KernelBackend::Reference);
  return run(x, dy, m, {});
}

// The target's forward on a copy of the CPU tensor x, and its backward on the reference's y (both
// backwards see the same inputs), against the reference.
void expect_matches_reference(const test::Target& target, const TensorView& x, const TensorView& dy,
                              double m = 1.0, const std::string& what = "") {
  const Result ref = reference(x, dy, m);
  const Stream stream{target.device};
  const Device d = target.device;
  const Tensor dev_x = on(x, d, stream), dev_dy = on(dy, d, stream), ref_y = on(ref.y, d, stream);
  Tensor y(x.shape(), x.dtype(), d, stream), grad_x(x.shape(), x.dtype(), d, stream);
  ForceKernelBackend force(target.backend);
  softmax(dev_x, y, m, stream);
  softmax_backward(dev_dy, ref_y, grad_x, m, stream);
  expect_close(to_cpu(y, stream), ref.y, what + " y");
  expect_close(to_cpu(grad_x, stream), ref.grad_x, what + " grad_x");
}

// The values of a tensor on any device, as doubles.
std::vector<double> host_values(const TensorView& t, const Stream& stream) {
  return test::values(to_cpu(t, stream));
}

// The optimised backends (cpu, cuda) against the reference on the CPU.
class SoftmaxBackends : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(SoftmaxBackends, MatchesTheReferenceFromOneColumnTo262144) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // Widths around the cpu backend's vectors (16) and past its 1024-column blocks; on CUDA odd
  // widths take the scalar path, 1000 and 4104 one block, 128256 (LLaMA-3) a cluster for 16-bit
  // rows, 262144 a cluster of 8 (16-bit), of blocks with the device's largest shared memory (f32)
  // or, for f64, the streamed kernels.
  for (const auto& [cols, rows] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 5},
                                                                                     {7, 5},
                                                                                     {16, 4},
                                                                                     {33, 4},
                                                                                     {1000, 3},
                                                                                     {1025, 4},
                                                                                     {3000, 4},
                                                                                     {4104, 3},
                                                                                     {128256, 2},
                                                                                     {262144, 1}}) {
    const Tensor x = randn({rows, cols}, dtype, 1, 3.0), dy = randn({rows, cols}, dtype, 2);
    expect_matches_reference(target, x, dy, 1.0, "V=" + std::to_string(cols));
  }
}

TEST_P(SoftmaxBackends, LogitsMultiplierScalesInputsAndGradients) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  for (std::int64_t cols : {7, 2048, 2100}) {
    const Tensor x = randn({3, cols}, dtype, 3, 4.0), dy = randn({3, cols}, dtype, 4);
    for (double m : {0.5, -2.0, 0.0})
      expect_matches_reference(target, x, dy, m,
                               "V=" + std::to_string(cols) + " m=" + std::to_string(m));
  }
}

TEST_P(SoftmaxBackends, OneRowOneAndThreeDimensionalInputsMatchTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  std::uint64_t seed = 5;
  for (const Shape& shape : {Shape{1, 129}, Shape{2, 3, 17}, Shape{2, 3, 136}, Shape{40}}) {
    const Tensor x = randn(shape, dtype, seed++), dy = randn(shape, dtype, seed++);
    expect_matches_reference(target, x, dy, 1.0, shape_str(shape));
  }
}

// A contiguous view one element into its buffer: rows are not 16-byte aligned.
TEST_P(SoftmaxBackends, MisalignedRowsMatchTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Tensor x = randn({3, 1024}, dtype, 7), dy = randn({3, 1024}, dtype, 8);
  const Result ref = reference(x, dy, 1.0);
  Tensor xb({3 * 1024 + 1}, dtype, d, stream), yb({3 * 1024 + 1}, dtype, d, stream),
      gb({3 * 1024 + 1}, dtype, d, stream), dyb({3 * 1024 + 1}, dtype, d, stream);
  const auto shifted = [](const Tensor& t) {
    return t.view().narrow(0, 1, 3 * 1024).reshape({3, 1024});
  };
  copy(x, shifted(xb), stream);
  copy(dy, shifted(dyb), stream);
  copy(ref.y, shifted(yb), stream);
  Tensor y(x.shape(), x.dtype(), d, stream);
  ForceKernelBackend force(target.backend);
  softmax(shifted(xb), y, 1.0, stream);
  softmax_backward(shifted(dyb), shifted(yb), shifted(gb), 1.0, stream);
  expect_close(to_cpu(y, stream), ref.y, "misaligned y");
  expect_close(to_cpu(shifted(gb), stream), ref.grad_x, "misaligned grad_x");
}

TEST_P(SoftmaxBackends, MinusInfRowsGiveNanAndNanOrPlusInfPoisonsItsRowOnly) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // Rows: all -inf; a NaN; a +inf; one -inf among finite values; finite. 2000 columns (special
  // values at both ends and in the middle of a row; one CUDA block, vectors), 2001 (the scalar
  // streamed CUDA kernel) and 40000 (a CUDA cluster for 16-bit types).
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t v : {2000, 2001, 40000}) {
    Tensor x = randn({5, v}, dtype, 13);
    const auto set = [&](std::int64_t row, std::int64_t col, std::int64_t len, double value) {
      copy(test::full({1, len}, DType::F64, value), x.view().narrow(0, row, 1).narrow(1, col, len));
    };
    set(0, 0, v, -inf);
    set(1, v - 500, 1, NAN);
    set(2, v - 1, 1, inf);
    set(3, 0, 1, -inf);
    const Tensor dy = randn({5, v}, dtype, 14);
    Tensor y(x.shape(), x.dtype(), target.device, stream);
    {
      ForceKernelBackend force(target.backend);
      softmax(on(x, target.device, stream), y, 1.0, stream);
    }
    const std::vector<double> p = host_values(y, stream);
    for (std::int64_t row = 0; row < 3; ++row)
      for (std::int64_t c = 0; c < v; ++c)
        ASSERT_TRUE(std::isnan(p[row * v + c])) << v << " " << row;
    EXPECT_EQ(p[3 * v], 0.0);
    for (std::int64_t c = 1; c < v; ++c) ASSERT_TRUE(std::isfinite(p[3 * v + c])) << v;
    expect_matches_reference(target, x, dy, 1.0, "non-finite V=" + std::to_string(v));
  }
}

TEST_P(SoftmaxBackends, RowsReadAheadMatchTheReferenceWithNegativeAndSpecialValues) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // A cpu thread takes each next row's max while it sums this row's exps (on 16-bit keys for bf16
  // and f16 when m > 0): 130 rows give every thread several. Rows of negative values only, widths
  // around 32 lanes, and past row 0: all -inf (NaN), a negative NaN (NaN), all -0 (uniform), a
  // leading -inf, zeros of both signs among negatives, and rows 30 to 39 120 lower, whose exps
  // underflow unless shifted by their own max (the 16-bit keys' padding at a row's end once
  // topped them with -0).
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t cols : {31, 32, 33, 100}) {
    Tensor x64 = randn({130, cols}, DType::F64, 17, 3.0);
    double* v = x64.data_ptr<double>();
    for (std::int64_t i = 0; i < 130 * cols; ++i) v[i] = -std::fabs(v[i]) - 2.0;
    for (std::int64_t i = 30 * cols; i < 40 * cols; ++i) v[i] -= 120.0;
    for (std::int64_t c = 0; c < cols; ++c) {
      v[20 * cols + c] = -inf;
      v[22 * cols + c] = -0.0;
    }
    v[21 * cols + cols / 2] = -std::numeric_limits<double>::quiet_NaN();
    v[23 * cols] = -inf;
    v[24 * cols + 3] = 0.0;
    v[24 * cols + 5] = -0.0;
    Tensor x({130, cols}, dtype);
    copy(x64, x);
    const Tensor dy = randn({130, cols}, dtype, 18);
    for (double m : {1.0, 0.5, -1.0}) expect_matches_reference(target, x, dy, m);
    Tensor dev_y({130, cols}, dtype, target.device, stream);
    {
      ForceKernelBackend force(target.backend);
      softmax(on(x, target.device, stream), dev_y, 1.0, stream);
    }
    const std::vector<double> y = host_values(dev_y, stream);
    for (std::int64_t c = 0; c < cols; ++c) {
      ASSERT_TRUE(std::isnan(y[20 * cols + c])) << cols;
      ASSERT_TRUE(std::isnan(y[21 * cols + c])) << cols;
      ASSERT_NEAR(y[22 * cols + c], 1.0 / static_cast<double>(cols),
                  1e-2 / static_cast<double>(cols));
    }
    EXPECT_EQ(y[23 * cols], 0.0);
  }
}

TEST_P(SoftmaxBackends, DeterministicRunToRun) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking, as in training); declared before the tensors that
  // it must outlive.
  std::optional<CudaStream> cuda_stream;
  if (target.device.type == DeviceType::CUDA) cuda_stream.emplace(target.device.index);
  const Stream stream = cuda_stream ? cuda_stream->stream() : Stream{target.device};
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{64, 3001}, Shape{16, 3001}, Shape{16, 128256}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor x = on(randn(shape, dtype, 11), target.device, stream),
                 dy = on(randn(shape, dtype, 12), target.device, stream);
    const Result a = run(x, dy, 1.0, stream), b = run(x, dy, 1.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.y, stream), to_cpu(b.y, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.grad_x, stream), to_cpu(b.grad_x, stream)));
  }
}

INSTANTIATE_TEST_SUITE_P(, SoftmaxBackends,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);

// Every backend, the reference included (on the CPU and on CUDA tensors through host copies).
class SoftmaxEveryBackend : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(SoftmaxEveryBackend, ZeroRowsGiveEmptyOutputs) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor empty({0, 16}, dtype, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Result r = run(empty, empty, 1.0, stream);
  EXPECT_EQ(r.y.shape(), (Shape{0, 16}));
  EXPECT_EQ(r.grad_x.shape(), (Shape{0, 16}));
}

// A transposed view is copied to contiguous first: bitwise the contiguous result.
TEST_P(SoftmaxEveryBackend, NonContiguousInputsGiveTheContiguousResult) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  // Transposed storage on the device (view it back with .view().transpose(0, 1)).
  const auto transposed = [&](const TensorView& t) {
    return on(Tensor::copy_of(t.transpose(0, 1)), d, stream);
  };
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{6, 40}, Shape{24, 40}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor x = randn(shape, dtype, 11), dy = randn(shape, dtype, 12);
    const Tensor xt = transposed(x), dyt = transposed(dy);
    const Result a = run(on(x, d, stream), on(dy, d, stream), 1.0, stream);
    Tensor y(shape, dtype, d, stream), grad_x(shape, dtype, d, stream);
    softmax(xt.view().transpose(0, 1), y, 1.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.y, stream), to_cpu(y, stream)));
    const Tensor yt = transposed(to_cpu(a.y, stream));
    softmax_backward(dyt.view().transpose(0, 1), yt.view().transpose(0, 1), grad_x, 1.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(a.grad_x, stream), to_cpu(grad_x, stream)));
  }
}

// In place: y over x, and grad_x over grad_y or over y, give the bits of separate outputs.
TEST_P(SoftmaxEveryBackend, InPlaceGivesTheBitsOfSeparateOutputs) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{3, 5}, Shape{6, 1000}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor x = on(randn(shape, dtype, 21), d, stream),
                 dy = on(randn(shape, dtype, 22), d, stream);
    const Result separate = run(x, dy, 0.7, stream);
    const Tensor y = x.clone(stream);
    softmax(y, y, 0.7, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(y, stream), to_cpu(separate.y, stream)));
    const Tensor over_dy = dy.clone(stream), over_y = separate.y.clone(stream);
    softmax_backward(over_dy, separate.y, over_dy, 0.7, stream);
    softmax_backward(dy, over_y, over_y, 0.7, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(over_dy, stream), to_cpu(separate.grad_x, stream)));
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(over_y, stream), to_cpu(separate.grad_x, stream)));
  }
}

INSTANTIATE_TEST_SUITE_P(, SoftmaxEveryBackend,
                         ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);

// Known values, on every backend.
class SoftmaxTargets : public ::testing::TestWithParam<test::Target> {};

TEST_P(SoftmaxTargets, MatchesTorchOnKnownValues) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // torch.softmax(x * 0.5, -1) and its backward for dy, in float64.
  const Tensor x = from({2, 4}, DType::F64, {1, 2, 3, -1, 0.5, 0.5, -2, 10}),
               dy = from({2, 4}, DType::F64, {1, 0, -1, 2, 0.25, -0.5, 3, 1});
  const Tensor y = from({2, 4}, DType::F64,
                        {0.17437148764032928, 0.28748998067623538, 0.47399084625407806,
                         0.06414768542935739, 0.00848386615322327, 0.00848386615322327,
                         0.00243066834881827, 0.98060159934473512}),
               grad_x = from({2, 4}, DType::F64,
                             {0.10212275312682405, 0.02462696496453515, -0.19639242215722311,
                              0.06964270406586388, -0.00312109828937394, -0.00630254809683267,
                              0.00244795934824736, 0.00697568703795927});
  const Tensor dev_x = on(x, target.device, stream), dev_dy = on(dy, target.device, stream);
  ForceKernelBackend force(target.backend);
  const Result r = run(dev_x, dev_dy, 0.5, stream);
  expect_close(to_cpu(r.y, stream), y, 1e-14, "y");
  expect_close(to_cpu(r.grad_x, stream), grad_x, 1e-14, "grad_x");
}

INSTANTIATE_TEST_SUITE_P(, SoftmaxTargets, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

// Threads of a caller's own OpenMP region, each running softmax on the cpu backend: every call
// computes all of its rows, bitwise as a call from one thread. The kernels' row split
// (omp_get_num_threads) and their `omp for` loops must not bind to the caller's team. 4 rows of
// 4096 are under the kernels' parallel threshold, 64 rows over it.
TEST(Softmax, CallsFromInsideACallersOpenMpRegionComputeAllTheirRows) {
  for (const std::int64_t rows : {4, 64}) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    const Tensor x = randn({rows, 4096}, DType::F32, 21),
                 grad_y = randn({rows, 4096}, DType::F32, 22);
    Tensor y({rows, 4096}, DType::F32), grad_x({rows, 4096}, DType::F32);
    softmax(x, y, 1.0);
    softmax_backward(grad_y, y, grad_x, 1.0);
    constexpr int kThreads = 4;
    std::vector<Tensor> ys, grads;
    for (int t = 0; t < kThreads; ++t) {
      ys.push_back(Tensor::zeros({rows, 4096}, DType::F32));
      grads.push_back(Tensor::zeros({rows, 4096}, DType::F32));
    }
#pragma omp parallel num_threads(kThreads)
    {
      const int t = omp_get_thread_num();
      softmax(x, ys[t], 1.0);
      softmax_backward(grad_y, y, grads[t], 1.0);
    }
    for (int t = 0; t < kThreads; ++t) {
      EXPECT_TRUE(testing::bitwise_equal(ys[t], y)) << "thread " << t;
      EXPECT_TRUE(testing::bitwise_equal(grads[t], grad_x)) << "thread " << t;
    }
  }
}

TEST(Softmax, RowOffsetsPast2To31AreExact) {
  // Row 70000 of a LLaMA-3 vocabulary (128256) starts at element 8'977'920'000 > 2^31.
  EXPECT_EQ(detail::row_offset(70000, 128256), std::int64_t{8'977'920'000});
  EXPECT_EQ(detail::row_offset(std::int64_t{1} << 32, 3), std::int64_t{3} << 32);
}

// An output that overlaps an operand without being the same view would overwrite rows still to be
// read (softmax of b[:4] into b[1:] came out wrong): an error, on every backend, for every op
// whose kernel call stages outputs (KernelCall::output); the same view (in place) still works.
TEST(Softmax, OutputPartlyOverlappingAnOperandIsAnErrorAndInPlaceWorks) {
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    SCOPED_TRACE(std::string(to_string(backend)));
    const ForceKernelBackend force(backend);
    Tensor buf = randn({5, 6}, DType::F32, 31);
    const TensorView head = buf.view().narrow(0, 0, 4), tail = buf.view().narrow(0, 1, 4);
    test::expect_error([&] { softmax(head, tail, 1.0); }, ErrorCode::InvalidArgument,
                       {"softmax", "output 'y'", "overlaps 'x'", "same view"});
    const Tensor grad_y = randn({4, 6}, DType::F32, 32);
    test::expect_error([&] { softmax_backward(grad_y, head, tail, 1.0); },
                       ErrorCode::InvalidArgument,
                       {"softmax_backward", "output 'grad_x'", "overlaps 'y'"});
    const Tensor w = randn({6}, DType::F32, 33);
    test::expect_error([&] { rmsnorm(head, w, tail, TensorView(), 1e-5); },
                       ErrorCode::InvalidArgument, {"rmsnorm", "output 'y'", "overlaps 'x'"});
    const Tensor up = randn({4, 6}, DType::F32, 34);
    test::expect_error([&] { swiglu(head, up, tail); }, ErrorCode::InvalidArgument,
                       {"swiglu", "output 'out'", "overlaps 'gate'"});
    // Two outputs of one call overlapping each other.
    Tensor grads({5, 6}, DType::F32);
    test::expect_error(
        [&] {
          swiglu_backward(grad_y, up, up, grads.view().narrow(0, 0, 4),
                          grads.view().narrow(0, 1, 4));
        },
        ErrorCode::InvalidArgument, {"swiglu_backward", "overlaps"});
  }
}

// The same view as an input is taken only where the op writes in place (every backend reads each
// element before writing it): fused_residual_add_rmsnorm's r over residual came out wrong (its
// second pass reads residual again), and so did rmsnorm_backward's dx over x on the reference,
// linear_backward's grad_x over x, and two outputs given the same memory.
TEST(Softmax, TheSameViewAsAnInputIsRefusedWhereTheOpDoesNotWriteInPlace) {
  for (const KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    SCOPED_TRACE(std::string(to_string(backend)));
    const ForceKernelBackend force(backend);
    const Tensor x = randn({4, 6}, DType::F32, 41), residual = randn({4, 6}, DType::F32, 42),
                 w = randn({6}, DType::F32, 43), grad_y = randn({4, 6}, DType::F32, 44);
    Tensor y({4, 6}, DType::F32), r({4, 6}, DType::F32), rstd({4}, DType::F32);
    test::expect_error(
        [&] { fused_residual_add_rmsnorm(x, residual, w, y, residual, rstd, 1e-5, 0.5); },
        ErrorCode::InvalidArgument,
        {"fused_residual_add_rmsnorm: output 'r'", "is the same memory as 'residual'",
         "writes in place only 'y' over 'x', 'y' over 'residual'"});
    test::expect_error([&] { fused_residual_add_rmsnorm(x, residual, w, y, y, rstd, 1e-5, 0.5); },
                       ErrorCode::InvalidArgument, {"output 'r'", "same memory as 'y'"});
    rmsnorm(x, w, y, rstd, 1e-5);
    test::expect_error([&] { rmsnorm_backward(grad_y, x, w, rstd, x, TensorView()); },
                       ErrorCode::InvalidArgument,
                       {"rmsnorm_backward: output 'dx'", "same memory as 'x'", "nowhere"});
    const Tensor weight = randn({5, 6}, DType::F32, 45), grad_out = randn({4, 5}, DType::F32, 46);
    Tensor grad_weight({5, 6}, DType::F32);
    test::expect_error([&] { linear_backward(grad_out, x, weight, x, grad_weight, TensorView()); },
                       ErrorCode::InvalidArgument,
                       {"linear_backward: output 'grad_x'", "same memory as 'x'"});
    Tensor grads({4, 6}, DType::F32);
    test::expect_error([&] { swiglu_backward(grad_y, x, residual, grads, grads); },
                       ErrorCode::InvalidArgument,
                       {"swiglu_backward: output 'grad_", "same memory as 'grad_"});
  }
}

TEST(Softmax, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor x = randn({2, 8}, DType::F32, 1), y16({2, 8}, DType::BF16), y9({2, 9}, DType::F32),
               y({2, 8}, DType::F32);
  test::expect_error([&] { softmax(x, y16, 1.0); }, ErrorCode::DTypeMismatch,
                     {"softmax", "'y'", "f32", "bf16"});
  test::expect_error([&] { softmax(x, y9, 1.0); }, ErrorCode::ShapeMismatch,
                     {"softmax", "'y'", "[2, 8]", "[2, 9]"});
  const Tensor scalar({}, DType::F32);
  test::expect_error([&] { softmax(scalar, scalar, 1.0); }, ErrorCode::InvalidArgument,
                     {"softmax", "'x'", "0-d"});
  const Tensor labels = Tensor::zeros({2, 8}, DType::I64);
  test::expect_error([&] { softmax(labels, labels, 1.0); }, ErrorCode::DTypeMismatch,
                     {"softmax", "'x'", "i64"});
  test::expect_error([&] { softmax_backward(y9, y, x, 1.0); }, ErrorCode::ShapeMismatch,
                     {"softmax_backward", "'grad_y'", "[2, 8]", "[2, 9]"});
  Tensor wide({8, 2}, DType::F32);
  test::expect_error([&] { softmax(x, wide.view().transpose(0, 1), 1.0); },
                     ErrorCode::InvalidArgument, {"softmax", "'y'", "contiguous"});
  for (const double m : {std::nan(""), -std::numeric_limits<double>::infinity()}) {  // NaN rows
    test::expect_error([&] { softmax(x, y, m); }, ErrorCode::InvalidArgument,
                       {"softmax:", "logits_multiplier must be finite"});
    test::expect_error([&] { softmax_backward(x, x, y, m); }, ErrorCode::InvalidArgument,
                       {"softmax_backward:", "logits_multiplier must be finite"});
  }
}

TEST(CudaSoftmax, ForwardClustersTakeSeveralRowsAtLargeBatches) {
  MESHFUSE_REQUIRE_CUDA();
  // Past as many rows as the GPU holds clusters at once, a forward cluster takes up to 4 rows in
  // turn, loading the next while it writes one. 8449 rows of 1000 (one-block clusters) and 401 of
  // 128256 (4-block clusters, 99 at a time on an H200) give 4 rows to some clusters and 3 to
  // others.
  const test::Target cuda{KernelBackend::CUDA, test::kCuda};
  for (const auto& [cols, rows] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{1000, 8449}, {128256, 401}}) {
    const Tensor x = randn({rows, cols}, DType::BF16, 15, 3.0),
                 dy = randn({rows, cols}, DType::BF16, 16);
    expect_matches_reference(cuda, x, dy, 1.0, "V=" + std::to_string(cols));
  }
}

// The reference forced on CUDA tensors runs on host copies: bitwise the CPU reference.
TEST(CudaSoftmax, ForcedReferenceOnCudaTensorsGivesTheBitsOfTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  const Tensor x = randn({24, 40}, DType::F32, 9), dy = randn({24, 40}, DType::F32, 10);
  const Result ref = reference(x, dy, 0.5);
  const Tensor gx = on(x, test::kCuda, stream), gdy = on(dy, test::kCuda, stream);
  ForceKernelBackend force(KernelBackend::Reference);
  const Result staged = run(gx, gdy, 0.5, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.y, stream), ref.y));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(staged.grad_x, stream), ref.grad_x));
}

// f32 rows against the f64 reference on the same inputs: within 4 ulp (the exp's 2, the
// division's half, the f32 row sum's share) for logits far below their row's max. Logits of
// std 8 take exp down to about e^-80, where rounding x - max before the exp alone gave up to
// 40 ulp. One block (4104), a cluster (128256) and the streamed kernel (262146: not whole 16-byte
// vectors); then a multiplier of 0.1 on logits near 10^6, where the product's rounding (half an
// ulp of 10^5) is larger than the whole argument of the values near the max.
TEST(CudaSoftmax, F32OutputsStayWithinFourUlpOfTheF64ResultFarBelowTheMax) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  const auto expect_accurate = [&](const Tensor& x, double m, const std::string& what) {
    Tensor y(x.shape(), DType::F32, test::kCuda, stream), truth(x.shape(), DType::F64);
    softmax(on(x, test::kCuda, stream), y, m, stream);
    {
      ForceKernelBackend force(KernelBackend::Reference);
      softmax(test::converted(x, DType::F64), truth, m);
    }
    test::expect_within_f32_ulps(to_cpu(y, stream), truth, 4.0, what);
  };
  for (const std::int64_t cols : {4104, 128256, 262146})
    expect_accurate(randn({2, cols}, DType::F32, 21, 8.0), 1.0, "V=" + std::to_string(cols));
  Tensor far = randn({2, 4104}, DType::F32, 22, 80.0);
  float* v = far.data_ptr<float>();
  for (std::int64_t i = 0; i < far.numel(); ++i) v[i] += 1e6f;
  // 0.1f: the kernels take the multiplier in the row's accumulation type; the reference gets the
  // same value.
  expect_accurate(far, double(0.1f), "logits near 1e6, multiplier 0.1");
}

TEST(CudaSoftmax, RowsPastElement2To31AreAddressedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  // 16745 LLaMA-3 rows: the last starts at element 2'147'518'464 > 2^31. Only the last row is
  // given values (the others hold whatever the allocator had) and checked.
  const std::int64_t rows = 16745, cols = 128256;
  std::optional<Tensor> x, y, grad_x;
  try {
    x.emplace(Shape{rows, cols}, DType::BF16, test::kCuda, stream);
    y.emplace(Shape{rows, cols}, DType::BF16, test::kCuda, stream);
    grad_x.emplace(Shape{rows, cols}, DType::BF16, test::kCuda, stream);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::OutOfMemory) GTEST_SKIP() << "needs 13 GB of device memory";
    throw;
  }
  const Tensor last = randn({1, cols}, DType::BF16, 13, 3.0),
               dy_last = randn({1, cols}, DType::BF16, 14);
  const auto last_row = [&](const Tensor& t) { return t.view().narrow(0, rows - 1, 1); };
  copy(last, last_row(*x), stream);
  softmax(*x, *y, 1.0, stream);
  // The backward reads grad_y from x's buffer: its last row holds dy.
  copy(dy_last, last_row(*x), stream);
  softmax_backward(*x, *y, *grad_x, 1.0, stream);
  const Result ref = reference(last, dy_last, 1.0);
  const Tensor y_last = to_cpu(last_row(*y), stream);
  expect_close(y_last, ref.y, "y");
  Tensor ref_grad(last.shape(), DType::BF16);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    softmax_backward(dy_last, y_last, ref_grad);
  }
  expect_close(to_cpu(last_row(*grad_x), stream), ref_grad, "grad_x");
}

}  // namespace
}  // namespace meshfuse
