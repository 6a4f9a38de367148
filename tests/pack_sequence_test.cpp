// pack_sequence / unpack_sequence on every backend the build has (reference and cpu on the CPU;
// reference and cuda on CUDA tensors): torch semantics on known values, every backend against the
// reference on the CPU for every dtype, the edges and the errors. CUDA cases skip without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>

#include "meshfuse/meshfuse.h"
#include "ops/pack_sequence/pack_sequence_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::on;
using test::Target;
using test::to_cpu;
using test::values;

// The oracle: the reference backend on CPU tensors.
const Target kOracle{KernelBackend::Reference, Device{}};

// pack_sequence and unpack_sequence copy bytes: every dtype.
const std::vector<DType> kAllDTypes = {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32,
                                       DType::I64, DType::U8,  DType::U32, DType::Bool};
// The dtypes cu_seqlens may have.
const std::vector<DType> kOffsetDTypes = {DType::I32, DType::U32, DType::I64};

// Integers in [0, 100) (0 or 1 for bool), exact in every dtype.
Tensor make_values(Shape shape, DType dtype, std::uint64_t seed) {
  Tensor ints(std::move(shape), DType::I64), t(ints.shape(), dtype);
  testing::fill_uniform_int(ints, seed, 0, dtype == DType::Bool ? 2 : 100);
  copy(ints, t);
  return t;
}

// cu_seqlens of `dtype` (one of kOffsetDTypes) holding `cu`, on the CPU.
Tensor offsets(DType dtype, const std::vector<std::int64_t>& cu) {
  Tensor i64({static_cast<std::int64_t>(cu.size())}, DType::I64), t(i64.shape(), dtype);
  std::copy(cu.begin(), cu.end(), i64.data_ptr<std::int64_t>());
  copy(i64, t);
  return t;
}

// A tensor of 7s on `device`: outputs start so, so that rows the op should not write are visible.
Tensor sevens(Shape shape, DType dtype, Device device, const Stream& stream) {
  return on(test::full(std::move(shape), dtype, 7), device, stream);
}

// The ops on `target`'s backend, for x and cu on its device; the output is on that device too.
Tensor packed(const Target& target, const Stream& stream, const TensorView& x, const TensorView& cu,
              std::int64_t tokens, PaddingSide side) {
  Shape shape(x.shape().begin() + 1, x.shape().end());
  shape[0] = tokens;
  Tensor out = sevens(shape, x.dtype(), x.device(), stream);
  ForceKernelBackend force(target.backend);
  pack_sequence(x, cu, out, side, stream);
  return out;
}

Tensor unpacked(const Target& target, const Stream& stream, const TensorView& x,
                const TensorView& cu, std::int64_t seq_len, PaddingSide side) {
  Shape shape = x.shape();
  shape[0] = seq_len;
  shape.insert(shape.begin(), cu.size(0) - 1);
  Tensor out = sevens(shape, x.dtype(), x.device(), stream);
  ForceKernelBackend force(target.backend);
  unpack_sequence(x, cu, out, side, stream);
  return out;
}

class PackSequenceBackends : public ::testing::TestWithParam<test::OpCase> {};

// Lengths 5, 0, 9 (= S), 1, 0, 7 in rows of 3 x 5 elements (1 to 8 bytes each: an odd number of
// bytes for 1-byte dtypes, every cuda unit width below 16 bytes), and rows of 1024 elements
// (16-byte cuda units) whose 1 MiB parts of the cpu backend end inside sequences (the parts count
// bytes, whatever the dtype); both padding sides, every offset dtype against the oracle's i32.
TEST_P(PackSequenceBackends, MatchesTheReferenceAndPackUndoesUnpack) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  struct Case {
    Shape rows;
    std::vector<std::int64_t> cu;
    std::int64_t seq_len;
  };
  const std::vector<Case> cases = {{{3, 5}, {0, 5, 5, 14, 15, 15, 22}, 9},
                                   {{1024}, {0, 300, 301, 500, 777}, 300}};
  for (const Case& c : cases) {
    const std::int64_t batch = static_cast<std::int64_t>(c.cu.size()) - 1, tokens = c.cu.back();
    Shape shape = {batch, c.seq_len};
    shape.insert(shape.end(), c.rows.begin(), c.rows.end());
    const Tensor x = make_values(shape, dtype, 1), on_x = on(x, d, stream);
    const Tensor cu32 = offsets(DType::I32, c.cu);
    for (PaddingSide side : {PaddingSide::Left, PaddingSide::Right}) {
      const Tensor p_ref = packed(kOracle, {}, x, cu32, tokens, side);
      const Tensor u_ref = unpacked(kOracle, {}, p_ref, cu32, c.seq_len, side);
      for (DType index : kOffsetDTypes) {
        const Tensor on_cu = on(offsets(index, c.cu), d, stream);
        const Tensor p = packed(target, stream, on_x, on_cu, tokens, side);
        const Tensor u = unpacked(target, stream, p, on_cu, c.seq_len, side);
        const std::string what =
            fmt::format("rows {} {} {}", shape_str(c.rows),
                        side == PaddingSide::Left ? "left" : "right", to_string(index));
        EXPECT_TRUE(testing::bitwise_equal(to_cpu(p, stream), p_ref)) << what << " pack";
        EXPECT_TRUE(testing::bitwise_equal(to_cpu(u, stream), u_ref)) << what << " unpack";
        EXPECT_TRUE(testing::bitwise_equal(
            to_cpu(packed(target, stream, u, on_cu, tokens, side), stream), p_ref))
            << what << " pack(unpack(p))";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, PackSequenceBackends,
                         ::testing::ValuesIn(test::op_cases(test::all_targets(), kAllDTypes)),
                         test::op_case_name);

// Cases of fixed dtypes, on every target.
class PackSequenceTargets : public ::testing::TestWithParam<Target> {};

// B = 3, S = 4, rows of 2, lengths 2, 0, 3: the values of torch's x[mask] and out[mask] = y
// with mask = arange(S) < len (right) or arange(S) >= S - len (left).
TEST_P(PackSequenceTargets, MatchesTorchMaskingOnKnownValuesForBothPaddingSides) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Tensor host_x({3, 4, 2}, DType::F32);
  for (std::int64_t i = 0; i < 24; ++i) host_x.data_ptr<float>()[i] = static_cast<float>(i);
  const Tensor x = on(host_x, target.device, stream);
  for (DType index : kOffsetDTypes) {
    const Tensor cu = on(offsets(index, {0, 2, 2, 5}), target.device, stream);
    EXPECT_EQ(values(to_cpu(packed(target, stream, x, cu, 5, PaddingSide::Right), stream)),
              (std::vector<double>{0, 1, 2, 3, 16, 17, 18, 19, 20, 21}));
    EXPECT_EQ(values(to_cpu(packed(target, stream, x, cu, 5, PaddingSide::Left), stream)),
              (std::vector<double>{4, 5, 6, 7, 18, 19, 20, 21, 22, 23}));
  }
}

TEST_P(PackSequenceTargets, UnpackMatchesTorchIndexAssignmentAndZeroFillsThePadding) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Tensor host_y({5, 2}, DType::F32);
  for (std::int64_t i = 0; i < 10; ++i) host_y.data_ptr<float>()[i] = static_cast<float>(100 + i);
  const Tensor y = on(host_y, target.device, stream);
  for (DType index : kOffsetDTypes) {
    const Tensor cu = on(offsets(index, {0, 2, 2, 5}), target.device, stream);
    EXPECT_EQ(values(to_cpu(unpacked(target, stream, y, cu, 4, PaddingSide::Right), stream)),
              (std::vector<double>{100, 101, 102, 103, 0,   0,   0,   0,   0,   0,   0, 0,
                                   0,   0,   0,   0,   104, 105, 106, 107, 108, 109, 0, 0}));
    EXPECT_EQ(values(to_cpu(unpacked(target, stream, y, cu, 4, PaddingSide::Left), stream)),
              (std::vector<double>{0, 0, 0, 0, 100, 101, 102, 103, 0,   0,   0,   0,
                                   0, 0, 0, 0, 0,   0,   104, 105, 106, 107, 108, 109}));
  }
}

TEST_P(PackSequenceTargets, EmptyAndLengthOneSequencesEmptyBatchesAndZeroLengthRows) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // CPU tensors on the target's device.
  const auto there = [&](const Tensor& t) { return on(t, target.device, stream); };
  const auto pack = [&](const Tensor& x, const Tensor& cu, std::int64_t tokens, PaddingSide side) {
    return to_cpu(packed(target, stream, there(x), there(cu), tokens, side), stream);
  };
  const auto unpack = [&](const Tensor& x, const Tensor& cu, std::int64_t seq_len,
                          PaddingSide side) {
    return to_cpu(unpacked(target, stream, there(x), there(cu), seq_len, side), stream);
  };
  const Tensor x = make_values({3, 4, 2}, DType::F32, 2);
  // Every sequence empty: nothing packed, unpacking gives zeros only.
  const Tensor none = offsets(DType::I32, {0, 0, 0, 0});
  EXPECT_EQ(pack(x, none, 0, PaddingSide::Left).shape(), (Shape{0, 2}));
  EXPECT_EQ(values(unpack(Tensor({0, 2}, DType::F32), none, 4, PaddingSide::Left)),
            std::vector<double>(24, 0.0));
  // S = 0 and B = 0.
  EXPECT_EQ(pack(Tensor({3, 0, 2}, DType::F32), none, 0, PaddingSide::Right).shape(),
            (Shape{0, 2}));
  EXPECT_EQ(unpack(Tensor({0, 2}, DType::F32), none, 0, PaddingSide::Right).shape(),
            (Shape{3, 0, 2}));
  EXPECT_EQ(
      pack(Tensor({0, 4, 2}, DType::F32), offsets(DType::I64, {0}), 0, PaddingSide::Left).shape(),
      (Shape{0, 2}));
  // Rows of zero elements: nothing to move, shapes still checked.
  const Tensor ones = offsets(DType::I64, {0, 1, 2, 3});
  EXPECT_EQ(pack(Tensor({3, 4, 0}, DType::F32), ones, 3, PaddingSide::Left).shape(), (Shape{3, 0}));
  // Length-1 sequences take the last (left) or first (right) position; no trailing dims.
  const Tensor x2 = from({3, 4}, DType::F32, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  EXPECT_EQ(values(pack(x2, ones, 3, PaddingSide::Left)), (std::vector<double>{3, 7, 11}));
  EXPECT_EQ(values(pack(x2, ones, 3, PaddingSide::Right)), (std::vector<double>{0, 4, 8}));
}

TEST_P(PackSequenceTargets, NonContiguousInputsGiveTheResultsOfTheirContiguousCopies) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  // x (B, S, R) = a transposed (S, B, R) storage; cu_seqlens with stride 2.
  const Tensor host_storage = make_values({6, 3, 4}, DType::BF16, 3);
  const Tensor storage = on(host_storage, d, stream);
  const TensorView x = storage.view().transpose(0, 1);
  const Tensor cu_storage = on(offsets(DType::I32, {0, -1, 6, -1, 8, -1, 11}), d, stream);
  const TensorView cu(cu_storage.view().data(), DType::I32, {4}, {2}, d);
  const Tensor cu_dense = offsets(DType::I32, {0, 6, 8, 11});
  const Tensor p = to_cpu(packed(target, stream, x, cu, 11, PaddingSide::Left), stream);
  const Tensor p_ref = packed(kOracle, {}, Tensor::copy_of(host_storage.view().transpose(0, 1)),
                              cu_dense, 11, PaddingSide::Left);
  EXPECT_TRUE(testing::bitwise_equal(p, p_ref));
  // The packed rows as a transposed (R, T) storage.
  const Tensor pt = on(Tensor::copy_of(p.view().transpose(0, 1)), d, stream);
  EXPECT_TRUE(testing::bitwise_equal(
      to_cpu(unpacked(target, stream, pt.view().transpose(0, 1), cu, 6, PaddingSide::Right),
             stream),
      unpacked(kOracle, {}, p_ref, cu_dense, 6, PaddingSide::Right)));
}

TEST_P(PackSequenceTargets, BuffersNotAlignedTo16BytesTakeANarrowerUnit) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  // bf16 rows of 1024 elements (16-byte units on cuda) starting 2 bytes into their buffers.
  const Tensor x = make_values({2, 5, 1024}, DType::BF16, 2);
  const Tensor cu = offsets(DType::I64, {0, 3, 8}), on_cu = on(cu, d, stream);
  const Tensor x_buf({2 * 5 * 1024 + 1}, DType::BF16, d, stream),
      out_buf({8 * 1024 + 1}, DType::BF16, d, stream);
  const TensorView x_view(static_cast<bfloat16*>(x_buf.view().data()) + 1, DType::BF16, x.shape(),
                          d);
  const TensorView out_view(static_cast<bfloat16*>(out_buf.view().data()) + 1, DType::BF16,
                            {8, 1024}, d);
  copy(x, x_view, stream);
  const Tensor ref = packed(kOracle, {}, x, cu, 8, PaddingSide::Right);
  {
    ForceKernelBackend force(target.backend);
    pack_sequence(x_view, on_cu, out_view, PaddingSide::Right, stream);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(out_view, stream), ref));
  // Unpacked into the unaligned buffer over 7s: every token row and the padding (left as it was).
  copy(sevens(x.shape(), DType::BF16, d, stream), x_view, stream);
  {
    ForceKernelBackend force(target.backend);
    unpack_sequence(out_view, on_cu, x_view, PaddingSide::Right, stream);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(x_view, stream),
                                     unpacked(kOracle, {}, ref, cu, 5, PaddingSide::Right)));
}

TEST_P(PackSequenceTargets, DeterministicRunToRunOnAStream) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking with respect to the default stream), as in training.
  std::optional<CudaStream> cuda;
  if (target.device.type == DeviceType::CUDA) cuda.emplace(target.device.index);
  const Stream stream = cuda ? cuda->stream() : Stream{target.device};
  const Tensor x = on(make_values({4, 512, 256}, DType::BF16, 6), target.device, stream);
  const Tensor cu = on(offsets(DType::I64, {0, 100, 612, 612, 1000}), target.device, stream);
  const Tensor a = packed(target, stream, x, cu, 1000, PaddingSide::Left);
  const Tensor b = packed(target, stream, x, cu, 1000, PaddingSide::Left);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a, stream), to_cpu(b, stream)));
}

TEST_P(PackSequenceTargets, BadCuSeqlensIsAnErrorNamingTheOffsetAndNothingIsWritten) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device d = target.device;
  const Tensor x = on(make_values({3, 4, 2}, DType::F32, 4), d, stream);
  ForceKernelBackend force(target.backend);
  struct Bad {
    std::vector<std::int64_t> cu;
    std::vector<std::string> needles;
  };
  const std::vector<Bad> bad = {
      {{1, 2, 3, 5}, {"pack_sequence", "cu_seqlens[0] must be 0, got 1"}},
      {{0, 3, 2, 5}, {"non-decreasing", "cu_seqlens[2] = 2 after cu_seqlens[1] = 3"}},
      {{0, 1, 2, 4}, {"cu_seqlens[3] (the last) must equal T = 5", "'out'", "got 4"}},
      {{0, 0, 5, 5}, {"sequence 1 has 5 tokens", "padded length S = 4"}}};
  for (const Bad& b : bad)
    for (DType index : kOffsetDTypes) {
      const Tensor cu = on(offsets(index, b.cu), d, stream);
      const Tensor out = sevens({5, 2}, DType::F32, d, stream);
      test::expect_error([&] { pack_sequence(x, cu, out, PaddingSide::Left, stream); },
                         ErrorCode::InvalidArgument, b.needles);
      for (double v : values(to_cpu(out, stream))) ASSERT_EQ(v, 7.0);
    }
  // A u32 offset past 2^31 is read as unsigned: a sequence too long, not a decreasing offset.
  const Tensor past_int32 = on(offsets(DType::U32, {0, 1, 2, 3'000'000'000}), d, stream);
  test::expect_error(
      [&] {
        pack_sequence(x, past_int32, sevens({5, 2}, DType::F32, d, stream), PaddingSide::Left,
                      stream);
      },
      ErrorCode::InvalidArgument, {"pack_sequence", "sequence 2 has 2999999998 tokens"});
  const Tensor padded = sevens({3, 4, 2}, DType::F32, d, stream);
  test::expect_error(
      [&] {
        unpack_sequence(on(Tensor({5, 2}, DType::F32), d, stream),
                        on(offsets(DType::I64, {0, 2, 2, 6}), d, stream), padded, PaddingSide::Left,
                        stream);
      },
      ErrorCode::InvalidArgument, {"unpack_sequence", "must equal T = 5, the rows of 'x', got 6"});
  for (double v : values(to_cpu(padded, stream))) ASSERT_EQ(v, 7.0);
  // Offsets on the CPU for tensors on a GPU.
  if (d.type == DeviceType::CUDA) {
    test::expect_error(
        [&] {
          pack_sequence(x, offsets(DType::I64, {0, 1, 2, 3}), sevens({3, 2}, DType::F32, d, stream),
                        PaddingSide::Left, stream);
        },
        ErrorCode::DeviceMismatch, {"pack_sequence", "cu_seqlens"});
  }
}

INSTANTIATE_TEST_SUITE_P(, PackSequenceTargets, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

TEST(PackSequence, EveryDTypeIsRegisteredOnEveryBackend) {
  int tables = 0;
  for (const KernelInfo& k : registered_kernels()) {
    if (k.op != "pack_sequence" && k.op != "unpack_sequence") continue;
    EXPECT_EQ(k.dtypes.size(), kAllDTypes.size()) << k.op << " " << to_string(k.backend);
    ++tables;
  }
  EXPECT_GE(tables, 4);  // reference and cpu (and cuda) of each
}

TEST(PackSequence, PaddedRowsPast2To31AreAddressedIn64Bits) {
  // Sequence 70000 of a batch padded to 40000 tokens: its last token is padded row 2'800'039'999,
  // and in rows of 8 KiB (64 heads x 64 bf16) at byte 22'937'927'671'808.
  constexpr std::int64_t row = detail::padded_row(70000, 9, 10, 40000, PaddingSide::Left);
  EXPECT_EQ(row, std::int64_t{2'800'039'999});
  EXPECT_EQ(detail::padded_row(70000, 9, 10, 40000, PaddingSide::Right),
            std::int64_t{2'800'000'009});
  EXPECT_EQ(row * 8192, std::int64_t{22'937'927'671'808});
}

// u8 rows of 1025 bytes (1-byte units) in a 2.15 GB padded buffer: the tokens of sequence 1,
// left-padded, start past byte (and unit) 2^31.
TEST(CudaPackSequence, RowsPastByte2To31AreAddressedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Device cuda = test::kCuda;
  const Stream stream{cuda};
  constexpr std::int64_t kRow = 1025, kSeq = 1'048'577;
  std::optional<Tensor> padded;
  try {
    padded.emplace(Tensor::zeros({2, kSeq, kRow}, DType::U8, cuda, stream));
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  // Padded rows [first, first + n) as an (n, kRow) view.
  const auto rows = [&](std::int64_t first, std::int64_t n) {
    return TensorView(static_cast<std::uint8_t*>(padded->view().data()) + first * kRow, DType::U8,
                      {n, kRow}, cuda);
  };
  const Tensor tokens = make_values({3, kRow}, DType::U8, 7);
  const Tensor cu = on(offsets(DType::I32, {0, 1, 3}), cuda, stream);
  // Sequence 0 (length 1) in padded row kSeq - 1, sequence 1 (length 2) in rows 2 kSeq - 2, - 1.
  copy(tokens.view().narrow(0, 0, 1), rows(kSeq - 1, 1), stream);
  copy(tokens.view().narrow(0, 1, 2), rows(2 * kSeq - 2, 2), stream);
  EXPECT_GT((2 * kSeq - 2) * kRow, std::int64_t{1} << 31);
  const Tensor out({3, kRow}, DType::U8, cuda, stream);
  pack_sequence(*padded, cu, out, PaddingSide::Left, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(out, stream), tokens));
  // Unpacking zero-fills a padding row past 2^31 and puts the tokens back.
  copy(tokens.view().narrow(0, 0, 1), rows(2 * kSeq - 3, 1), stream);
  unpack_sequence(out, cu, *padded, PaddingSide::Left, stream);
  const Tensor tail = to_cpu(rows(2 * kSeq - 3, 3), stream);
  for (double v : values(tail.view().narrow(0, 0, 1))) ASSERT_EQ(v, 0.0);
  EXPECT_TRUE(testing::bitwise_equal(tail.view().narrow(0, 1, 2), tokens.view().narrow(0, 1, 2)));
  EXPECT_TRUE(
      testing::bitwise_equal(to_cpu(rows(kSeq - 1, 1), stream), tokens.view().narrow(0, 0, 1)));
}

TEST(PackSequence, BadShapesAndDTypesAreErrorsNamingTheArgument) {
  const Tensor x = make_values({3, 4, 2}, DType::F32, 5), cu = offsets(DType::I64, {0, 1, 2, 3});
  Tensor out({3, 2}, DType::F32);
  test::expect_error(
      [&] {
        pack_sequence(x, from({4}, DType::F32, {0, 1, 2, 3}), out);
      },
      ErrorCode::DTypeMismatch, {"pack_sequence", "'cu_seqlens'", "i32 or u32 or i64, got f32"});
  test::expect_error(
      [&] {
        pack_sequence(x, offsets(DType::I64, {0, 1, 3}), out);
      },
      ErrorCode::ShapeMismatch, {"'cu_seqlens'", "[4]", "[3]"});
  test::expect_error(
      [&] {
        pack_sequence(x.view().reshape({12, 2}), cu, out);
      },
      ErrorCode::ShapeMismatch, {"'cu_seqlens'", "[13]"});
  test::expect_error([&] { pack_sequence(x.view().reshape({24}), cu, out); },
                     ErrorCode::InvalidArgument, {"'x' must be (B, S, ...)", "[24]"});
  Tensor wide({3, 3}, DType::F32), f64({3, 2}, DType::F64);
  test::expect_error([&] { pack_sequence(x, cu, wide); }, ErrorCode::ShapeMismatch,
                     {"'out'", "[3, 2]", "[3, 3]"});
  test::expect_error([&] { pack_sequence(x, cu, f64); }, ErrorCode::DTypeMismatch,
                     {"'out'", "f32", "f64"});
  Tensor out_t({2, 3}, DType::F32);
  test::expect_error([&] { pack_sequence(x, cu, out_t.view().transpose(0, 1)); },
                     ErrorCode::InvalidArgument, {"'out' must be contiguous"});
  Tensor padded({3, 4, 3}, DType::F32);
  test::expect_error([&] { unpack_sequence(out, cu, padded); }, ErrorCode::ShapeMismatch,
                     {"unpack_sequence", "'out'", "[3, 4, 2]", "[3, 4, 3]"});
  test::expect_error(
      [&] {
        unpack_sequence(out, cu, Tensor({12, 2}, DType::F32));
      },
      ErrorCode::ShapeMismatch, {"'out' must be (B, S, ...)", "[2]", "[12, 2]"});
}

}  // namespace
}  // namespace meshfuse
