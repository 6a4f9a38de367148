// add and mul on every backend: bitwise against the reference (every backend computes the same
// fma or product, rounded once), the reference against double results and against values torch
// gives, strided and in-place operands, empty tensors and errors. CUDA cases skip without a GPU.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "ops/elementwise/elementwise_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_close;
using test::from;
using test::on;
using test::randn;
using test::to_cpu;
using test::values;

Tensor run_add(const TensorView& a, const TensorView& b, double alpha, const Stream& stream = {}) {
  Tensor out(a.shape(), a.dtype(), a.device(), stream);
  add(a, b, out, alpha, stream);
  return out;
}

Tensor run_mul(const TensorView& a, double scalar, const Stream& stream = {}) {
  Tensor out(a.shape(), a.dtype(), a.device(), stream);
  mul(a, scalar, out, stream);
  return out;
}

template <typename F>
Tensor on_reference(F&& f) {
  ForceKernelBackend force(KernelBackend::Reference);
  return f();
}

// What the header defines, computed here element by element from CPU tensors of any strides:
// round_T(fma(C(alpha), C(b), C(a))) and round_T(C(a) * C(scalar)), C = fp32 (f64: double).
Tensor expected_add(const TensorView& a, const TensorView& b, double alpha) {
  const std::vector<double> x = values(a), y = values(b);
  Tensor f64(a.shape(), DType::F64), out(a.shape(), a.dtype());
  for (std::size_t i = 0; i < x.size(); ++i)
    f64.data_ptr<double>()[i] =
        a.dtype() == DType::F64
            ? std::fma(alpha, y[i], x[i])
            : std::fma(static_cast<float>(alpha), static_cast<float>(y[i]),
                       static_cast<float>(x[i]));  // a float: copy() rounds it once, as kernels do
  copy(f64, out);
  return out;
}

Tensor expected_mul(const TensorView& a, double scalar) {
  const std::vector<double> x = values(a);
  Tensor f64(a.shape(), DType::F64), out(a.shape(), a.dtype());
  for (std::size_t i = 0; i < x.size(); ++i)
    f64.data_ptr<double>()[i] = a.dtype() == DType::F64
                                    ? x[i] * scalar
                                    : static_cast<float>(x[i]) * static_cast<float>(scalar);
  copy(f64, out);
  return out;
}

// The target's add and mul on dev_a and dev_b (the values of the CPU views a and b, with the same
// strides) equal bitwise the reference on a and b.
void expect_bitwise_reference(const test::Target& target, const TensorView& a, const TensorView& b,
                              const TensorView& dev_a, const TensorView& dev_b,
                              const Stream& stream) {
  for (const double alpha : {1.0, 0.1, -2.5}) {
    SCOPED_TRACE(::testing::Message() << "alpha " << alpha);
    const Tensor ref = on_reference([&] { return run_add(a, b, alpha); });
    ForceKernelBackend force(target.backend);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(run_add(dev_a, dev_b, alpha, stream), stream), ref))
        << "add";
  }
  const Tensor ref = on_reference([&] { return run_mul(a, 1.0 / 3.0); });
  ForceKernelBackend force(target.backend);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(run_mul(dev_a, 1.0 / 3.0, stream), stream), ref))
      << "mul";
}

// t's values in a strided view, view_of(storage), on the CPU and on `device`: storage (of
// `storage_shape`, zeros elsewhere) is filled so that the view holds t, then copied.
struct Strided {
  Tensor host_storage, storage;
  TensorView host, view;
};
template <typename V>
Strided strided_on(const TensorView& t, const Shape& storage_shape, V&& view_of, Device device,
                   const Stream& stream) {
  Strided s{Tensor::zeros(storage_shape, t.dtype()), {}, {}, {}};
  s.host = view_of(s.host_storage.view());
  copy(t, s.host);
  s.storage = on(s.host_storage, device, stream);
  s.view = view_of(s.storage.view());
  return s;
}

// The optimised backends (cpu, cuda) against the reference on the CPU.
class ElementwiseBackends : public ::testing::TestWithParam<test::OpCase> {};

// 1, 7, 1025, 4103: not multiples of any vector width (the CUDA tail, the cpu loop's remainder);
// 8 and 4104: whole 16-byte vectors; 70001: several OpenMP threads and CUDA blocks.
TEST_P(ElementwiseBackends, MatchBitwiseTheReferenceAtOddAndVectorSizes) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (std::int64_t n : {1, 7, 8, 1025, 4103, 4104, 70001}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const Tensor a = randn({n}, dtype, 1, 3.0), b = randn({n}, dtype, 2);
    expect_bitwise_reference(target, a, b, on(a, target.device, stream),
                             on(b, target.device, stream), stream);
  }
  const Tensor a = randn({2, 3, 17}, dtype, 3), b = randn({2, 3, 17}, dtype, 4);
  expect_bitwise_reference(target, a, b, on(a, target.device, stream), on(b, target.device, stream),
                           stream);
}

// Strided inputs are read through their strides by every backend (copied contiguous first only
// past six merged dimensions).
TEST_P(ElementwiseBackends, StridedInputsMatchBitwiseTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Tensor a = randn({33, 70}, dtype, 5), b = randn({33, 70}, dtype, 6);
  const auto transposed = [](const TensorView& s) { return s.transpose(0, 1); };
  const auto every_other_column = [](const TensorView& s) {
    return TensorView(s.data(), s.dtype(), {33, 70}, {140, 2}, s.device());
  };
  const auto reversed_rows = [](const TensorView& s) {  // negative row stride
    const std::int64_t e = static_cast<std::int64_t>(element_size(s.dtype()));
    return TensorView(static_cast<char*>(s.data()) + 32 * 70 * e, s.dtype(), {33, 70}, {-70, 1},
                      s.device());
  };
  const Strided at = strided_on(a, {70, 33}, transposed, d, stream),
                bt = strided_on(b, {70, 33}, transposed, d, stream),
                a2 = strided_on(a, {33, 140}, every_other_column, d, stream),
                br = strided_on(b, {33, 70}, reversed_rows, d, stream);
  {
    SCOPED_TRACE("a transposed, b contiguous");
    expect_bitwise_reference(target, at.host, b, at.view, on(b, d, stream), stream);
  }
  {
    SCOPED_TRACE("both transposed");
    expect_bitwise_reference(target, at.host, bt.host, at.view, bt.view, stream);
  }
  {
    SCOPED_TRACE("a every other column, b rows reversed");
    expect_bitwise_reference(target, a2.host, br.host, a2.view, br.view, stream);
  }
  // Broadcast through zero strides: b one row (stride 0 over rows), a one value.
  const Tensor row = on(randn({70}, dtype, 7), d, stream),
               one = on(randn({1}, dtype, 8), d, stream);
  const TensorView rows(row.view().data(), dtype, {33, 70}, {0, 1}, d),
      everywhere(one.view().data(), dtype, {33, 70}, {0, 0}, d);
  const Tensor host_row = to_cpu(row, stream), host_one = to_cpu(one, stream);
  {
    SCOPED_TRACE("zero strides");
    expect_bitwise_reference(target, TensorView(host_one.view().data(), dtype, {33, 70}, {0, 0}),
                             TensorView(host_row.view().data(), dtype, {33, 70}, {0, 1}),
                             everywhere, rows, stream);
  }
  // Seven dimensions of size 2 that cannot merge (strides 3^k): more than the kernels index, so
  // the front-end copies the input contiguous first.
  Shape shape(7, 2), strides(7);
  for (std::int64_t k = 6, s = 1; k >= 0; --k, s *= 3) strides[k] = s;
  const Tensor c = randn(shape, dtype, 9), e = randn(shape, dtype, 10);
  const Strided c7 = strided_on(
      c, {2187},
      [&](const TensorView& s) {
        return TensorView(s.data(), s.dtype(), shape, strides, s.device());
      },
      d, stream);
  {
    SCOPED_TRACE("seven dimensions");
    expect_bitwise_reference(target, c7.host, e, c7.view, on(e, d, stream), stream);
  }
}

// Views starting one element into their storage are not 16-byte aligned: CUDA takes its
// element-wise path.
TEST_P(ElementwiseBackends, UnalignedContiguousInputsMatchBitwiseTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor a = randn({1001}, dtype, 11), b = randn({1001}, dtype, 12);
  const Tensor dev_a = on(a, target.device, stream), dev_b = on(b, target.device, stream);
  expect_bitwise_reference(target, a.view().narrow(0, 1, 1000), b.view().narrow(0, 1, 1000),
                           dev_a.view().narrow(0, 1, 1000), dev_b.view().narrow(0, 1, 1000),
                           stream);
}

INSTANTIATE_TEST_SUITE_P(, ElementwiseBackends,
                         ::testing::ValuesIn(test::op_cases(test::kernel_targets())),
                         test::op_case_name);

// Every backend, the reference included (on the CPU and on CUDA tensors through host copies).
class ElementwiseEveryBackend : public ::testing::TestWithParam<test::OpCase> {};

// The definition, computed here, and within a few ulps of the exact result in double; alpha = 0.1
// is not a binary fraction, so its rounding to fp32 (f64: none) shows.
TEST_P(ElementwiseEveryBackend, GivesTheDefinedFmaAndProductCloseToDoubleResults) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor a = randn({1025}, dtype, 13, 2.0), b = randn({1025}, dtype, 14, 5.0);
  const Tensor dev_a = on(a, target.device, stream), dev_b = on(b, target.device, stream);
  ForceKernelBackend force(target.backend);
  for (const double alpha : {1.0, 0.1, -3.0}) {
    SCOPED_TRACE(::testing::Message() << "alpha " << alpha);
    const Tensor out = to_cpu(run_add(dev_a, dev_b, alpha, stream), stream);
    EXPECT_TRUE(testing::bitwise_equal(out, expected_add(a, b, alpha)));
    const std::vector<double> x = values(a), y = values(b);
    Tensor exact({1025}, DType::F64);
    for (std::size_t i = 0; i < x.size(); ++i) exact.data_ptr<double>()[i] = x[i] + alpha * y[i];
    expect_close(out, exact, testing::default_tolerance(dtype), "add against double");
  }
  const Tensor out = to_cpu(run_mul(dev_a, 0.1, stream), stream);
  EXPECT_TRUE(testing::bitwise_equal(out, expected_mul(a, 0.1)));
  const std::vector<double> x = values(a);
  Tensor exact({1025}, DType::F64);
  for (std::size_t i = 0; i < x.size(); ++i) exact.data_ptr<double>()[i] = x[i] * 0.1;
  expect_close(out, exact, testing::default_tolerance(dtype), "mul against double");
}

// out is a (or b) itself: gradient accumulation, grad += g.
TEST_P(ElementwiseEveryBackend, InPlaceIntoEitherInputGivesTheOutOfPlaceResult) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{7}, Shape{64, 513}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor a = on(randn(shape, dtype, 15), d, stream),
                 b = on(randn(shape, dtype, 16), d, stream);
    const Tensor sum = to_cpu(run_add(a, b, 0.1, stream), stream);
    const Tensor product = to_cpu(run_mul(a, -0.75, stream), stream);
    const Tensor into_a = a.clone(stream), into_b = b.clone(stream);
    add(into_a, b, into_a, 0.1, stream);
    add(a, into_b, into_b, 0.1, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(into_a, stream), sum)) << "out is a";
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(into_b, stream), sum)) << "out is b";
    const Tensor scaled = a.clone(stream);
    mul(scaled, -0.75, scaled, stream);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(scaled, stream), product)) << "mul in place";
    const Tensor doubled = a.clone(stream);  // a + a into a: all three the same
    add(doubled, doubled, doubled, 1.0, stream);
    EXPECT_TRUE(
        testing::bitwise_equal(to_cpu(doubled, stream), to_cpu(run_mul(a, 2.0, stream), stream)))
        << "a + a";
  }
}

// Nothing to compute and nothing launched; a 0-d tensor is one element.
TEST_P(ElementwiseEveryBackend, EmptyAndZeroDimensionalTensors) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  ForceKernelBackend force(target.backend);
  for (const Shape& shape : {Shape{0}, Shape{0, 16}, Shape{3, 0, 2}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor e(shape, dtype, target.device, stream);
    EXPECT_EQ(run_add(e, e, 0.5, stream).shape(), shape);
    EXPECT_EQ(run_mul(e, 0.5, stream).shape(), shape);
    add(e, e, e, 1.0, stream);
  }
  const Tensor a = on(from({}, dtype, {1.5}), target.device, stream),
               b = on(from({}, dtype, {-4.0}), target.device, stream);
  EXPECT_EQ(values(to_cpu(run_add(a, b, 0.25, stream), stream)), std::vector<double>{0.5});
  EXPECT_EQ(values(to_cpu(run_mul(b, 0.25, stream), stream)), std::vector<double>{-1.0});
}

INSTANTIATE_TEST_SUITE_P(, ElementwiseEveryBackend,
                         ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);

// Known values, on every backend.
class ElementwiseTargets : public ::testing::TestWithParam<test::Target> {};

// Values torch 2.15 gives on the CPU (torch.add(x, y, alpha=...), torch.mul(x, s)), where an
// fma and a separate product and sum differ, or where the scalar's rounding shows.
TEST_P(ElementwiseTargets, MatchTorchOnValuesWhereRoundingsDiffer) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  ForceKernelBackend force(target.backend);
  const auto add1 = [&](DType dtype, double x, double y, double alpha) {
    return values(to_cpu(run_add(on(from({1}, dtype, {x}), d, stream),
                                 on(from({1}, dtype, {y}), d, stream), alpha, stream),
                         stream))[0];
  };
  const auto mul1 = [&](DType dtype, double x, double s) {
    return values(to_cpu(run_mul(on(from({1}, dtype, {x}), d, stream), s, stream), stream))[0];
  };
  // fma(0.1f, 10.1f, -5): a product rounded first gives -3.989999771118164.
  EXPECT_EQ(add1(DType::F32, -5.0, 10.1, 0.1), static_cast<double>(-3.990000009536743f));
  // fma(0.1, 10.1, -5) in double: a product rounded first gives -3.99.
  EXPECT_EQ(add1(DType::F64, -5.0, 10.1, 0.1), -3.9899999999999998);
  // 16-bit rounded once from 0.0625 + 16.3125 = 16.375 (bf16) and 1.5 + 4101 = 4102.5 (f16);
  // rounding 3 * b to the dtype first (torch's strided loop) gives 16.25 and 4100.
  EXPECT_EQ(add1(DType::BF16, 0.0625, 5.4375, 3.0), 16.375);
  EXPECT_EQ(add1(DType::F16, 1.5, 1367.0, 3.0), 4104.0);
  // The scalar in fp32: 0.1 rounded to f32 (in double: -0.44999998807907104), to bf16
  // (-0.451171875) or to f16 (-0.4873046875) gives other values.
  EXPECT_EQ(mul1(DType::F32, -4.5, 0.1), static_cast<double>(-0.45000001788139343f));
  EXPECT_EQ(mul1(DType::BF16, -4.5, 0.1), -0.44921875);
  EXPECT_EQ(mul1(DType::F16, -4.875, 0.1), -0.487548828125);
}

TEST_P(ElementwiseTargets, KnownValuesAndNonFiniteOnesLikeTorch) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const Tensor a = on(from({6}, DType::F32, {1, 2, inf, inf, nan, 3}), d, stream),
               b = on(from({6}, DType::F32, {4, -5, -inf, 1, 1, inf}), d, stream);
  ForceKernelBackend force(target.backend);
  // torch.add(a, b, alpha=0.5): [3, -0.5, nan, inf, nan, inf]; with alpha=0: 0 * inf = nan.
  const std::vector<double> half = values(to_cpu(run_add(a, b, 0.5, stream), stream));
  EXPECT_EQ(half[0], 3.0);
  EXPECT_EQ(half[1], -0.5);
  EXPECT_TRUE(std::isnan(half[2]));
  EXPECT_EQ(half[3], inf);
  EXPECT_TRUE(std::isnan(half[4]));
  EXPECT_EQ(half[5], inf);
  const std::vector<double> zero = values(to_cpu(run_add(a, b, 0.0, stream), stream));
  EXPECT_EQ(zero[0], 1.0);
  EXPECT_TRUE(std::isnan(zero[5]));
  // torch.mul(a, -2): [-2, -4, -inf, -inf, nan, -6]; 1/count of a loss: 6 / 3 = 2.
  const std::vector<double> m = values(to_cpu(run_mul(a, -2.0, stream), stream));
  EXPECT_EQ(m[0], -2.0);
  EXPECT_EQ(m[2], -inf);
  EXPECT_TRUE(std::isnan(m[4]));
  EXPECT_EQ(m[5], -6.0);
  const Tensor loss = on(from({}, DType::F64, {6.0}), d, stream);
  EXPECT_EQ(values(to_cpu(run_mul(loss, 1.0 / 3.0, stream), stream))[0], 2.0);
}

INSTANTIATE_TEST_SUITE_P(, ElementwiseTargets, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

// Every 16-bit value (NaNs, infinities, subnormals) through the cpu backend's contiguous loops
// (f16: F16C conversions, bf16: the compiler's) and its strided ones, bitwise as the reference.
TEST(Elementwise, EverySixteenBitValueGivesTheReferenceBits) {
  for (const DType dtype : {DType::F16, DType::BF16}) {
    SCOPED_TRACE(to_string(dtype));
    Tensor a({65536}, dtype);
    auto* bits = static_cast<std::uint16_t*>(a.view().data());
    for (std::uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<std::uint16_t>(i);
    const Tensor b = randn({65536}, dtype, 17),
                 reversed = Tensor::copy_of(TensorView(
                     static_cast<std::uint16_t*>(b.view().data()) + 65535, dtype, {65536}, {-1}));
    const TensorView b_backwards(static_cast<std::uint16_t*>(reversed.view().data()) + 65535, dtype,
                                 {65536}, {-1});  // b's values, read with stride -1
    for (const double alpha : {1.0, 0.1}) {
      const Tensor ref = on_reference([&] { return run_add(a, b, alpha); });
      EXPECT_TRUE(testing::bitwise_equal(run_add(a, b, alpha), ref)) << "add, alpha " << alpha;
      EXPECT_TRUE(testing::bitwise_equal(run_add(a, b_backwards, alpha), ref))
          << "add strided, alpha " << alpha;
    }
    for (const double scalar : {1.0, -0.3}) {
      const Tensor ref = on_reference([&] { return run_mul(a, scalar); });
      EXPECT_TRUE(testing::bitwise_equal(run_mul(a, scalar), ref)) << "mul " << scalar;
    }
  }
}

TEST(Elementwise, AddAndMulAreRegisteredOnEveryBackendForEveryFloatDType) {
  int tables = 0;
  for (const KernelInfo& k : registered_kernels()) {
    if (k.op != "add" && k.op != "mul") continue;
    EXPECT_EQ(k.dtypes.size(), test::kFloatDTypes.size()) << k.op << " " << to_string(k.backend);
    ++tables;
  }
  EXPECT_GE(tables, 4);  // reference and cpu (and cuda) of each
}

TEST(Elementwise, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor a = randn({2, 8}, DType::F32, 1), b16 = randn({2, 8}, DType::BF16, 2),
               b9 = randn({2, 9}, DType::F32, 3), out({2, 8}, DType::F32);
  test::expect_error([&] { add(a, b16, out); }, ErrorCode::DTypeMismatch,
                     {"add", "'b'", "f32", "bf16"});
  test::expect_error([&] { add(a, b9, out); }, ErrorCode::ShapeMismatch,
                     {"add", "'b'", "[2, 8]", "[2, 9]"});
  test::expect_error([&] { add(a, TensorView{}, out); }, ErrorCode::InvalidArgument,
                     {"add", "'b'", "required"});
  Tensor out9({2, 9}, DType::F32), out16({2, 8}, DType::F16);
  test::expect_error([&] { add(a, a, out9); }, ErrorCode::ShapeMismatch,
                     {"add", "'out'", "[2, 8]", "[2, 9]"});
  test::expect_error([&] { add(a, a, out16); }, ErrorCode::DTypeMismatch,
                     {"add", "'out'", "f32", "f16"});
  test::expect_error([&] { mul(a, 2.0, out9); }, ErrorCode::ShapeMismatch,
                     {"mul", "'out'", "[2, 8]", "[2, 9]"});
  test::expect_error([&] { mul(a, 2.0, out16); }, ErrorCode::DTypeMismatch,
                     {"mul", "'out'", "f32", "f16"});
  const Tensor ints = Tensor::zeros({2, 8}, DType::I64);
  test::expect_error([&] { add(ints, ints, ints); }, ErrorCode::DTypeMismatch,
                     {"add", "'a'", "i64"});
  test::expect_error([&] { mul(ints, 2.0, ints); }, ErrorCode::DTypeMismatch,
                     {"mul", "'a'", "i64"});
  Tensor wide({8, 2}, DType::F32);
  test::expect_error([&] { add(a, a, wide.view().transpose(0, 1)); }, ErrorCode::InvalidArgument,
                     {"add", "'out'", "contiguous"});
  test::expect_error([&] { mul(a, 2.0, wide.view().transpose(0, 1)); }, ErrorCode::InvalidArgument,
                     {"mul", "'out'", "contiguous"});
}

// Writing out could change input elements yet to be read: only the very same view may be shared.
TEST(Elementwise, OutPartlyOverlappingAnInputIsAnError) {
  Tensor buf = randn({20}, DType::F32, 4);
  const TensorView first = buf.view().narrow(0, 0, 16), shifted = buf.view().narrow(0, 1, 16);
  const Tensor other = randn({16}, DType::F32, 5);
  test::expect_error([&] { add(other, shifted, first); }, ErrorCode::InvalidArgument,
                     {"add", "'out'", "overlaps", "'b'"});
  test::expect_error([&] { add(shifted, other, first); }, ErrorCode::InvalidArgument,
                     {"add", "'out'", "overlaps", "'a'"});
  test::expect_error([&] { mul(shifted, 2.0, first); }, ErrorCode::InvalidArgument,
                     {"mul", "'out'", "overlaps", "'a'"});
  // The same data read transposed is another view of out's elements.
  Tensor square = randn({4, 4}, DType::F32, 6);
  test::expect_error([&] { add(square.view().transpose(0, 1), square, square); },
                     ErrorCode::InvalidArgument, {"add", "'out'", "overlaps", "'a'"});
  // Next to each other, not overlapping: fine.
  add(buf.view().narrow(0, 0, 10), buf.view().narrow(0, 0, 10), buf.view().narrow(0, 10, 10));
}

// The merged layout: dims of size 1 dropped, neighbours merged where every input allows, and
// offsets of elements past 2^31 in 64 bits (no memory is touched: the layout is arithmetic).
TEST(Elementwise, LayoutMergesDimensionsAndIndexesPast2To31In64Bits) {
  float dummy = 0;
  const auto layout = [](std::initializer_list<TensorView> views) {
    const std::vector<TensorView> v(views);
    return detail::elementwise_layout(v);
  };
  const TensorView contiguous(&dummy, DType::F32, {4, 1, 5, 6});
  auto l = layout({contiguous, contiguous});
  ASSERT_TRUE(l);
  EXPECT_EQ(l->shape.dims, 1);
  EXPECT_EQ(l->shape.sizes[0], 120);
  EXPECT_TRUE(l->inputs[0].linear && l->inputs[1].linear);
  // A transposed input keeps two dimensions; the contiguous one is still linear.
  const TensorView t(&dummy, DType::F32, {6, 20}, {1, 6}), c(&dummy, DType::F32, {6, 20});
  l = layout({c, t});
  ASSERT_TRUE(l);
  EXPECT_EQ(l->shape.dims, 2);
  EXPECT_TRUE(l->inputs[0].linear);
  EXPECT_FALSE(l->inputs[1].linear);
  EXPECT_EQ(l->inputs[1].strides[0], 1);
  EXPECT_EQ(l->inputs[1].strides[1], 6);
  // (4, 2^31) elements with strides (2^32, -2): element (3, 2^31 - 1) has index 2^33 - 1.
  const std::int64_t big = std::int64_t{1} << 31;
  const TensorView huge(&dummy, DType::BF16, {4, big}, {2 * big, -2});
  l = layout({huge});
  ASSERT_TRUE(l);
  EXPECT_EQ(l->shape.numel, 4 * big);
  EXPECT_EQ(detail::element_offset(l->shape, l->inputs[0], 4 * big - 1),
            3 * 2 * big - 2 * (big - 1));
  // Strides 2^32 and 2^31 over sizes (4, 2) merge into one dimension of stride 2^31.
  const TensorView merged(&dummy, DType::BF16, {4, 2, 1}, {2 * big, big, 7});
  l = layout({merged});
  ASSERT_TRUE(l);
  EXPECT_EQ(l->shape.dims, 1);
  EXPECT_EQ(detail::element_offset(l->shape, l->inputs[0], 7), 7 * big);
  // Empty: one dimension of 0 elements.
  l = layout({TensorView(&dummy, DType::F32, {3, 0, 2})});
  ASSERT_TRUE(l);
  EXPECT_EQ(l->shape.numel, 0);
}

// bf16 tensors of 2^31 + 9 elements (4 GiB): the vector loop and its tail, and the strided loop,
// index past 2^31 (a 0-stride b takes the strided kernel).
TEST(CudaElementwise, ElementsPast2To31AreIndexedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  const std::int64_t n = (std::int64_t{1} << 31) + 9;
  std::optional<Tensor> x;
  try {
    x.emplace(Tensor::zeros({n}, DType::BF16, test::kCuda, stream));
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  const TensorView last = x->view().narrow(0, n - 12, 12);
  copy(from({12}, DType::BF16, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), last, stream);
  mul(*x, 2.0, *x, stream);
  const Tensor one = on(from({1}, DType::BF16, {0.5}), test::kCuda, stream);
  add(*x, TensorView(one.view().data(), DType::BF16, {n}, {0}, test::kCuda), *x, 2.0, stream);
  // 2 v + 1 for the last twelve; 1 for the zeros before them (element 0 and element n - 13).
  EXPECT_EQ(values(to_cpu(last, stream)),
            (std::vector<double>{3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25}));
  EXPECT_EQ(values(to_cpu(x->view().narrow(0, n - 13, 1), stream)), std::vector<double>{1});
  EXPECT_EQ(values(to_cpu(x->view().narrow(0, 0, 1), stream)), std::vector<double>{1});
}

}  // namespace
}  // namespace meshfuse
