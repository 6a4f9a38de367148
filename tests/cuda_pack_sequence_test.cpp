// pack_sequence / unpack_sequence on CUDA tensors against the reference backend. Skipped without
// a GPU.
#include <optional>

#include "meshfuse/meshfuse.h"
#include "pack_sequence_util.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::to_cpu;
using test::to_cuda;
using test::values;

using test::kAllDTypes;
using test::make_values;
using test::offsets;

// Outputs on x's device, filled with 7 first so that rows the op should not write are visible.
Tensor filled(Shape shape, DType dtype, Device device) {
  const Tensor host = test::full(std::move(shape), dtype, 7);
  return device.type == DeviceType::CUDA ? to_cuda(host) : host;
}

Tensor packed(const TensorView& x, const TensorView& cu, std::int64_t tokens, PaddingSide side,
              const Stream& stream = {}) {
  Shape shape(x.shape().begin() + 1, x.shape().end());
  shape[0] = tokens;
  Tensor out = filled(shape, x.dtype(), x.device());
  pack_sequence(x, cu, out, side, stream);
  return out;
}

Tensor unpacked(const TensorView& x, const TensorView& cu, std::int64_t seq_len, PaddingSide side) {
  Shape shape = x.shape();
  shape[0] = seq_len;
  shape.insert(shape.begin(), cu.size(0) - 1);
  Tensor out = filled(shape, x.dtype(), x.device());
  unpack_sequence(x, cu, out, side);
  return out;
}

class CudaPackSequenceTest : public ::testing::TestWithParam<DType> {};

// Rows of 15 elements (1 to 8 bytes each: every unit width below 16 bytes) and of 1024 (16-byte
// units), lengths with empty and full (= S) sequences, both padding sides, both offset dtypes.
TEST_P(CudaPackSequenceTest, MatchesTheReferenceAndPackUndoesUnpack) {
  MESHFUSE_REQUIRE_CUDA();
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
    const Tensor x = make_values(shape, GetParam(), 1), gx = to_cuda(x);
    for (PaddingSide side : {PaddingSide::Left, PaddingSide::Right})
      for (DType index : {DType::I32, DType::I64}) {
        const Tensor cu = offsets(index, c.cu), gcu = to_cuda(cu);
        Tensor p_ref, u_ref;
        {
          ForceKernelBackend force(KernelBackend::Reference);
          p_ref = packed(x, cu, tokens, side);
          u_ref = unpacked(p_ref, cu, c.seq_len, side);
        }
        const Tensor p = packed(gx, gcu, tokens, side);
        const Tensor u = unpacked(p, gcu, c.seq_len, side);
        EXPECT_TRUE(testing::bitwise_equal(to_cpu(p), p_ref)) << "pack";
        EXPECT_TRUE(testing::bitwise_equal(to_cpu(u), u_ref)) << "unpack";
        EXPECT_TRUE(testing::bitwise_equal(to_cpu(packed(u, gcu, tokens, side)), p_ref))
            << "pack(unpack(p))";
      }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CudaPackSequenceTest, ::testing::ValuesIn(kAllDTypes),
                         test::dtype_name);

TEST(CudaPackSequence, BuffersNotAlignedTo16BytesTakeANarrowerUnit) {
  MESHFUSE_REQUIRE_CUDA();
  // bf16 rows of 1024 elements (16-byte units) starting 2 bytes into their buffers.
  const Tensor x = make_values({2, 5, 1024}, DType::BF16, 2);
  const Tensor cu = offsets(DType::I64, {0, 3, 8}), gcu = to_cuda(cu);
  Tensor x_buf({2 * 5 * 1024 + 1}, DType::BF16, kCuda), out_buf({8 * 1024 + 1}, DType::BF16, kCuda);
  const TensorView gx(static_cast<bfloat16*>(x_buf.view().data()) + 1, DType::BF16, x.shape(),
                      kCuda);
  const TensorView gout(static_cast<bfloat16*>(out_buf.view().data()) + 1, DType::BF16, {8, 1024},
                        kCuda);
  copy(x, gx);
  pack_sequence(gx, gcu, gout, PaddingSide::Right);
  Tensor ref({8, 1024}, DType::BF16);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    pack_sequence(x, cu, ref, PaddingSide::Right);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(gout), ref));
  unpack_sequence(gout, gcu, gx, PaddingSide::Right);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(packed(gx, gcu, 8, PaddingSide::Right)), ref));
}

TEST(CudaPackSequence, EmptyAndLengthOneSequencesEmptyBatchesAndZeroLengthRows) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor x = to_cuda(make_values({3, 4, 2}, DType::F32, 3));
  const Tensor none = to_cuda(offsets(DType::I32, {0, 0, 0, 0}));
  EXPECT_EQ(packed(x, none, 0, PaddingSide::Left).shape(), (Shape{0, 2}));
  EXPECT_EQ(
      values(to_cpu(unpacked(to_cuda(Tensor({0, 2}, DType::F32)), none, 4, PaddingSide::Left))),
      std::vector<double>(24, 0.0));
  EXPECT_EQ(packed(to_cuda(Tensor({3, 0, 2}, DType::F32)), none, 0, PaddingSide::Right).shape(),
            (Shape{0, 2}));
  EXPECT_EQ(unpacked(to_cuda(Tensor({0, 2}, DType::F32)), none, 0, PaddingSide::Right).shape(),
            (Shape{3, 0, 2}));
  EXPECT_EQ(packed(to_cuda(Tensor({0, 4, 2}, DType::F32)), to_cuda(offsets(DType::I64, {0})), 0,
                   PaddingSide::Left)
                .shape(),
            (Shape{0, 2}));
  const Tensor ones = to_cuda(offsets(DType::I64, {0, 1, 2, 3}));
  EXPECT_EQ(packed(to_cuda(Tensor({3, 4, 0}, DType::F32)), ones, 3, PaddingSide::Left).shape(),
            (Shape{3, 0}));
  const Tensor x2 = to_cuda(test::from({3, 4}, DType::F32, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(values(to_cpu(packed(x2, ones, 3, PaddingSide::Left))),
            (std::vector<double>{3, 7, 11}));
  EXPECT_EQ(values(to_cpu(packed(x2, ones, 3, PaddingSide::Right))),
            (std::vector<double>{0, 4, 8}));
}

TEST(CudaPackSequence, BadCuSeqlensOnTheDeviceIsAnErrorAndNothingIsWritten) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor x = to_cuda(make_values({3, 4, 2}, DType::F32, 4));
  const std::vector<std::pair<std::vector<std::int64_t>, std::string>> bad = {
      {{1, 2, 3, 5}, "cu_seqlens[0] must be 0, got 1"},
      {{0, 3, 2, 5}, "cu_seqlens[2] = 2 after cu_seqlens[1] = 3"},
      {{0, 1, 2, 4}, "must equal T = 5"},
      {{0, 0, 5, 5}, "sequence 1 has 5 tokens"}};
  for (const auto& [cu, needle] : bad) {
    Tensor out = filled({5, 2}, DType::F32, kCuda);
    test::expect_error([&] { pack_sequence(x, to_cuda(offsets(DType::I32, cu)), out); },
                       ErrorCode::InvalidArgument, {"pack_sequence", needle});
    for (double v : values(to_cpu(out))) ASSERT_EQ(v, 7.0);
  }
  test::expect_error(
      [&] {
        pack_sequence(x, offsets(DType::I64, {0, 1, 2, 3}), filled({3, 2}, DType::F32, kCuda));
      },
      ErrorCode::DeviceMismatch, {"pack_sequence", "cu_seqlens"});
}

TEST(CudaPackSequence, NonContiguousInputsAndForcedReferenceOnCudaTensors) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor storage = to_cuda(make_values({6, 3, 4}, DType::BF16, 5));
  const TensorView x = storage.view().transpose(0, 1);  // (3, 6, 4)
  const Tensor cu_storage = to_cuda(offsets(DType::I32, {0, -1, 6, -1, 8, -1, 11}));
  const TensorView cu(cu_storage.view().data(), DType::I32, {4}, {2}, kCuda);
  const Tensor a = packed(x, cu, 11, PaddingSide::Left);
  Tensor b;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    b = packed(x, cu, 11, PaddingSide::Left);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a), to_cpu(b)));
  const Tensor at = to_cuda(Tensor::copy_of(to_cpu(a).view().transpose(0, 1)));  // (4, 11)
  const Tensor u = unpacked(at.view().transpose(0, 1), cu, 6, PaddingSide::Right);
  Tensor u_ref;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    u_ref = unpacked(a, cu, 6, PaddingSide::Right);
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(u), to_cpu(u_ref)));
}

TEST(CudaPackSequence, DeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor x = to_cuda(make_values({4, 512, 256}, DType::BF16, 6), stream);
  const Tensor cu = to_cuda(offsets(DType::I64, {0, 100, 612, 612, 1000}), stream);
  const Tensor a = packed(x, cu, 1000, PaddingSide::Left, stream);
  const Tensor b = packed(x, cu, 1000, PaddingSide::Left, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a, stream), to_cpu(b, stream)));
}

// u8 rows of 1025 bytes (1-byte units) in a 2.15 GB padded buffer: the tokens of sequence 1,
// left-padded, start past byte (and unit) 2^31.
TEST(CudaPackSequence, RowsPastByte2To31AreAddressedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  constexpr std::int64_t kRow = 1025, kSeq = 1'048'577;
  std::optional<Tensor> padded;
  try {
    padded.emplace(Tensor::zeros({2, kSeq, kRow}, DType::U8, kCuda));
  } catch (const Error& e) {
    GTEST_SKIP() << "not enough device memory: " << e.what();
  }
  // Padded rows [first, first + n) as an (n, kRow) view.
  const auto rows = [&](std::int64_t first, std::int64_t n) {
    return TensorView(static_cast<std::uint8_t*>(padded->view().data()) + first * kRow, DType::U8,
                      {n, kRow}, kCuda);
  };
  const Tensor tokens = make_values({3, kRow}, DType::U8, 7);
  const Tensor cu = to_cuda(offsets(DType::I32, {0, 1, 3}));
  // Sequence 0 (length 1) in padded row kSeq - 1, sequence 1 (length 2) in rows 2 kSeq - 2, - 1.
  copy(tokens.view().narrow(0, 0, 1), rows(kSeq - 1, 1));
  copy(tokens.view().narrow(0, 1, 2), rows(2 * kSeq - 2, 2));
  EXPECT_GT((2 * kSeq - 2) * kRow, std::int64_t{1} << 31);
  Tensor out({3, kRow}, DType::U8, kCuda);
  pack_sequence(*padded, cu, out, PaddingSide::Left);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(out), tokens));
  // Unpacking zero-fills a padding row past 2^31 and puts the tokens back.
  copy(tokens.view().narrow(0, 0, 1), rows(2 * kSeq - 3, 1));
  unpack_sequence(out, cu, *padded, PaddingSide::Left);
  const Tensor tail = to_cpu(rows(2 * kSeq - 3, 3));
  for (double v : values(tail.view().narrow(0, 0, 1))) ASSERT_EQ(v, 0.0);
  EXPECT_TRUE(testing::bitwise_equal(tail.view().narrow(0, 1, 2), tokens.view().narrow(0, 1, 2)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(rows(kSeq - 1, 1)), tokens.view().narrow(0, 0, 1)));
}

}  // namespace
}  // namespace meshfuse
