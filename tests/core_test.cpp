#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_error;

TEST(DType, Bf16RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(to_bfloat16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(to_bfloat16(1.00390625f).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(to_bfloat16(1.01171875f).bits, 0x3f82);
  EXPECT_EQ(to_bfloat16(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_EQ(to_bfloat16(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_TRUE(std::isnan(to_float(to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not round to inf.
  EXPECT_TRUE(std::isnan(to_float(to_bfloat16(std::bit_cast<float>(0x7f800001u)))));
  // The largest float rounds to inf in bf16 (RNE), like PyTorch.
  EXPECT_TRUE(std::isinf(to_float(to_bfloat16(std::numeric_limits<float>::max()))));
}

// The compiler's own binary16 conversion, the oracle of the two tests below where it exists.
#if defined(__aarch64__)
using CompilerHalf = __fp16;
#elif defined(__FLT16_MAX__)
using CompilerHalf = _Float16;
#endif

TEST(DType, F16ToFloatMatchesTheCompilersConversionForEveryHalf) {
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = to_float(float16{h});
    ASSERT_EQ(std::bit_cast<std::uint32_t>(half_bits_to_float(h)), std::bit_cast<std::uint32_t>(f));
    ASSERT_EQ(to_float16(f).bits, std::isnan(f) ? (h | 0x200u) : h) << "round trip " << bits;
    if (std::isnan(f))  // quiet, with the half's sign and payload (F16C's and Arm's rule)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(f), (std::uint32_t{h & 0x8000u} << 16) | 0x7fc00000u |
                                                     (std::uint32_t{h & 0x3ffu} << 13))
          << bits;
#ifdef __FLT16_MAX__  // the same bits as the compiler's conversion, NaNs included
    const auto compiler = static_cast<float>(std::bit_cast<CompilerHalf>(h));
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f), std::bit_cast<std::uint32_t>(compiler)) << bits;
#endif
  }
}

TEST(DType, FloatToF16MatchesTheCompilersConversionAcrossTheFloats) {
  // Every 1021st float (all exponents, both signs, NaNs, a spread of low bits), then the floats
  // around each half's rounding boundaries: the ties and their neighbours.
  std::vector<float> floats;
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 1021)
    floats.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  for (std::uint32_t h = 0; h < 0x7c00u; ++h) {
    const float lo = half_bits_to_float(static_cast<std::uint16_t>(h));
    const float hi =
        h + 1 == 0x7c00u ? 65536.0f : half_bits_to_float(static_cast<std::uint16_t>(h + 1));
    const auto mid = std::bit_cast<std::uint32_t>(static_cast<float>((double(lo) + hi) / 2));
    for (std::uint32_t u : {mid - 1, mid, mid + 1}) {
      floats.push_back(std::bit_cast<float>(u));
      floats.push_back(-std::bit_cast<float>(u));
    }
  }
  for (const float f : floats) {
    const std::uint16_t bits = to_float16(f).bits;
    ASSERT_EQ(float_to_half_bits(f), bits);
#ifdef __FLT16_MAX__  // NaNs included: quietened, their sign and top payload bits kept
    const auto compiler = std::bit_cast<std::uint16_t>(static_cast<CompilerHalf>(f));
    ASSERT_EQ(bits, compiler) << std::bit_cast<std::uint32_t>(f);
#endif
  }
}

TEST(DType, F16RoundsToNearestEvenIncludingSubnormalsAndOverflow) {
  // Halfway cases between consecutive halves.
  for (std::uint16_t h : {std::uint16_t{0x0001}, std::uint16_t{0x03ff}, std::uint16_t{0x3c00},
                          std::uint16_t{0x3c01}, std::uint16_t{0x7bfe}}) {
    const double lo = half_bits_to_float(h), hi = half_bits_to_float(h + 1);
    const auto mid = static_cast<float>((lo + hi) / 2);
    const std::uint16_t even = (h & 1) ? h + 1 : h;
    EXPECT_EQ(to_float16(mid).bits, even) << h;
  }
  EXPECT_EQ(to_float16(65520.0f).bits, 0x7c00);  // rounds up to inf
  EXPECT_EQ(to_float16(65519.0f).bits, 0x7bff);  // max half
  EXPECT_EQ(to_float16(-std::numeric_limits<float>::infinity()).bits, 0xfc00);
  EXPECT_EQ(to_float16(0x1p-25f).bits, 0x0000);  // a tie below the least subnormal
  EXPECT_EQ(to_float16(std::nextafter(0x1p-25f, 1.0f)).bits, 0x0001);
  EXPECT_EQ(to_float16(-0.0f).bits, 0x8000);
  EXPECT_EQ(to_float16(std::numeric_limits<float>::quiet_NaN()).bits & 0x7e00u, 0x7e00u);
  EXPECT_EQ(to_float16(-std::bit_cast<float>(0x7f800001u)).bits,
            0xfe00);  // low payload: NaN, not inf
}

TEST(DType, FromDoubleRoundsOnceToBf16) {
  // 1 + 2^-8 + 2^-40 is just above the bf16 tie: a direct rounding goes up; rounding to float
  // first (to 1 + 2^-8, a tie) and then to bf16 would go down to 1.
  const double x = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  EXPECT_EQ(from_double<bfloat16>(x).bits, 0x3f81);
}

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64,
                  DType::U8, DType::U32, DType::Bool})
    EXPECT_EQ(parse_dtype(to_string(d)), d);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::BF16);
  EXPECT_FALSE(parse_dtype("f8").has_value());
}

TEST(DType, U32IsFourBytesNamedU32OrUint32) {
  EXPECT_EQ(element_size(DType::U32), 4u);
  EXPECT_EQ(to_string(DType::U32), "u32");
  EXPECT_EQ(parse_dtype("u32"), DType::U32);
  EXPECT_EQ(parse_dtype("uint32"), DType::U32);
  static_assert(dtype_of<std::uint32_t>() == DType::U32);
}

TEST(Device, ParsesAndPrints) {
  EXPECT_EQ(Device::parse("cuda:3"), (Device{DeviceType::CUDA, 3}));
  EXPECT_EQ(Device::parse("cpu").str(), "cpu");
  expect_error([] { Device::parse("tpu"); }, ErrorCode::InvalidArgument, {"device", "tpu"});
  expect_error([] { Device::parse("cuda:-1"); }, ErrorCode::InvalidArgument, {"cuda:-1"});
}

TEST(Tensor, ViewsShareMemoryAndIndexIn64Bits) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  TensorView tt = t.view().transpose(0, 1);
  EXPECT_EQ(tt.shape(), (Shape{3, 2}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.data(), t.view().data());
  // No elements: contiguous whatever the strides (NumPy gives an empty array's dims stride 0).
  EXPECT_TRUE(TensorView(nullptr, DType::F32, {0, 7}, {0, 0}).is_contiguous());
  EXPECT_TRUE(TensorView(nullptr, DType::F32, {7, 0}, {0, 0}).is_contiguous());
  // A view of 2^33 bytes: strides and offsets stay exact in int64 (no buffer is touched).
  char dummy = 0;
  TensorView huge(&dummy, DType::BF16, {1 << 20, 1 << 13});
  EXPECT_EQ(huge.numel(), std::int64_t{1} << 33);
  EXPECT_EQ(huge.stride(0), 1 << 13);
  const TensorView tail = huge.narrow(0, (1 << 20) - 1, 1);
  EXPECT_EQ(static_cast<char*>(tail.data()) - &dummy, ((std::int64_t{1} << 20) - 1) * 8192 * 2);
  expect_error([&] { huge.reshape({3, -1}); }, ErrorCode::ShapeMismatch, {"reshape"});
  expect_error([] { Tensor({-1, 2}, DType::F32); }, ErrorCode::InvalidArgument, {">= 0", "-1"});
}

// CPU buffers of 32 MiB or more start on a 2 MiB boundary (transparent huge pages, advised);
// smaller ones on 64 bytes. Nothing is touched.
TEST(Tensor, LargeCpuBuffersAreAlignedToHugePages) {
  const auto address = [](const Tensor& t) {
    return reinterpret_cast<std::uintptr_t>(t.view().data());
  };
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(address(Tensor({32 << 20}, DType::U8)) % (2 << 20), 0u);
    EXPECT_EQ(address(Tensor({(8 << 20) + 3}, DType::F32)) % (2 << 20), 0u);
    EXPECT_EQ(address(Tensor({1000}, DType::U8)) % 64, 0u);
  }
  // A byte count past the address space is refused before any arithmetic wraps.
  expect_error([] { Tensor({std::int64_t{1} << 62}, DType::F64); }, ErrorCode::OutOfMemory,
               {"Tensor", "4611686018427387904 elements", "f64", "address space"});
}

TEST(KernelBackend, NamesParseInAnyCaseAndAnUnknownOneListsTheValidOnes) {
  // One rule for every enum's names (core/names.h).
  EXPECT_EQ(parse_kernel_backend("CPU"), KernelBackend::CPU);
  EXPECT_EQ(parse_kernel_backend("Reference"), KernelBackend::Reference);
  EXPECT_EQ(parse_overlap("RING"), Overlap::Ring);
  test::expect_error(
      [] { parse_kernel_backend("fast"); }, ErrorCode::InvalidArgument,
      {"kernel backend: unknown name 'fast' (expected one of reference, cpu, cuda)"});
  test::expect_error([] { parse_overlap("cpu"); }, ErrorCode::InvalidArgument,
                     {"overlap: unknown name 'cpu' (expected one of none, collective, ring)"});
  test::expect_error([] { parse_overlap(""); }, ErrorCode::InvalidArgument,
                     {"overlap: unknown name ''"});
}

TEST(KernelBackend, ForcedBackendNestsRestoresAndIsPerThread) {
  EXPECT_FALSE(forced_kernel_backend().has_value());
  {
    ForceKernelBackend outer(KernelBackend::Reference);
    {
      ForceKernelBackend inner(KernelBackend::CPU);
      EXPECT_EQ(forced_kernel_backend(), KernelBackend::CPU);
      std::optional<KernelBackend> other = KernelBackend::CUDA;
      std::thread([&] { other = forced_kernel_backend(); }).join();
      EXPECT_FALSE(other.has_value());
    }
    EXPECT_EQ(forced_kernel_backend(), KernelBackend::Reference);
    try {
      ForceKernelBackend thrown(KernelBackend::CUDA);
      throw std::runtime_error("unwind");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(forced_kernel_backend(), KernelBackend::Reference);
  }
  EXPECT_FALSE(forced_kernel_backend().has_value());
}

TEST(KernelBackend, ForcedReferenceResolvesAndMixedDevicesAreAnErrorNamingThem) {
  Tensor x = Tensor::zeros({2, 4}, DType::F32);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    EXPECT_EQ(resolved_backend("swiglu", {{"gate", x}}), KernelBackend::Reference);
  }
  char dummy = 0;
  TensorView on_gpu(&dummy, DType::F32, {2, 4}, Device{DeviceType::CUDA, 1});
  expect_error(
      [&] {
        resolved_backend("swiglu", {{"gate", x}, {"up", on_gpu}});
      },
      ErrorCode::DeviceMismatch, {"swiglu", "gate", "cpu", "up", "cuda:1"});
}

TEST(KernelBackend, BackendWithoutTheDtypeIsAnErrorNamingIt) {
  Tensor labels = Tensor::zeros({4}, DType::I32);
  expect_error(
      [&] {
        resolved_backend("swiglu", {{"gate", labels}});
      },
      ErrorCode::Unsupported, {"swiglu", "cpu", "i32", "gate"});
}

TEST(KernelBackend, RegistryListsEveryOpOnReferenceAndCpu) {
  bool reference = false, cpu = false;
  for (const KernelInfo& k : registered_kernels()) {
    if (k.op != "swiglu") continue;
    reference |= k.backend == KernelBackend::Reference;
    cpu |= k.backend == KernelBackend::CPU;
  }
  EXPECT_TRUE(reference && cpu);
}

// Tensors and backend resolution on each device: cpu, and cuda:0 (skipped without a GPU), with the
// device's backend.
class CoreOnDevices : public ::testing::TestWithParam<test::Target> {};

TEST_P(CoreOnDevices, RoundTripThroughTheDeviceIsBitwiseForEveryDtype) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (DType d : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
    const Tensor a = test::randn({37, 41}, d, 1);
    EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(test::on(a, target.device, stream), stream), a))
        << to_string(d);
  }
  Tensor labels({1000}, DType::I64);
  testing::fill_uniform_int(labels, 2, -(std::int64_t{1} << 60), std::int64_t{1} << 60);
  EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(test::on(labels, target.device, stream), stream),
                                     labels));
}

TEST_P(CoreOnDevices, CopiesConvertDtypesAndStridesLikeTheHost) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device device = target.device;
  const Tensor a = test::randn({33, 65}, DType::F32, 3);
  const Tensor on_device = test::on(a, device, stream);
  const TensorView a_t = a.view().transpose(0, 1);
  // Transposed view -> contiguous copy on the device, and -> contiguous host copy.
  EXPECT_TRUE(testing::bitwise_equal(
      test::to_cpu(Tensor::copy_of(on_device.view().transpose(0, 1), stream), stream), a_t));
  EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(on_device.view().transpose(0, 1), stream), a_t));
  // f32 -> bf16 on the device rounds like the host conversion.
  Tensor bf(a.shape(), DType::BF16, device, stream);
  copy(on_device, bf, stream);
  const Tensor bf_back = test::to_cpu(bf, stream);
  for (std::int64_t i = 0; i < a.numel(); ++i)
    ASSERT_EQ(bf_back.data_ptr<bfloat16>()[i].bits, to_bfloat16(a.data_ptr<float>()[i]).bits) << i;
  // Host -> strided destination on the device.
  Tensor dst = Tensor::zeros({65, 33}, DType::F32, device, stream);
  copy(a, dst.view().transpose(0, 1), stream);
  EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(dst, stream).view().transpose(0, 1), a));
}

// copy() converts contiguous floating tensors in an inlined loop: the bits of its general
// element-by-element path (here through transposed views), for every pair of floating dtypes, on
// zeros, infinities, NaN, subnormals, overflow, ties and a value that rounding through f32 first
// would get wrong in bf16 (1 + 2^-8 + 2^-40 rounds up once, to even twice).
TEST(Core, ContiguousConversionsGiveTheBitsOfTheGeneralPath) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> special = {
      0.0,    -0.0, 1.0,    -2.5,  inf,   -inf, std::nan(""),         1e-40,
      -3e-39, 6e-8, 1e-310, 65504, 65520, 1e39, 1 + 0x1p-8 + 0x1p-40, 1 + 0x1p-8,
      0.1,    -7.75};
  const auto rows = static_cast<std::int64_t>(special.size()) / 2;
  Tensor f64 = test::randn({rows + 16, 2}, DType::F64, 5);
  std::copy(special.begin(), special.end(), f64.data_ptr<double>());
  for (DType from : test::kFloatDTypes) {
    Tensor src(f64.shape(), from);
    copy(f64.view().transpose(0, 1), src.view().transpose(0, 1));
    for (DType to : test::kFloatDTypes) {
      Tensor fast(src.shape(), to), general({2, src.size(0)}, to);
      copy(src, fast);
      copy(src.view().transpose(0, 1), general);
      EXPECT_TRUE(testing::bitwise_equal(Tensor::copy_of(fast.view().transpose(0, 1)), general))
          << to_string(from) << " -> " << to_string(to);
    }
  }
}

// fill: one rounding of the value into each dtype (0.1 is 0.10009765625 in bf16, 0.0999755859375
// in f16; expected values from a copy of a double, not from fill), only the view's elements
// written (a strided column of a tensor of 7s), -0 kept as -0, a contiguous tensor of rank 9 (past
// CUDA's strided copy), and an empty view.
TEST_P(CoreOnDevices, FillRoundsTheValueOnceAndWritesOnlyTheView) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const auto filled = [](Shape shape, DType d, double v) {  // by copies of one double
    Tensor one({1}, DType::F64), t(shape, d);
    *one.data_ptr<double>() = v;
    for (std::int64_t i = 0; i < t.numel(); ++i)
      copy(one, t.view().reshape({t.numel()}).narrow(0, i, 1));
    return t;
  };
  for (DType d : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64,
                  DType::U8, DType::U32, DType::Bool}) {
    const double value = is_floating_point(d) ? 0.1 : 3;
    Tensor t = test::on(filled({5, 3}, d, 7), target.device, stream);
    fill(t.view().narrow(1, 1, 1), value, stream);
    Tensor expected = filled({5, 3}, d, 7);
    copy(filled({5, 1}, d, value), expected.view().narrow(1, 1, 1));
    EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(t, stream), expected)) << to_string(d);
    fill(t, 0.0, stream);
    EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(t, stream), filled({5, 3}, d, 0)))
        << to_string(d);
    fill(t, value, stream);  // contiguous: 15 elements, not a power of two
    EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(t, stream), filled({5, 3}, d, value)))
        << to_string(d);
  }
  Tensor bf16({3}, DType::BF16, target.device, stream), f16({3}, DType::F16, target.device, stream);
  fill(bf16, 0.1, stream);
  fill(f16, 0.1, stream);
  EXPECT_EQ(test::values(test::to_cpu(bf16, stream)), std::vector<double>(3, 0.10009765625));
  EXPECT_EQ(test::values(test::to_cpu(f16, stream)), std::vector<double>(3, 0.0999755859375));
  Tensor negative_zero = test::on(filled({4}, DType::F32, 1), target.device, stream);
  fill(negative_zero, -0.0, stream);
  for (double v : test::values(test::to_cpu(negative_zero, stream)))
    EXPECT_TRUE(v == 0 && std::signbit(v));
  Tensor deep({2, 1, 2, 1, 2, 1, 2, 1, 3}, DType::F32, target.device, stream);
  fill(deep, 2.5, stream);
  EXPECT_EQ(test::values(test::to_cpu(deep, stream)), std::vector<double>(48, 2.5));
  Tensor none({0, 3}, DType::F32, target.device, stream);
  EXPECT_NO_THROW(fill(none, 1.0, stream));
  EXPECT_NO_THROW(fill(none.view().transpose(0, 1), 1.0, stream));
}

// cu_seqlens of u32 are read through this conversion: values past 2^31 must stay positive.
TEST_P(CoreOnDevices, U32ConvertsToI64AndBackAsUnsigned) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Tensor u32({3}, DType::U32);
  const std::uint32_t values[3] = {7, 0x80000000u, 0xffffffffu};
  std::copy(values, values + 3, u32.data_ptr<std::uint32_t>());
  Tensor i64({3}, DType::I64, target.device, stream);
  copy(test::on(u32, target.device, stream), i64, stream);
  const Tensor back = test::to_cpu(i64, stream);
  EXPECT_EQ(
      std::vector<std::int64_t>(back.data_ptr<std::int64_t>(), back.data_ptr<std::int64_t>() + 3),
      (std::vector<std::int64_t>{7, std::int64_t{1} << 31, (std::int64_t{1} << 32) - 1}));
  Tensor round_trip({3}, DType::U32, target.device, stream);
  copy(i64, round_trip, stream);
  EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(round_trip, stream), u32));
  // Negative values wrap modulo 2^bits, on every device (PyTorch's -1 -> 255 for uint8).
  const Tensor minus_one = test::on(test::full({1}, DType::I32, -1), target.device, stream);
  Tensor as_u32({1}, DType::U32, target.device, stream),
      as_u8({1}, DType::U8, target.device, stream);
  copy(minus_one, as_u32, stream);
  copy(minus_one, as_u8, stream);
  EXPECT_EQ(test::to_cpu(as_u32, stream).data_ptr<std::uint32_t>()[0], 0xffffffffu);
  EXPECT_EQ(test::to_cpu(as_u8, stream).data_ptr<std::uint8_t>()[0], 255u);
}

TEST_P(CoreOnDevices, BackendFollowsTheDeviceAndForcingAnotherIsAnError) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Tensor x =
      test::on(test::randn({4, 8}, DType::F32, 5), target.device, Stream{target.device});
  EXPECT_EQ(resolved_backend("swiglu", {{"gate", x}}), target.backend);
  if (target.device.type == DeviceType::CUDA) {
    ForceKernelBackend force(KernelBackend::CPU);
    expect_error(
        [&] {
          resolved_backend("swiglu", {{"gate", x}});
        },
        ErrorCode::Unsupported, {"swiglu", "'cpu'", "cuda:0", "f32"});
  } else {
    ForceKernelBackend force(KernelBackend::CUDA);
#ifdef MESHFUSE_WITH_CUDA  // the cuda kernel exists but cannot take CPU tensors
    const ErrorCode expected = ErrorCode::Unsupported;
#else  // this build has no cuda kernels at all
    const ErrorCode expected = ErrorCode::BackendUnavailable;
#endif
    expect_error(
        [&] {
          resolved_backend("swiglu", {{"gate", x}});
        },
        expected, {"swiglu", "'cuda'", "forced", "cpu", "f32"});
  }
}

// The stream contract: an op given a stream of another device than its tensors fails before it
// writes anything, on every backend that could run the tensors; no stream is relabelled.
TEST_P(CoreOnDevices, AStreamOfAnotherDeviceIsAnErrorBeforeAnyWrite) {
  const test::Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream own{target.device};
  const Stream other = target.device.type == DeviceType::CUDA ? Stream{} : Stream{test::kCuda};
  const Tensor x = test::on(test::randn({3, 5}, DType::F32, 6), target.device, own);
  const Tensor y = test::on(test::full({3, 5}, DType::F32, 7.0), target.device, own);
  for (KernelBackend backend : {target.backend, KernelBackend::Reference}) {
    ForceKernelBackend force(backend);
    expect_error([&] { softmax(x, y, 1.0, other); }, ErrorCode::DeviceMismatch,
                 {fmt::format("softmax: the stream is on {} but the tensors are on {}",
                              other.device.str(), target.device.str())});
  }
  EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(y, own), test::full({3, 5}, DType::F32, 7.0)));
}

INSTANTIATE_TEST_SUITE_P(, CoreOnDevices, ::testing::ValuesIn(test::kernel_targets()),
                         test::target_param_name);

TEST(CudaCore, WorkOnAnExplicitStreamIsOrdered) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor a = test::randn({1 << 20}, DType::F32, 4);
  const Tensor g = test::to_cuda(a, stream);
  Tensor h = Tensor::copy_of(g, stream);
  EXPECT_TRUE(testing::bitwise_equal(test::to_cpu(h, stream), a));
}

TEST(CudaCore, AllocationOnAMissingDeviceNamesIt) {
  MESHFUSE_REQUIRE_CUDA();
  const int n = cuda_device_count();
  expect_error(
      [&] {
        Tensor({4}, DType::F32, Device{DeviceType::CUDA, n});
      },
      ErrorCode::BackendUnavailable, {"Tensor", fmt::format("cuda:{}", n)});
}

}  // namespace
}  // namespace meshfuse

namespace meshfuse {
namespace {

TEST(StreamTimer, TimesCpuWorkWithTheHostClock) {
  StreamTimer timer(Stream{});
  timer.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double ms = timer.stop();
  EXPECT_GE(ms, 19.0);
  EXPECT_LT(ms, 5000.0);
}

TEST(CudaCore, StreamTimerMeasuresDeviceTimeOfQueuedWork) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor a = Tensor::zeros({1 << 26}, DType::F32, test::kCuda, stream);  // 256 MiB
  Tensor b(a.shape(), DType::F32, test::kCuda, stream);
  StreamTimer timer(stream);
  timer.start();
  copy(a, b, stream);
  const double ms = timer.stop();
  // 512 MiB moved: more than 10 us on any GPU, less than a second.
  EXPECT_GT(ms, 0.01);
  EXPECT_LT(ms, 1000.0);
}

}  // namespace
}  // namespace meshfuse
