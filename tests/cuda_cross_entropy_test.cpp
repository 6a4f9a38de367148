// cross_entropy on CUDA tensors against the reference backend on the CPU. Skipped without a GPU.
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::values;
using test::make_labels;

using test::kCuda;
using test::to_cpu;
using test::to_cuda;

constexpr double kInf = std::numeric_limits<double>::infinity();

Shape loss_shape(std::int64_t rows, Reduction r) {
  return r == Reduction::None ? Shape{rows} : Shape{};
}

DType lse_dtype(DType logits) { return logits == DType::F64 ? DType::F64 : DType::F32; }

struct Forward {
  Tensor loss, lse;
};

// The op on tensors of `device` (inputs are moved there), outputs back on the CPU.
Forward forward(const TensorView& logits, const TensorView& labels, const CrossEntropyOptions& o,
                Device device, const Stream& stream = {}) {
  const std::int64_t n = logits.size(0);
  Tensor loss(loss_shape(n, o.reduction), logits.dtype(), device, stream),
      lse({n}, lse_dtype(logits.dtype()), device, stream);
  if (device.type == DeviceType::CUDA)
    cross_entropy(to_cuda(logits, stream), to_cuda(labels, stream), loss, lse, o, stream);
  else
    cross_entropy(logits, labels, loss, lse, o);
  return {to_cpu(loss, stream), to_cpu(lse, stream)};
}

Tensor backward(const TensorView& grad_loss, const TensorView& logits, const TensorView& labels,
                const TensorView& lse, const CrossEntropyOptions& o, Device device,
                const Stream& stream = {}) {
  Tensor grad(logits.shape(), logits.dtype(), device, stream);
  if (device.type == DeviceType::CUDA)
    cross_entropy_backward(to_cuda(grad_loss, stream), to_cuda(logits, stream),
                           to_cuda(labels, stream), to_cuda(lse, stream), grad, o, stream);
  else
    cross_entropy_backward(grad_loss, logits, labels, lse, grad, o);
  return to_cpu(grad, stream);
}

Forward reference_forward(const TensorView& logits, const TensorView& labels,
                          const CrossEntropyOptions& o) {
  ForceKernelBackend force(KernelBackend::Reference);
  return forward(logits, labels, o, Device{});
}

Tensor reference_backward(const TensorView& grad_loss, const TensorView& logits,
                          const TensorView& labels, const TensorView& lse,
                          const CrossEntropyOptions& o) {
  ForceKernelBackend force(KernelBackend::Reference);
  return backward(grad_loss, logits, labels, lse, o, Device{});
}

// An upstream gradient of the loss's shape (varied per row for `none`).
Tensor upstream(std::int64_t rows, DType dtype, Reduction r) {
  return r == Reduction::None ? test::randn({rows}, dtype, 99) : test::full({}, dtype, 1.5);
}

// cuda against the reference: loss, lse, and the gradient (both backwards given the reference
// lse, so that they see the same inputs).
void expect_matches_reference(const TensorView& logits, const TensorView& labels,
                              const CrossEntropyOptions& o, const std::string& what) {
  const Tensor dl = upstream(logits.size(0), logits.dtype(), o.reduction);
  const Forward ref = reference_forward(logits, labels, o);
  const Tensor ref_grad = reference_backward(dl, logits, labels, ref.lse, o);
  const Forward gpu = forward(logits, labels, o, kCuda);
  test::expect_close(gpu.loss, ref.loss, what + " loss");
  test::expect_close(gpu.lse, ref.lse, testing::default_tolerance(lse_dtype(logits.dtype())),
                     what + " lse");
  test::expect_close(backward(dl, logits, labels, ref.lse, o, kCuda), ref_grad,
                     what + " grad_logits");
}

// Plain; label smoothing with a logits multiplier and z-loss.
std::vector<CrossEntropyOptions> option_sets(Reduction r) {
  return {{-100, r, 0.0, 1.0, 0.0}, {-100, r, 0.1, 0.7, 1e-3}};
}

class CudaCrossEntropyTest : public ::testing::TestWithParam<DType> {};

TEST_P(CudaCrossEntropyTest, MatchesTheReferenceForEveryReductionOptionAndLabelDType) {
  MESHFUSE_REQUIRE_CUDA();
  // 1 and 7: scalar loads; 1000: 16-byte vectors with a partial last step; 128256: LLaMA-3.
  for (const auto& [vocab, rows] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 10}, {7, 10}, {1000, 10}, {128256, 3}}) {
    const Tensor logits = test::randn({rows, vocab}, GetParam(), 1, 2.0);
    for (DType label_dtype : {DType::I32, DType::I64}) {
      const Tensor labels = make_labels(rows, vocab, label_dtype, 2);
      for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
        for (const CrossEntropyOptions& o : option_sets(r))
          expect_matches_reference(
              logits, labels, o,
              "V=" + std::to_string(vocab) + " " + std::string(to_string(label_dtype)) + " " +
                  std::string(to_string(r)) + " eps=" + std::to_string(o.label_smoothing));
    }
  }
}

TEST_P(CudaCrossEntropyTest, MatchesTheReferenceAtV262144) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor logits = test::randn({2, 262144}, GetParam(), 3, 2.0);
  const Tensor labels = from({2}, DType::I64, {262143, 5});
  for (const CrossEntropyOptions& o : option_sets(Reduction::Mean))
    expect_matches_reference(logits, labels, o, "V=262144");
}

TEST_P(CudaCrossEntropyTest, Int32AndInt64LabelsGiveBitwiseTheSameResults) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor logits = test::randn({9, 1000}, GetParam(), 4);
  const Tensor l64 = make_labels(9, 1000, DType::I64, 5), l32({9}, DType::I32);
  copy(l64, l32);
  const CrossEntropyOptions o{-100, Reduction::None, 0.1, 1.0, 0.0};
  const Forward a = forward(logits, l64, o, kCuda), b = forward(logits, l32, o, kCuda);
  EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss));
  EXPECT_TRUE(testing::bitwise_equal(a.lse, b.lse));
  const Tensor dl = upstream(9, GetParam(), o.reduction);
  EXPECT_TRUE(testing::bitwise_equal(backward(dl, logits, l64, a.lse, o, kCuda),
                                     backward(dl, logits, l32, a.lse, o, kCuda)));
}

TEST_P(CudaCrossEntropyTest, IgnoreIndexMayBeAnyValueAndAllIgnoredGiveNanMeanAndZeroGrads) {
  MESHFUSE_REQUIRE_CUDA();
  // ignore_index = 3 is a valid class: rows labelled 3 are left out.
  const Tensor logits = test::randn({6, 50}, GetParam(), 6);
  const Tensor labels = from({6}, DType::I64, {3, 0, 49, 3, 12, 7});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
    expect_matches_reference(logits, labels, {.ignore_index = 3, .reduction = r},
                             "ignore_index=3 " + std::string(to_string(r)));

  // Every row ignored; the ignored rows hold NaN logits, which are never read.
  Tensor nan_logits = test::randn({4, 50}, GetParam(), 7);
  copy(test::full({1, 1}, DType::F64, NAN), nan_logits.view().narrow(0, 2, 1).narrow(1, 7, 1));
  const Tensor ignored = from({4}, DType::I32, {-100, -100, -100, -100});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    const CrossEntropyOptions o{.reduction = r, .label_smoothing = 0.2, .z_loss_scale = 1e-4};
    const Forward f = forward(nan_logits, ignored, o, kCuda);
    for (double v : values(f.loss)) {
      if (r == Reduction::Mean)
        EXPECT_TRUE(std::isnan(v));
      else
        EXPECT_EQ(v, 0.0) << to_string(r);
    }
    for (double l : values(f.lse)) EXPECT_EQ(l, 0.0);
    for (double g :
         values(backward(upstream(4, GetParam(), r), nan_logits, ignored, f.lse, o, kCuda)))
      ASSERT_EQ(g, 0.0) << to_string(r);
  }
}

TEST_P(CudaCrossEntropyTest, NonFiniteLogitsBehaveLikeTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  //   0: -inf away from the label: finite loss and gradient;  1: -inf at the label: loss +inf;
  //   2: entirely -inf: NaN;  3: a NaN: NaN;  4: a +inf: NaN;  5: finite.
  // 3000 columns (16-byte vectors) and 3001 (scalar loads).
  for (std::int64_t v : {3000, 3001}) {
    Tensor logits = test::randn({6, v}, GetParam(), 8);
    const auto set = [&](std::int64_t row, std::int64_t col, std::int64_t len, double value) {
      copy(test::full({1, len}, DType::F64, value),
           logits.view().narrow(0, row, 1).narrow(1, col, len));
    };
    set(0, 2000, 5, -kInf);
    set(1, 10, 1, -kInf);
    set(2, 0, v, -kInf);
    set(3, 2500, 1, NAN);
    set(4, 1999, 1, kInf);
    const Tensor labels = from({6}, DType::I64, {10, 10, 10, 10, 10, 10});
    const CrossEntropyOptions o{.reduction = Reduction::None};
    const Forward f = forward(logits, labels, o, kCuda);
    const std::vector<double> loss = values(f.loss);
    EXPECT_TRUE(std::isfinite(loss[0]));
    EXPECT_EQ(loss[1], kInf);
    for (int row : {2, 3, 4}) EXPECT_TRUE(std::isnan(loss[row])) << row;
    EXPECT_TRUE(std::isfinite(loss[5]));
    const std::vector<double> grad =
        values(backward(test::full({6}, GetParam(), 1), logits, labels, f.lse, o, kCuda));
    for (std::int64_t j = 0; j < 2 * v; ++j) ASSERT_TRUE(std::isfinite(grad[j])) << j;
    const CrossEntropyOptions smooth{.reduction = Reduction::None, .label_smoothing = 0.1};
    EXPECT_EQ(values(forward(logits, labels, smooth, kCuda).loss)[0], kInf);
    expect_matches_reference(logits, labels, o, "non-finite V=" + std::to_string(v));
    expect_matches_reference(logits, labels, smooth, "non-finite smoothed V=" + std::to_string(v));
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaCrossEntropyTest,
                         ::testing::ValuesIn(test::kFloatDTypes), test::dtype_name);

TEST(CudaCrossEntropy, LabelOutOfRangeNamesTheRowAndValueBeforeAnyWork) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor logits = to_cuda(test::randn({5, 4}, DType::F32, 9));
  const Tensor dl = to_cuda(test::full({}, DType::F32, 1)),
               lse = to_cuda(Tensor::zeros({5}, DType::F32));
  for (DType label_dtype : {DType::I32, DType::I64}) {
    // Rows 3 and 4 are both out of range: the first is reported.
    const Tensor too_big = to_cuda(from({5}, label_dtype, {0, -100, 3, 4, 9}));
    Tensor loss = to_cuda(test::full({}, DType::F32, 7)),
           lse_out = to_cuda(test::full({5}, DType::F32, 7));
    test::expect_error([&] { cross_entropy(logits, too_big, loss, lse_out); },
                       ErrorCode::InvalidArgument,
                       {"cross_entropy", "labels[3] = 4", "[0, 4)", "-100"});
    EXPECT_EQ(values(to_cpu(loss))[0], 7.0);  // nothing written
    for (double l : values(to_cpu(lse_out))) EXPECT_EQ(l, 7.0);
    const Tensor negative = to_cuda(from({5}, label_dtype, {0, 1, -1, 2, -7}));
    Tensor grad = to_cuda(test::full({5, 4}, DType::F32, 7));
    test::expect_error([&] { cross_entropy_backward(dl, logits, negative, lse, grad); },
                       ErrorCode::InvalidArgument, {"cross_entropy_backward", "labels[2] = -1"});
    for (double g : values(to_cpu(grad))) ASSERT_EQ(g, 7.0);
  }
  // A label past 2^31 is reported with its full value.
  const Tensor huge = to_cuda(from({2}, DType::I64, {1, 5'000'000'000.0}));
  Tensor loss2 = to_cuda(test::full({}, DType::F32, 7)), lse2({2}, DType::F32, kCuda);
  test::expect_error([&] { cross_entropy(logits.view().narrow(0, 0, 2), huge, loss2, lse2); },
                     ErrorCode::InvalidArgument, {"labels[1] = 5000000000"});
}

TEST(CudaCrossEntropy, ZeroRowsGiveEmptyNanMeanAndZeroSum) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor logits({0, 16}, DType::BF16), labels({0}, DType::I64);
  EXPECT_EQ(forward(logits, labels, {.reduction = Reduction::None}, kCuda).loss.shape(), Shape{0});
  EXPECT_TRUE(std::isnan(values(forward(logits, labels, {}, kCuda).loss)[0]));
  EXPECT_EQ(values(forward(logits, labels, {.reduction = Reduction::Sum}, kCuda).loss)[0], 0.0);
  const Forward f = forward(logits, labels, {}, kCuda);
  EXPECT_EQ(backward(test::full({}, DType::BF16, 1), logits, labels, f.lse, {}, kCuda).shape(),
            (Shape{0, 16}));
}

TEST(CudaCrossEntropy, NonContiguousInputsAndForcedReferenceOnCudaTensors) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor logits = test::randn({6, 40}, DType::F32, 10);
  const Tensor labels = make_labels(6, 40, DType::I64, 11);
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  // Transposed logits and labels with stride 2, on the device.
  const Tensor gl = to_cuda(logits), gy = to_cuda(labels);
  const Tensor lt = to_cuda(Tensor::copy_of(logits.view().transpose(0, 1)));
  Tensor spread = Tensor::zeros({6, 2}, DType::I64, kCuda);
  const TensorView strided_labels(spread.data_ptr<void>(), DType::I64, {6}, {2}, kCuda);
  copy(labels, strided_labels);
  Tensor la({6}, DType::F32, kCuda), lb({6}, DType::F32, kCuda), sa({6}, DType::F32, kCuda),
      sb({6}, DType::F32, kCuda);
  cross_entropy(gl, gy, la, sa, o);
  cross_entropy(lt.view().transpose(0, 1), strided_labels, lb, sb, o);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(la), to_cpu(lb)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sa), to_cpu(sb)));
  const Tensor dl = to_cuda(upstream(6, DType::F32, o.reduction));
  Tensor ga(logits.shape(), DType::F32, kCuda), gb(logits.shape(), DType::F32, kCuda);
  cross_entropy_backward(dl, gl, gy, sa, ga, o);
  cross_entropy_backward(dl, lt.view().transpose(0, 1), strided_labels, sa, gb, o);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga), to_cpu(gb)));

  // The reference forced on CUDA tensors runs on host copies: bitwise the CPU reference.
  for (Reduction r : {Reduction::None, Reduction::Mean}) {
    const CrossEntropyOptions ro{.reduction = r, .label_smoothing = 0.1, .z_loss_scale = 1e-3};
    const Tensor up = upstream(6, DType::F32, r);
    const Forward ref = reference_forward(logits, labels, ro);
    const Tensor ref_grad = reference_backward(up, logits, labels, ref.lse, ro);
    ForceKernelBackend force(KernelBackend::Reference);
    const Forward staged = forward(logits, labels, ro, kCuda);
    EXPECT_TRUE(testing::bitwise_equal(staged.loss, ref.loss));
    EXPECT_TRUE(testing::bitwise_equal(staged.lse, ref.lse));
    EXPECT_TRUE(testing::bitwise_equal(backward(up, logits, labels, ref.lse, ro, kCuda), ref_grad));
  }
}

TEST(CudaCrossEntropy, DeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor logits = test::randn({300, 3001}, DType::BF16, 12);
  const Tensor labels = make_labels(300, 3001, DType::I64, 13);
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    const CrossEntropyOptions o{.reduction = r, .label_smoothing = 0.1, .z_loss_scale = 1e-4};
    const Forward a = forward(logits, labels, o, kCuda, stream),
                  b = forward(logits, labels, o, kCuda, stream);
    EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss));
    EXPECT_TRUE(testing::bitwise_equal(a.lse, b.lse));
    const Tensor dl = test::full({}, DType::BF16, 1);
    EXPECT_TRUE(testing::bitwise_equal(backward(dl, logits, labels, a.lse, o, kCuda, stream),
                                       backward(dl, logits, labels, a.lse, o, kCuda, stream)));
  }
}

#ifdef MESHFUSE_WITH_CUDA
TEST(CudaCrossEntropy, RowKernelsOnChunksEqualTheWholeOpAndRunInPlace) {
  MESHFUSE_REQUIRE_CUDA();
  // What fused linear cross-entropy does: logits for rows [5, 13) in their own buffer, the
  // labels / lse / per-row losses / upstream of all 13 rows, all on the device.
  const std::int64_t n = 13, v = 1100, begin = 5, rows = 8;
  const Tensor logits = test::randn({n, v}, DType::F32, 14);
  const Tensor labels = make_labels(n, v, DType::I32, 15);
  const CrossEntropyOptions o{.reduction = Reduction::None,
                              .label_smoothing = 0.1,
                              .logits_multiplier = 0.8,
                              .z_loss_scale = 1e-3};
  const Forward whole = forward(logits, labels, o, kCuda);
  const Tensor dl = upstream(n, DType::F32, o.reduction);
  const Tensor whole_grad = backward(dl, logits, labels, whole.lse, o, kCuda);

  const Stream stream{kCuda, nullptr};
  const Tensor chunk = to_cuda(Tensor::copy_of(logits.view().narrow(0, begin, rows)));
  const Tensor glabels = to_cuda(labels), gdl = to_cuda(dl);
  const Tensor lse = to_cuda(Tensor::zeros({n}, DType::F32));
  const Tensor row_loss = to_cuda(test::full({n}, DType::F64, -1.0));
  const detail::CrossEntropyShape shape{DType::F32, DType::I32, n, v};
  Tensor row_grad;
  const detail::CrossEntropyUpstream up =
      detail::cuda::read_upstream(shape, gdl.data_ptr<void>(), 0, o.reduction, row_grad, stream);
  const detail::CrossEntropyRows block{DType::F32, DType::I32, begin, rows, v};
  detail::cuda::cross_entropy_forward_rows(block, chunk.data_ptr<void>(), glabels.data_ptr<void>(),
                                           lse.data_ptr<void>(), row_loss.data_ptr<double>(), o,
                                           stream);
  detail::cuda::cross_entropy_backward_rows(block, chunk.data_ptr<void>(), glabels.data_ptr<void>(),
                                            lse.data_ptr<void>(), up, chunk.data_ptr<void>(), o,
                                            stream);
  const std::vector<double> chunk_loss = values(to_cpu(row_loss)), chunk_lse = values(to_cpu(lse));
  const std::vector<double> whole_loss = values(whole.loss), whole_lse = values(whole.lse);
  for (std::int64_t g = 0; g < n; ++g) {
    const bool inside = g >= begin && g < begin + rows;
    EXPECT_EQ(inside ? static_cast<float>(chunk_loss[g]) : chunk_loss[g],
              inside ? whole_loss[g] : -1.0)
        << g;
    EXPECT_EQ(chunk_lse[g], inside ? whole_lse[g] : 0.0) << g;
  }
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(chunk), whole_grad.view().narrow(0, begin, rows)));
}
#endif

TEST(CudaCrossEntropy, RowsPastElement2To31AreAddressedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  // 16745 LLaMA-3 rows: the last starts at element 2'147'518'464 > 2^31. Rows 0, 16743 and
  // 16744 have values and labels; every other row is ignored, so its logits are never read.
  const std::int64_t rows = 16745, cols = 128256;
  std::optional<Tensor> logits, grad;
  try {
    logits.emplace(Shape{rows, cols}, DType::BF16, kCuda);
    grad.emplace(Shape{rows, cols}, DType::BF16, kCuda);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::OutOfMemory) GTEST_SKIP() << "needs 9 GB of device memory";
    throw;
  }
  const std::vector<std::int64_t> live = {0, rows - 2, rows - 1};
  const Tensor values_of_live = test::randn({3, cols}, DType::BF16, 16, 2.0);
  Tensor labels = test::full({rows}, DType::I64, -100);
  const Tensor live_labels = from({3}, DType::I64, {17, 128255, 4242});
  for (std::size_t k = 0; k < live.size(); ++k) {
    copy(values_of_live.view().narrow(0, k, 1), logits->view().narrow(0, live[k], 1));
    copy(live_labels.view().narrow(0, k, 1), labels.view().narrow(0, live[k], 1));
  }
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  Tensor loss({rows}, DType::BF16, kCuda), lse({rows}, DType::F32, kCuda);
  const Tensor glabels = to_cuda(labels);
  cross_entropy(*logits, glabels, loss, lse, o);
  const Tensor grad_loss = to_cuda(test::full({rows}, DType::BF16, 1));
  cross_entropy_backward(grad_loss, *logits, glabels, lse, *grad, o);

  const Forward ref = reference_forward(values_of_live, live_labels, o);
  const Tensor ref_grad =
      reference_backward(test::full({3}, DType::BF16, 1), values_of_live, live_labels, ref.lse, o);
  const std::vector<double> all_loss = values(to_cpu(loss)), all_lse = values(to_cpu(lse));
  const std::vector<double> ref_loss = values(ref.loss), ref_lse = values(ref.lse);
  for (std::size_t k = 0; k < live.size(); ++k) {
    EXPECT_NEAR(all_loss[live[k]], ref_loss[k], 2e-2 * (1 + std::fabs(ref_loss[k]))) << live[k];
    EXPECT_NEAR(all_lse[live[k]], ref_lse[k], 1e-5 * (1 + std::fabs(ref_lse[k]))) << live[k];
    test::expect_close(to_cpu(grad->view().narrow(0, live[k], 1)), ref_grad.view().narrow(0, k, 1),
                       "grad_logits row " + std::to_string(live[k]));
  }
  EXPECT_EQ(all_loss[rows - 3], 0.0);
  for (double g : values(to_cpu(grad->view().narrow(0, rows - 3, 1)))) ASSERT_EQ(g, 0.0);
}

}  // namespace
}  // namespace meshfuse
