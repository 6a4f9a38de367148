// pack_sequence / unpack_sequence on the CPU: torch semantics on known values, the cpu backend
// against the reference for every dtype, the edges and the errors.
#include <gtest/gtest.h>

#include "meshfuse/meshfuse.h"
#include "ops/pack_sequence/pack_sequence_kernels.h"
#include "pack_sequence_util.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::values;

using test::kAllDTypes;
using test::make_values;
using test::offsets;

// out filled with 7 first, so that rows the op should not write are visible.
Tensor packed(const TensorView& x, const TensorView& cu, std::int64_t tokens, PaddingSide side) {
  Shape shape(x.shape().begin() + 1, x.shape().end());
  shape[0] = tokens;
  Tensor out = test::full(shape, x.dtype(), 7);
  pack_sequence(x, cu, out, side);
  return out;
}

Tensor unpacked(const TensorView& x, const TensorView& cu, std::int64_t seq_len, PaddingSide side) {
  Shape shape = x.shape();
  shape[0] = seq_len;
  shape.insert(shape.begin(), cu.size(0) - 1);
  Tensor out = test::full(shape, x.dtype(), 7);
  unpack_sequence(x, cu, out, side);
  return out;
}

const std::vector<KernelBackend> kBackends = {KernelBackend::Reference, KernelBackend::CPU};

// B = 3, S = 4, rows of 2, lengths 2, 0, 3: the values of torch's x[mask] and out[mask] = y
// with mask = arange(S) < len (right) or arange(S) >= S - len (left).
TEST(PackSequence, MatchesTorchMaskingOnKnownValuesForBothPaddingSides) {
  Tensor x({3, 4, 2}, DType::F32);
  for (std::int64_t i = 0; i < 24; ++i) x.data_ptr<float>()[i] = static_cast<float>(i);
  for (KernelBackend backend : kBackends)
    for (DType index : {DType::I32, DType::I64}) {
      ForceKernelBackend force(backend);
      const Tensor cu = offsets(index, {0, 2, 2, 5});
      EXPECT_EQ(values(packed(x, cu, 5, PaddingSide::Right)),
                (std::vector<double>{0, 1, 2, 3, 16, 17, 18, 19, 20, 21}));
      EXPECT_EQ(values(packed(x, cu, 5, PaddingSide::Left)),
                (std::vector<double>{4, 5, 6, 7, 18, 19, 20, 21, 22, 23}));
    }
}

TEST(UnpackSequence, MatchesTorchIndexAssignmentAndZeroFillsThePadding) {
  Tensor y({5, 2}, DType::F32);
  for (std::int64_t i = 0; i < 10; ++i) y.data_ptr<float>()[i] = static_cast<float>(100 + i);
  for (KernelBackend backend : kBackends)
    for (DType index : {DType::I32, DType::I64}) {
      ForceKernelBackend force(backend);
      const Tensor cu = offsets(index, {0, 2, 2, 5});
      EXPECT_EQ(values(unpacked(y, cu, 4, PaddingSide::Right)),
                (std::vector<double>{100, 101, 102, 103, 0,   0,   0,   0,   0,   0,   0, 0,
                                     0,   0,   0,   0,   104, 105, 106, 107, 108, 109, 0, 0}));
      EXPECT_EQ(values(unpacked(y, cu, 4, PaddingSide::Left)),
                (std::vector<double>{0, 0, 0, 0, 100, 101, 102, 103, 0,   0,   0,   0,
                                     0, 0, 0, 0, 0,   0,   104, 105, 106, 107, 108, 109}));
    }
}

class PackSequenceTest : public ::testing::TestWithParam<DType> {};

// Lengths 5, 0, 9 (= S), 1, 0, 7 in rows of 3 x 5 elements (an odd number of bytes for 1-byte
// dtypes), and for f32 a larger case whose 1 MiB parts of the cpu backend end inside sequences
// (the parts count bytes, whatever the dtype).
TEST_P(PackSequenceTest, CpuMatchesTheReferenceAndPackUndoesUnpack) {
  struct Case {
    Shape rows;
    std::vector<std::int64_t> cu;
    std::int64_t seq_len;
  };
  std::vector<Case> cases = {{{3, 5}, {0, 5, 5, 14, 15, 15, 22}, 9}};
  if (GetParam() == DType::F32) cases.push_back({{1024}, {0, 300, 301, 500, 777}, 300});
  for (const Case& c : cases)
    for (PaddingSide side : {PaddingSide::Left, PaddingSide::Right}) {
      const Tensor cu = offsets(DType::I64, c.cu);
      const std::int64_t batch = cu.size(0) - 1, tokens = c.cu.back();
      Shape padded_shape = {batch, c.seq_len};
      padded_shape.insert(padded_shape.end(), c.rows.begin(), c.rows.end());
      const Tensor x = make_values(padded_shape, GetParam(), 1);
      Tensor p_ref, u_ref;
      {
        ForceKernelBackend force(KernelBackend::Reference);
        p_ref = packed(x, cu, tokens, side);
        u_ref = unpacked(p_ref, cu, c.seq_len, side);
      }
      const Tensor p = packed(x, cu, tokens, side), u = unpacked(p, cu, c.seq_len, side);
      EXPECT_TRUE(testing::bitwise_equal(p, p_ref)) << "pack";
      EXPECT_TRUE(testing::bitwise_equal(u, u_ref)) << "unpack";
      EXPECT_TRUE(testing::bitwise_equal(packed(u, cu, tokens, side), p)) << "pack(unpack(p))";
    }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, PackSequenceTest, ::testing::ValuesIn(kAllDTypes),
                         test::dtype_name);

TEST(PackSequence, EveryDTypeIsRegisteredOnEveryBackend) {
  int tables = 0;
  for (const KernelInfo& k : registered_kernels()) {
    if (k.op != "pack_sequence" && k.op != "unpack_sequence") continue;
    EXPECT_EQ(k.dtypes.size(), kAllDTypes.size()) << k.op << " " << to_string(k.backend);
    ++tables;
  }
  EXPECT_GE(tables, 4);  // reference and cpu (and cuda) of each
}

TEST(PackSequence, EmptyAndLengthOneSequencesEmptyBatchesAndZeroLengthRows) {
  for (KernelBackend backend : kBackends) {
    ForceKernelBackend force(backend);
    const Tensor x = make_values({3, 4, 2}, DType::F32, 2);
    // Every sequence empty: nothing packed, unpacking gives zeros only.
    const Tensor none = offsets(DType::I32, {0, 0, 0, 0});
    EXPECT_EQ(packed(x, none, 0, PaddingSide::Left).shape(), (Shape{0, 2}));
    EXPECT_EQ(values(unpacked(Tensor({0, 2}, DType::F32), none, 4, PaddingSide::Left)),
              std::vector<double>(24, 0.0));
    // S = 0 and B = 0.
    EXPECT_EQ(packed(Tensor({3, 0, 2}, DType::F32), none, 0, PaddingSide::Right).shape(),
              (Shape{0, 2}));
    EXPECT_EQ(unpacked(Tensor({0, 2}, DType::F32), none, 0, PaddingSide::Right).shape(),
              (Shape{3, 0, 2}));
    EXPECT_EQ(packed(Tensor({0, 4, 2}, DType::F32), offsets(DType::I64, {0}), 0, PaddingSide::Left)
                  .shape(),
              (Shape{0, 2}));
    // Rows of zero elements: nothing to move, shapes still checked.
    EXPECT_EQ(packed(Tensor({3, 4, 0}, DType::F32), offsets(DType::I64, {0, 1, 2, 3}), 3,
                     PaddingSide::Left)
                  .shape(),
              (Shape{3, 0}));
    // Length-1 sequences take the last (left) or first (right) position; no trailing dims.
    const Tensor ones = offsets(DType::I64, {0, 1, 2, 3});
    const Tensor x2 = from({3, 4}, DType::F32, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
    EXPECT_EQ(values(packed(x2, ones, 3, PaddingSide::Left)), (std::vector<double>{3, 7, 11}));
    EXPECT_EQ(values(packed(x2, ones, 3, PaddingSide::Right)), (std::vector<double>{0, 4, 8}));
  }
}

TEST(PackSequence, NonContiguousInputsGiveTheResultsOfTheirContiguousCopies) {
  for (KernelBackend backend : kBackends) {
    ForceKernelBackend force(backend);
    // x (B, S, R) = a transposed (S, B, R) storage; cu_seqlens with stride 2.
    const Tensor storage = make_values({6, 3, 4}, DType::BF16, 3);
    const TensorView x = storage.view().transpose(0, 1);
    const Tensor cu_storage = offsets(DType::I32, {0, -1, 6, -1, 8, -1, 11});
    const TensorView cu(cu_storage.data_ptr<std::int32_t>(), DType::I32, {4}, {2});
    const Tensor cu_dense = offsets(DType::I32, {0, 6, 8, 11});
    const Tensor p = packed(x, cu, 11, PaddingSide::Left);
    EXPECT_TRUE(
        testing::bitwise_equal(p, packed(Tensor::copy_of(x), cu_dense, 11, PaddingSide::Left)));
    // The packed rows as a transposed (R, T) storage.
    const Tensor pt = Tensor::copy_of(p.view().transpose(0, 1));
    EXPECT_TRUE(
        testing::bitwise_equal(unpacked(pt.view().transpose(0, 1), cu, 6, PaddingSide::Right),
                               unpacked(p, cu_dense, 6, PaddingSide::Right)));
  }
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

TEST(PackSequence, BadCuSeqlensIsAnErrorNamingTheOffsetAndNothingIsWritten) {
  const Tensor x = make_values({3, 4, 2}, DType::F32, 4);
  for (KernelBackend backend : kBackends) {
    ForceKernelBackend force(backend);
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
      for (DType index : {DType::I32, DType::I64}) {
        const Tensor cu = offsets(index, b.cu);
        Tensor out = test::full({5, 2}, DType::F32, 7);
        test::expect_error([&] { pack_sequence(x, cu, out); }, ErrorCode::InvalidArgument,
                           b.needles);
        for (double v : values(out)) ASSERT_EQ(v, 7.0);
      }
    Tensor padded = test::full({3, 4, 2}, DType::F32, 7);
    test::expect_error(
        [&] {
          unpack_sequence(Tensor({5, 2}, DType::F32), offsets(DType::I64, {0, 2, 2, 6}), padded);
        },
        ErrorCode::InvalidArgument,
        {"unpack_sequence", "must equal T = 5, the rows of 'x', got 6"});
    for (double v : values(padded)) ASSERT_EQ(v, 7.0);
  }
}

TEST(PackSequence, BadShapesAndDTypesAreErrorsNamingTheArgument) {
  const Tensor x = make_values({3, 4, 2}, DType::F32, 5), cu = offsets(DType::I64, {0, 1, 2, 3});
  Tensor out({3, 2}, DType::F32);
  test::expect_error(
      [&] {
        pack_sequence(x, from({4}, DType::F32, {0, 1, 2, 3}), out);
      },
      ErrorCode::DTypeMismatch, {"pack_sequence", "'cu_seqlens'", "i32 or i64"});
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
