// cross_entropy on every backend the build has (reference and cpu on the CPU; reference and cuda
// on CUDA tensors), against the reference backend on the CPU. CUDA cases skip without a GPU.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/softmax/softmax_kernels.h"  // row_offset
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::make_labels;
using test::on;
using test::randn;
using test::Target;
using test::to_cpu;
using test::values;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The oracle: the reference backend on CPU tensors.
const Target kOracle{KernelBackend::Reference, Device{}};

Shape loss_shape(std::int64_t rows, Reduction r) {
  return r == Reduction::None ? Shape{rows} : Shape{};
}

struct Forward {
  Tensor loss, lse;
};

// The op on `target`: CPU inputs are copied to its device, the outputs come back to the CPU.
// The loss has `loss_dtype`, or the logits' dtype when it is not given.
Forward forward(const Target& target, const TensorView& logits, const TensorView& labels,
                const CrossEntropyOptions& o, const Stream& stream,
                std::optional<DType> loss_dtype = std::nullopt) {
  ForceKernelBackend force(target.backend);
  const std::int64_t n = logits.size(0);
  Tensor loss(loss_shape(n, o.reduction), loss_dtype.value_or(logits.dtype()), target.device,
              stream),
      lse({n}, cross_entropy_lse_dtype(logits.dtype()), target.device, stream);
  cross_entropy(on(logits, target.device, stream), on(labels, target.device, stream), loss, lse, o,
                stream);
  return {to_cpu(loss, stream), to_cpu(lse, stream)};
}

Tensor backward(const Target& target, const TensorView& grad_loss, const TensorView& logits,
                const TensorView& labels, const TensorView& lse, const CrossEntropyOptions& o,
                const Stream& stream) {
  ForceKernelBackend force(target.backend);
  Tensor grad(logits.shape(), logits.dtype(), target.device, stream);
  cross_entropy_backward(on(grad_loss, target.device, stream), on(logits, target.device, stream),
                         on(labels, target.device, stream), on(lse, target.device, stream), grad, o,
                         stream);
  return to_cpu(grad, stream);
}

// An upstream gradient of the loss's shape (varied per row for `none`).
Tensor upstream(std::int64_t rows, DType dtype, Reduction r) {
  return r == Reduction::None ? randn({rows}, dtype, 99) : test::full({}, dtype, 1.5);
}

// `target` against the oracle: loss, lse, and the gradient (both backwards given the oracle's
// lse, so that they see the same inputs). The reference on CUDA tensors runs the oracle's loops
// on host copies, so it must be bitwise the oracle.
void expect_matches_reference(const Target& target, const Stream& stream, const TensorView& logits,
                              const TensorView& labels, const CrossEntropyOptions& o,
                              const std::string& what) {
  const Tensor dl = upstream(logits.size(0), logits.dtype(), o.reduction);
  const Forward ref = forward(kOracle, logits, labels, o, {});
  const Tensor ref_grad = backward(kOracle, dl, logits, labels, ref.lse, o, {});
  const Forward got = forward(target, logits, labels, o, stream);
  const Tensor grad = backward(target, dl, logits, labels, ref.lse, o, stream);
  if (target.backend == KernelBackend::Reference) {
    EXPECT_TRUE(testing::bitwise_equal(got.loss, ref.loss)) << what << " loss";
    EXPECT_TRUE(testing::bitwise_equal(got.lse, ref.lse)) << what << " lse";
    EXPECT_TRUE(testing::bitwise_equal(grad, ref_grad)) << what << " grad_logits";
    return;
  }
  test::expect_close(got.loss, ref.loss, what + " loss");
  // An lse from f32 sums (f64 for f32 logits too) is as close as f32 arithmetic gets.
  test::expect_close(
      got.lse, ref.lse,
      testing::default_tolerance(logits.dtype() == DType::F64 ? DType::F64 : DType::F32),
      what + " lse");
  test::expect_close(grad, ref_grad, what + " grad_logits");
}

// Plain; label smoothing with a logits multiplier and z-loss.
std::vector<CrossEntropyOptions> option_sets(Reduction r) {
  return {{-100, r, 0.0, 1.0, 0.0}, {-100, r, 0.1, 0.7, 1e-3}};
}

class CrossEntropyBackends : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(CrossEntropyBackends, MatchesTheReferenceForEveryReductionOptionAndLabelDType) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // 1 and 7: scalar loads; 33 and 1100: vector steps with a remainder; 1000: 16-byte vectors
  // with a partial last step; 128256: LLaMA-3.
  for (const auto& [vocab, rows] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 10}, {7, 10}, {33, 10}, {1000, 10}, {1100, 10}, {128256, 3}}) {
    const Tensor logits = randn({rows, vocab}, dtype, 1, 2.0);
    for (DType label_dtype : {DType::I32, DType::I64}) {
      const Tensor labels = make_labels(rows, vocab, label_dtype, 2);
      for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
        for (const CrossEntropyOptions& o : option_sets(r))
          expect_matches_reference(target, stream, logits, labels, o,
                                   fmt::format("V={} {} {} eps={}", vocab, to_string(label_dtype),
                                               to_string(r), o.label_smoothing));
    }
  }
}

// Logits far below zero (every row's max under -100, so exp without the row's max as shift
// underflows) give the loss and lse of the same logits shifted to near zero: the loss unchanged,
// the lse moved by the shift. Widths off the vector width: the 16-bit path's next-row max once
// padded a row's end with -0's key, so every row after the first had shift 0 and an lse of -inf.
TEST_P(CrossEntropyBackends, LogitsFarBelowZeroGiveTheLossOfTheShiftedLogits) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (std::int64_t vocab : {2, 17, 33}) {
    // Whole numbers in [-4, 4): exact in every dtype, also 128 lower.
    Tensor near({6, vocab}, DType::F64);
    for (std::int64_t i = 0; i < near.numel(); ++i)
      near.data_ptr<double>()[i] = static_cast<double>((i * 5) % 8 - 4);
    Tensor far = Tensor::copy_of(near);
    for (std::int64_t i = 0; i < far.numel(); ++i) far.data_ptr<double>()[i] -= 128;
    Tensor near_x({6, vocab}, dtype), far_x({6, vocab}, dtype);
    copy(near, near_x);
    copy(far, far_x);
    Tensor labels({6}, DType::I64);  // none ignored: an ignored row's lse is 0
    for (std::int64_t r = 0; r < 6; ++r) labels.data_ptr<std::int64_t>()[r] = r % vocab;
    const CrossEntropyOptions o{-100, Reduction::None, 0.0, 1.0, 0.0};
    const Forward a = forward(target, near_x, labels, o, stream);
    const Forward b = forward(target, far_x, labels, o, stream);
    const std::vector<double> la = test::values(a.loss), lb = test::values(b.loss);
    const std::vector<double> sa = test::values(a.lse), sb = test::values(b.lse);
    for (std::size_t r = 0; r < 6; ++r) {
      EXPECT_NEAR(lb[r], la[r], 1e-2 * (1 + std::fabs(la[r]))) << "V=" << vocab << " row " << r;
      EXPECT_NEAR(sb[r], sa[r] - 128, 1e-5 * 128) << "V=" << vocab << " row " << r;
    }
  }
}

TEST_P(CrossEntropyBackends, MatchesTheReferenceAtV262144) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor logits = randn({2, 262144}, dtype, 3, 2.0);
  const Tensor labels = from({2}, DType::I64, {262143, 5});
  for (const CrossEntropyOptions& o : option_sets(Reduction::Mean))
    expect_matches_reference(target, stream, logits, labels, o, "V=262144");
}

TEST_P(CrossEntropyBackends, Int32AndInt64LabelsGiveBitwiseTheSameResults) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  for (std::int64_t vocab : {100, 1000}) {
    const Tensor logits = randn({9, vocab}, dtype, 3);
    const Tensor l64 = make_labels(9, vocab, DType::I64, 4), l32({9}, DType::I32);
    copy(l64, l32);
    const CrossEntropyOptions o{-100, Reduction::None, 0.1, 1.0, 0.0};
    const Forward a = forward(target, logits, l64, o, stream),
                  b = forward(target, logits, l32, o, stream);
    EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss)) << vocab;
    EXPECT_TRUE(testing::bitwise_equal(a.lse, b.lse)) << vocab;
    const Tensor dl = upstream(9, dtype, o.reduction);
    EXPECT_TRUE(testing::bitwise_equal(backward(target, dl, logits, l64, a.lse, o, stream),
                                       backward(target, dl, logits, l32, a.lse, o, stream)))
        << vocab;
  }
}

// 16-bit logits with an f32 loss (what Megatron-LM returns): the double per-row losses rounded
// once to f32, so the reference gives bitwise the f64 loss of the same logits rounded to f32, and
// the other backends agree with it to f32's tolerance (their lse is f32). An f32 grad_loss gives
// the gradient of a 16-bit grad_loss of the same value, bit for bit.
TEST_P(CrossEntropyBackends, Fp32LossOf16BitLogitsIsTheDoubleLossRoundedOnce) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  if (dtype != DType::BF16 && dtype != DType::F16) GTEST_SKIP() << "for 16-bit logits";
  const Stream stream{target.device};
  const Tensor logits = randn({33, 1000}, dtype, 21, 4.0), wide({33, 1000}, DType::F64);
  copy(logits, wide);
  const Tensor labels = make_labels(33, 1000, DType::I64, 22);
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    for (const CrossEntropyOptions& o : option_sets(r)) {
      const std::string what = fmt::format("{} eps={}", to_string(r), o.label_smoothing);
      const Forward exact = forward(kOracle, wide, labels, o, {});
      const Tensor rounded(exact.loss.shape(), DType::F32);
      copy(exact.loss, rounded);
      const Forward got = forward(target, logits, labels, o, stream, DType::F32);
      ASSERT_EQ(got.loss.dtype(), DType::F32);
      if (target.backend == KernelBackend::Reference)
        EXPECT_TRUE(testing::bitwise_equal(got.loss, rounded)) << what;
      else
        test::expect_close(got.loss, rounded, 1e-5, what);
      const Tensor dl = upstream(33, dtype, r), dl32(dl.shape(), DType::F32);
      copy(dl, dl32);
      EXPECT_TRUE(testing::bitwise_equal(backward(target, dl32, logits, labels, got.lse, o, stream),
                                         backward(target, dl, logits, labels, got.lse, o, stream)))
          << what;
    }
  }
}

TEST_P(CrossEntropyBackends, OneRowMatchesReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor logits = randn({1, 129}, dtype, 5);
  const Tensor labels = from({1}, DType::I64, {17});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
    expect_matches_reference(target, stream, logits, labels, option_sets(r)[1],
                             std::string(to_string(r)));
}

TEST_P(CrossEntropyBackends, WithoutLseTheLossIsBitwiseTheLossWithIt) {
  // Inference leaves lse out (no backward to save it for): same loss, nothing else written.
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor logits = randn({6, 1100}, dtype, 8, 2.0);
  const Tensor labels = from({6}, DType::I64, {3, -100, 1099, 0, 512, 7});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
    for (const CrossEntropyOptions& o : option_sets(r)) {
      const Forward with = forward(target, logits, labels, o, stream);
      ForceKernelBackend force(target.backend);
      Tensor loss(loss_shape(6, r), dtype, target.device, stream);
      cross_entropy(on(logits, target.device, stream), on(labels, target.device, stream), loss, {},
                    o, stream);
      EXPECT_TRUE(testing::bitwise_equal(to_cpu(loss, stream), with.loss))
          << to_string(r) << " eps=" << o.label_smoothing;
    }
}

TEST_P(CrossEntropyBackends, ZeroRowsGiveEmptyNanMeanAndZeroSum) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor logits({0, 16}, dtype), labels({0}, DType::I64);
  EXPECT_EQ(forward(target, logits, labels, {.reduction = Reduction::None}, stream).loss.shape(),
            Shape{0});
  EXPECT_TRUE(std::isnan(values(forward(target, logits, labels, {}, stream).loss)[0]));
  EXPECT_EQ(values(forward(target, logits, labels, {.reduction = Reduction::Sum}, stream).loss)[0],
            0.0);
  const Forward f = forward(target, logits, labels, {}, stream);
  EXPECT_EQ(backward(target, test::full({}, dtype, 1), logits, labels, f.lse, {}, stream).shape(),
            (Shape{0, 16}));
}

TEST_P(CrossEntropyBackends, IgnoreIndexMayBeAnyValue) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // ignore_index = 3 is a valid class: rows labelled 3 are left out.
  const Tensor logits = randn({6, 50}, dtype, 6);
  const Tensor labels = from({6}, DType::I64, {3, 0, 49, 3, 12, 7});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
    expect_matches_reference(target, stream, logits, labels, {.ignore_index = 3, .reduction = r},
                             "ignore_index=3 " + std::string(to_string(r)));
}

TEST_P(CrossEntropyBackends, AllLabelsIgnoredGiveZeroNoneNanMeanZeroSumAndZeroGrads) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // The ignored rows hold NaN logits: an ignored row is never read, so nothing leaks.
  Tensor logits = randn({4, 50}, dtype, 7);
  copy(test::full({1, 1}, DType::F64, NAN), logits.view().narrow(0, 2, 1).narrow(1, 7, 1));
  const Tensor labels = from({4}, DType::I32, {-100, -100, -100, -100});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    const CrossEntropyOptions o{.reduction = r, .label_smoothing = 0.2, .z_loss_scale = 1e-4};
    const Forward f = forward(target, logits, labels, o, stream);
    for (double v : values(f.loss)) {
      if (r == Reduction::Mean)
        EXPECT_TRUE(std::isnan(v));
      else
        EXPECT_EQ(v, 0.0) << to_string(r);
    }
    for (double l : values(f.lse)) EXPECT_EQ(l, 0.0) << to_string(r);
    for (double g :
         values(backward(target, upstream(4, dtype, r), logits, labels, f.lse, o, stream)))
      ASSERT_EQ(g, 0.0) << to_string(r);
  }
}

TEST_P(CrossEntropyBackends, NonContiguousLogitsAndLabelsGiveTheContiguousResult) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device device = target.device;
  const Tensor host_logits = randn({6, 40}, dtype, 7);
  const Tensor host_labels = make_labels(6, 40, DType::I64, 8);
  const Tensor logits = on(host_logits, device, stream), labels = on(host_labels, device, stream);
  // Transposed logits, and labels in column 0 of a (6, 2) buffer: stride 2.
  const Tensor transposed = on(Tensor::copy_of(host_logits.view().transpose(0, 1)), device, stream);
  const TensorView strided_logits = transposed.view().transpose(0, 1);
  const Tensor spread = Tensor::zeros({6, 2}, DType::I64, device, stream);
  const TensorView strided_labels(spread.data_ptr<void>(), DType::I64, {6}, {2}, device);
  copy(host_labels, strided_labels, stream);

  ForceKernelBackend force(target.backend);
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  const DType lse_dtype = cross_entropy_lse_dtype(dtype);
  Tensor la({6}, dtype, device, stream), lb({6}, dtype, device, stream),
      sa({6}, lse_dtype, device, stream), sb({6}, lse_dtype, device, stream);
  cross_entropy(logits, labels, la, sa, o, stream);
  cross_entropy(strided_logits, strided_labels, lb, sb, o, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(la, stream), to_cpu(lb, stream)));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(sa, stream), to_cpu(sb, stream)));
  const Tensor dl = on(upstream(6, dtype, o.reduction), device, stream);
  Tensor ga(logits.shape(), dtype, device, stream), gb(logits.shape(), dtype, device, stream);
  cross_entropy_backward(dl, logits, labels, sa, ga, o, stream);
  cross_entropy_backward(dl, strided_logits, strided_labels, sa, gb, o, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(ga, stream), to_cpu(gb, stream)));
}

TEST_P(CrossEntropyBackends, NonFiniteLogitsBehaveLikeTorchAndTheReference) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // Rows (special values at both ends and in the middle of a row):
  //   0: -inf away from the label: finite loss and gradient;  1: -inf at the label: loss +inf;
  //   2: entirely -inf: NaN;  3: a NaN: NaN;  4: a +inf: NaN;  5: finite.
  // 3000 columns (16-byte vectors) and 3001 (scalar loads).
  for (std::int64_t v : {3000, 3001}) {
    Tensor logits = randn({6, v}, dtype, 8);
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
    const Forward f = forward(target, logits, labels, o, stream);
    const std::vector<double> loss = values(f.loss);
    EXPECT_TRUE(std::isfinite(loss[0])) << v;
    EXPECT_EQ(loss[1], kInf) << v;
    for (int row : {2, 3, 4}) EXPECT_TRUE(std::isnan(loss[row])) << v << " row " << row;
    EXPECT_TRUE(std::isfinite(loss[5])) << v;
    const std::vector<double> grad =
        values(backward(target, test::full({6}, dtype, 1), logits, labels, f.lse, o, stream));
    for (std::int64_t j = 0; j < 2 * v; ++j) ASSERT_TRUE(std::isfinite(grad[j])) << v << " " << j;
    // With label smoothing a -inf logit makes the loss +inf, as in PyTorch.
    const CrossEntropyOptions smooth{.reduction = Reduction::None, .label_smoothing = 0.1};
    EXPECT_EQ(values(forward(target, logits, labels, smooth, stream).loss)[0], kInf) << v;
    expect_matches_reference(target, stream, logits, labels, o, fmt::format("non-finite V={}", v));
    expect_matches_reference(target, stream, logits, labels, smooth,
                             fmt::format("non-finite smoothed V={}", v));
  }
}

TEST_P(CrossEntropyBackends, InfiniteUpstreamGivesInfiniteGradientsNotNan) {
  // grad = upstream * (p - smoothing / V - onehot (1 - smoothing)): with an infinite upstream
  // every entry is +-inf by the sign of the bracket, as the reference and PyTorch give; folding
  // the upstream into the terms would give inf - inf (or inf * 0 without smoothing) = NaN.
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  Tensor logits = randn({2, 37}, dtype, 3);
  // p = 0 (-inf) and p tiny (-30): below the smoothing term, so their gradient has the other sign
  // (and 0 * inf = NaN without smoothing).
  copy(test::full({1, 1}, DType::F64, -kInf), logits.view().narrow(0, 0, 1).narrow(1, 7, 1));
  copy(test::full({1, 1}, DType::F64, -30.0), logits.view().narrow(0, 1, 1).narrow(1, 8, 1));
  const Tensor labels = from({2}, DType::I64, {5, 36});
  for (const double smoothing : {0.0, 0.1}) {
    const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = smoothing};
    const Forward f = forward(target, logits, labels, o, stream);
    for (const double up : {-kInf, kInf}) {
      const Tensor dl = test::full({2}, dtype, up);
      const std::vector<double> grad = values(backward(target, dl, logits, labels, f.lse, o, stream));
      const std::vector<double> ref = values(backward(kOracle, dl, logits, labels, f.lse, o, {}));
      for (std::size_t j = 0; j < grad.size(); ++j) {
        const std::string at = fmt::format("smoothing {} upstream {} entry {}", smoothing, up, j);
        if (smoothing == 0 && j == 7) {  // p = 0 exactly: 0 * inf
          EXPECT_TRUE(std::isnan(ref[j]) && std::isnan(grad[j])) << at;
          continue;
        }
        ASSERT_TRUE(std::isinf(ref[j])) << at;
        EXPECT_EQ(grad[j], ref[j]) << at;
      }
    }
  }
}

TEST_P(CrossEntropyBackends, DeterministicRunToRunOnAStream) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  // On CUDA a stream of its own (non-blocking with respect to the default stream), as in training.
  std::optional<CudaStream> cuda;
  if (target.device.type == DeviceType::CUDA) cuda.emplace(target.device.index);
  const Stream stream = cuda ? cuda->stream() : Stream{target.device};
  const Tensor logits = randn({300, 3001}, dtype, 12);
  const Tensor labels = make_labels(300, 3001, DType::I64, 13);
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    const CrossEntropyOptions o{.reduction = r, .label_smoothing = 0.1, .z_loss_scale = 1e-4};
    const Forward a = forward(target, logits, labels, o, stream),
                  b = forward(target, logits, labels, o, stream);
    EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss)) << to_string(r);
    EXPECT_TRUE(testing::bitwise_equal(a.lse, b.lse)) << to_string(r);
    const Tensor dl = test::full({}, dtype, 1);
    EXPECT_TRUE(testing::bitwise_equal(backward(target, dl, logits, labels, a.lse, o, stream),
                                       backward(target, dl, logits, labels, a.lse, o, stream)))
        << to_string(r);
  }
}

// LabelCheck::DeviceAssert (on CUDA: no host wait, and a forward without the check kernel that
// counts mean's rows in its reduction) gives Raise's results bitwise: with ignored rows, every row
// ignored, no rows, more rows than the reduction's 1024 threads, and a vocabulary shard whose
// labels in other shards are valid. The CPU backends check on the host either way, so a bad
// label still raises.
TEST_P(CrossEntropyBackends, DeviceAssertLabelCheckGivesTheRaiseResultsBitwise) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  constexpr std::int64_t kRows = 1500, kVocab = 301;
  // Labels for `classes` classes, every fifth row ignored.
  const auto labels_of = [](std::int64_t classes) {
    Tensor y({kRows}, DType::I64);
    for (std::int64_t i = 0; i < kRows; ++i)
      y.data_ptr<std::int64_t>()[i] = i % 5 == 0 ? -100 : (i * 41) % classes;
    return y;
  };
  const Tensor logits = randn({kRows, kVocab}, dtype, 21);
  const CrossEntropyOptions plain{.label_smoothing = 0.1, .z_loss_scale = 1e-4};
  // Columns [100, 401) of 1000 classes: most labels lie in other shards.
  const CrossEntropyOptions shard{.vocab_start = 100, .vocab_size = 1000};
  const std::vector<std::tuple<std::string, Tensor, CrossEntropyOptions>> cases = {
      {"some ignored", labels_of(kVocab), plain},
      {"all ignored", test::full({kRows}, DType::I32, -100), plain},
      {"shard", labels_of(1000), shard}};
  for (const auto& [what, labels, options] : cases)
    for (std::int64_t rows : {kRows, std::int64_t{37}, std::int64_t{0}})
      for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
        const std::string name =
            what + ", " + std::to_string(rows) + " rows, " + std::string(to_string(r));
        const TensorView x = logits.view().narrow(0, 0, rows), y = labels.view().narrow(0, 0, rows);
        CrossEntropyOptions o = options;
        o.reduction = r;
        const Forward raised = forward(target, x, y, o, stream);
        const Tensor dl = upstream(rows, dtype, r);
        const Tensor grad_raised = backward(target, dl, x, y, raised.lse, o, stream);
        o.label_check = LabelCheck::DeviceAssert;
        const Forward asserted = forward(target, x, y, o, stream);
        EXPECT_TRUE(testing::bitwise_equal(asserted.loss, raised.loss)) << name;
        EXPECT_TRUE(testing::bitwise_equal(asserted.lse, raised.lse)) << name;
        EXPECT_TRUE(
            testing::bitwise_equal(backward(target, dl, x, y, raised.lse, o, stream), grad_raised))
            << name;
      }
  if (target.device.type != DeviceType::CPU) return;  // on CUDA a bad label would trap
  const Tensor bad = from({3}, DType::I64, {0, kVocab, 1});
  const CrossEntropyOptions o{.label_check = LabelCheck::DeviceAssert};
  test::expect_error([&] { forward(target, logits.view().narrow(0, 0, 3), bad, o, stream); },
                     ErrorCode::InvalidArgument, {"cross_entropy", "labels[1] = 301", "[0, 301)"});
}

TEST_P(CrossEntropyBackends, LabelOutOfRangeNamesTheRowAndValueBeforeAnyWork) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device device = target.device;
  const DType lse_dtype = cross_entropy_lse_dtype(dtype);
  // A tensor of `value`s on the target's device.
  const auto filled = [&](Shape shape, DType type, double value) {
    return on(test::full(std::move(shape), type, value), device, stream);
  };
  ForceKernelBackend force(target.backend);
  const Tensor logits = on(randn({5, 4}, dtype, 14), device, stream);
  const Tensor dl = filled({}, dtype, 1), lse = filled({5}, lse_dtype, 0);
  for (DType label_dtype : {DType::I32, DType::I64}) {
    // Rows 3 and 4 are both out of range: the first is reported.
    const Tensor too_big = on(from({5}, label_dtype, {0, -100, 3, 4, 9}), device, stream);
    const Tensor loss = filled({}, dtype, 7), lse_out = filled({5}, lse_dtype, 7);
    test::expect_error([&] { cross_entropy(logits, too_big, loss, lse_out, {}, stream); },
                       ErrorCode::InvalidArgument,
                       {"cross_entropy", "labels[3] = 4", "[0, 4)", "-100"});
    EXPECT_EQ(values(to_cpu(loss, stream))[0], 7.0);  // nothing written
    for (double l : values(to_cpu(lse_out, stream))) EXPECT_EQ(l, 7.0);
    const Tensor negative = on(from({5}, label_dtype, {0, 1, -1, 2, -7}), device, stream);
    const Tensor grad = filled({5, 4}, dtype, 7);
    test::expect_error([&] { cross_entropy_backward(dl, logits, negative, lse, grad, {}, stream); },
                       ErrorCode::InvalidArgument, {"cross_entropy_backward", "labels[2] = -1"});
    for (double g : values(to_cpu(grad, stream))) ASSERT_EQ(g, 7.0);
  }
  // A shard's labels range over the whole vocabulary: columns 4..7 of 12 classes take label 11
  // (in another shard) and reject 12.
  const CrossEntropyOptions shard{.vocab_start = 4, .vocab_size = 12};
  const Tensor beyond = on(from({5}, DType::I64, {0, 11, -100, 12, 13}), device, stream);
  const Tensor shard_loss = filled({}, dtype, 7), shard_lse = filled({5}, lse_dtype, 7);
  test::expect_error([&] { cross_entropy(logits, beyond, shard_loss, shard_lse, shard, stream); },
                     ErrorCode::InvalidArgument,
                     {"cross_entropy", "labels[3] = 12", "[0, 12)", "-100"});
  EXPECT_EQ(values(to_cpu(shard_loss, stream))[0], 7.0);
  const Tensor shard_grad = filled({5, 4}, dtype, 7);
  test::expect_error(
      [&] { cross_entropy_backward(dl, logits, beyond, lse, shard_grad, shard, stream); },
      ErrorCode::InvalidArgument, {"cross_entropy_backward", "labels[3] = 12", "[0, 12)"});
  for (double g : values(to_cpu(shard_grad, stream))) ASSERT_EQ(g, 7.0);
  // A label past 2^31 is reported with its full value.
  const Tensor huge = on(from({2}, DType::I64, {1, 5'000'000'000.0}), device, stream);
  const Tensor loss = filled({}, dtype, 7), lse_out = filled({2}, lse_dtype, 7);
  test::expect_error(
      [&] { cross_entropy(logits.view().narrow(0, 0, 2), huge, loss, lse_out, {}, stream); },
      ErrorCode::InvalidArgument, {"labels[1] = 5000000000"});
}

// Labels spread over the vocabulary (the last row's is V - 1), so that every shard of a split
// holds some, with rows 1, 4, 7, ... ignored.
Tensor spread_labels(std::int64_t rows, std::int64_t vocab, DType dtype) {
  Tensor labels({rows}, DType::I64), typed({rows}, dtype);
  std::int64_t* y = labels.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < rows; ++i)
    y[i] = i % 3 == 1 ? -100 : i == rows - 1 ? vocab - 1 : i * vocab / rows;
  copy(labels, typed);
  return typed;
}

// lse and loss of cross_entropy.h for the columns [start, start + width) of x (rows x vocab, row
// major) as a shard of the whole vocabulary, in double; 0 for ignored rows.
std::pair<Tensor, Tensor> shard_lse_and_loss(const std::vector<double>& x,
                                             const std::vector<double>& y, std::int64_t vocab,
                                             std::int64_t start, std::int64_t width,
                                             const CrossEntropyOptions& o) {
  const auto rows = static_cast<std::int64_t>(y.size());
  const double m = o.logits_multiplier, eps = o.label_smoothing, z = o.z_loss_scale;
  Tensor lse = Tensor::zeros({rows}, DType::F64), loss = Tensor::zeros({rows}, DType::F64);
  for (std::int64_t i = 0; i < rows; ++i) {
    if (y[i] == o.ignore_index) continue;
    const double* v = x.data() + i * vocab + start;
    double max = -kInf, sum = 0, sum_v = 0;
    for (std::int64_t j = 0; j < width; ++j) max = std::max(max, m * v[j]);
    for (std::int64_t j = 0; j < width; ++j) {
      sum += std::exp(m * v[j] - max);
      sum_v += m * v[j];
    }
    const double l = max + std::log(sum);
    const auto col = static_cast<std::int64_t>(y[i]) - start;
    const double v_label = col >= 0 && col < width ? m * v[col] : 0.0;
    lse.data_ptr<double>()[i] = l;
    loss.data_ptr<double>()[i] =
        (1 - eps) * (l - v_label) + eps * (l - sum_v / static_cast<double>(vocab)) + z * l * l;
  }
  return {lse, loss};
}

// Megatron-LM's vocabulary-parallel cross-entropy from shards: a (N, V) problem split into uneven
// column shards; each shard's lse and loss are cross_entropy.h's; combined as the header says they
// give the whole problem's lse and per-row loss; and each shard's backward given the whole lse is
// its columns of the whole backward.
TEST_P(CrossEntropyBackends, VocabularyShardsCombineIntoTheWholeVocabulary) {
  const auto [target, dtype] = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // An f32 loss for 16-bit logits: the shards' losses combine without a 16-bit rounding each.
  const DType loss_dtype = is_sixteen_bit(dtype) ? DType::F32 : dtype;
  // lse and loss come from f32 sums but for f64 logits.
  const double tol = testing::default_tolerance(dtype == DType::F64 ? DType::F64 : DType::F32);
  struct Split {
    std::int64_t vocab, rows;
    std::vector<std::vector<std::int64_t>> bounds;  // shard k: [bounds[k], bounds[k + 1])
  };
  // Shards of 16-byte vectors and of scalar loads; labels at a shard's first column.
  for (const auto& [vocab, rows, splits] :
       std::vector<Split>{{29, 7, {{0, 12, 29}, {0, 5, 17, 29}}},
                          {1000, 70, {{0, 600, 1000}, {0, 250, 511, 1000}}}}) {
    const Tensor logits = randn({rows, vocab}, dtype, 31, 2.0);
    const Tensor labels = spread_labels(rows, vocab, vocab == 29 ? DType::I64 : DType::I32);
    const std::vector<double> x = values(logits), y = values(labels);
    for (const CrossEntropyOptions& whole_o : option_sets(Reduction::None)) {
      const double z = whole_o.z_loss_scale;
      const Forward whole = forward(target, logits, labels, whole_o, stream, loss_dtype);
      // The whole vocabulary named as a shard is the default, bit for bit.
      CrossEntropyOptions named = whole_o;
      named.vocab_size = vocab;
      const Forward same = forward(target, logits, labels, named, stream, loss_dtype);
      EXPECT_TRUE(testing::bitwise_equal(same.loss, whole.loss)) << vocab;
      EXPECT_TRUE(testing::bitwise_equal(same.lse, whole.lse)) << vocab;
      for (const std::vector<std::int64_t>& bounds : splits) {
        std::string what = fmt::format("V={} eps={} shards", vocab, whole_o.label_smoothing);
        for (std::int64_t b : bounds) what += fmt::format(" {}", b);
        std::vector<std::vector<double>> shard_lse;
        std::vector<double> linear(static_cast<std::size_t>(rows), 0.0);  // sum of lse+z*lse^2-loss
        for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
          const std::int64_t start = bounds[k], width = bounds[k + 1] - start;
          CrossEntropyOptions o = whole_o;
          o.vocab_start = start;
          o.vocab_size = vocab;
          const Forward f =
              forward(target, logits.view().narrow(1, start, width), labels, o, stream, loss_dtype);
          const auto [lse, loss] = shard_lse_and_loss(x, y, vocab, start, width, o);
          test::expect_close(f.lse, lse, tol, fmt::format("{} shard {} lse", what, k));
          test::expect_close(f.loss, loss, tol, fmt::format("{} shard {} loss", what, k));
          const std::vector<double> l = values(f.lse), li = values(f.loss);
          for (std::int64_t i = 0; i < rows; ++i) linear[i] += l[i] + z * l[i] * l[i] - li[i];
          shard_lse.push_back(l);
        }
        // Combined in double: lse = logsumexp over the shards, loss = lse + z lse^2 - linear.
        Tensor lse = Tensor::zeros({rows}, DType::F64), loss = Tensor::zeros({rows}, DType::F64);
        for (std::int64_t i = 0; i < rows; ++i) {
          if (y[i] == whole_o.ignore_index) continue;
          double max = -kInf, sum = 0;
          for (const std::vector<double>& l : shard_lse) max = std::max(max, l[i]);
          for (const std::vector<double>& l : shard_lse) sum += std::exp(l[i] - max);
          const double global = max + std::log(sum);
          lse.data_ptr<double>()[i] = global;
          loss.data_ptr<double>()[i] = global + z * global * global - linear[i];
        }
        test::expect_close(lse, whole.lse, tol, what + " combined lse");
        test::expect_close(loss, whole.loss, tol, what + " combined loss");
        // Each shard's backward with the whole lse: its columns of the whole backward.
        for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
          CrossEntropyOptions o = whole_o;
          o.reduction = r;
          const Tensor dl = upstream(rows, dtype, r);
          const Tensor whole_grad = backward(target, dl, logits, labels, whole.lse, o, stream);
          for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
            const std::int64_t start = bounds[k], width = bounds[k + 1] - start;
            o.vocab_start = start;
            o.vocab_size = vocab;
            const Tensor grad = backward(target, dl, logits.view().narrow(1, start, width), labels,
                                         whole.lse, o, stream);
            const TensorView expected = whole_grad.view().narrow(1, start, width);
            const std::string part = fmt::format("{} {} shard {} grad", what, to_string(r), k);
            if (target.backend == KernelBackend::Reference)
              EXPECT_TRUE(testing::bitwise_equal(grad, expected)) << part;
            else
              test::expect_close(grad, expected,
                                 dtype == DType::F32 ? 1e-6 : testing::default_tolerance(dtype),
                                 part);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, CrossEntropyBackends,
                         ::testing::ValuesIn(test::op_cases(test::all_targets())),
                         test::op_case_name);

// torch.nn.functional.cross_entropy on float64 logits (3, 5), labels [2, -100, 0]; the backward
// for grad_loss = 1 (mean, sum) and [1, 2, -0.5] (none).
struct TorchCase {
  Reduction reduction;
  double label_smoothing;
  std::vector<double> loss;
  std::vector<double> grad;
};

const Tensor kTorchLogits =
    from({3, 5}, DType::F64, {1, 2, 0.5, -1, 3, 0, 0, 0, 0, 0, -2, 4, 1, 1.5, 0.25});

const std::vector<TorchCase> kTorchCases = {
    {Reduction::None,
     0.0,
     {2.9722606813865564, 0.0, 6.1465808710029854},
     {0.08439385556553812, 0.22940628401739951, -0.9488125391081415, 0.011421466346391884,
      0.6235909331788119, 0, 0, 0, 0, 0, 0.4989296055478395, -0.4318279423964213,
      -0.021499447291244637, -0.035446596057371285, -0.010155619802802376}},
    {Reduction::None,
     0.1,
     {2.912260681386557, 0.0, 5.8515808710029855},
     {0.06439385556553812, 0.20940628401739952, -0.8688125391081415, -0.008578533653608117,
      0.6035909331788119, 0, 0, 0, 0, 0, 0.4589296055478395, -0.4218279423964213,
      -0.011499447291244637, -0.025446596057371283, -0.00015561980280237586}},
    {Reduction::Mean,
     0.0,
     {4.559420776194771},
     {0.04219692778276906, 0.11470314200869976, -0.4744062695540707, 0.005710733173195942,
      0.31179546658940593, 0, 0, 0, 0, 0, -0.4989296055478395, 0.4318279423964213,
      0.021499447291244637, 0.035446596057371285, 0.010155619802802376}},
    {Reduction::Mean,
     0.1,
     {4.381920776194771},
     {0.03219692778276906, 0.10470314200869976, -0.43440626955407075, -0.004289266826804058,
      0.3017954665894059, 0, 0, 0, 0, 0, -0.4589296055478395, 0.4218279423964213,
      0.011499447291244637, 0.025446596057371283, 0.00015561980280237586}},
    {Reduction::Sum,
     0.1,
     {8.763841552389541},
     {0.06439385556553812, 0.20940628401739952, -0.8688125391081415, -0.008578533653608117,
      0.6035909331788119, 0, 0, 0, 0, 0, -0.917859211095679, 0.8436558847928426,
      0.022998894582489274, 0.050893192114742566, 0.0003112396056047517}},
};

// Known values, on every target.
class CrossEntropyTorch : public ::testing::TestWithParam<Target> {};

TEST_P(CrossEntropyTorch, MatchesTorchWithIgnoreIndexAndLabelSmoothing) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Tensor labels = from({3}, DType::I64, {2, -100, 0});
  for (const TorchCase& c : kTorchCases) {
    const CrossEntropyOptions o{.reduction = c.reduction, .label_smoothing = c.label_smoothing};
    const std::string what = fmt::format("{} eps={}", to_string(c.reduction), c.label_smoothing);
    const Forward f = forward(target, kTorchLogits, labels, o, stream);
    const Tensor dl = c.reduction == Reduction::None ? from({3}, DType::F64, {1, 2, -0.5})
                                                     : test::full({}, DType::F64, 1);
    const Tensor grad = backward(target, dl, kTorchLogits, labels, f.lse, o, stream);
    const std::vector<double> loss = values(f.loss), g = values(grad);
    for (std::size_t i = 0; i < c.loss.size(); ++i) EXPECT_NEAR(loss[i], c.loss[i], 1e-13) << what;
    for (std::size_t i = 0; i < c.grad.size(); ++i) EXPECT_NEAR(g[i], c.grad[i], 1e-13) << what;
  }
}

TEST_P(CrossEntropyTorch, LogitsMultiplierAndZLossMatchTorchComposition) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  // v = 0.5 * logits; F.cross_entropy(v, labels, label_smoothing=0.1) plus
  // 1e-2 * mean over non-ignored rows of logsumexp(v)^2, and its gradient wrt logits.
  const Tensor labels = from({3}, DType::I32, {2, -100, 0});
  const CrossEntropyOptions o{.reduction = Reduction::Mean,
                              .label_smoothing = 0.1,
                              .logits_multiplier = 0.5,
                              .z_loss_scale = 1e-2};
  const std::vector<double> grad = {0.03520298692042505,
                                    0.061283519681383805,
                                    -0.19868988230456355,
                                    0.009789852361708769,
                                    0.10428304879556805,
                                    0,
                                    0,
                                    0,
                                    0,
                                    0,
                                    -0.22236409997812756,
                                    0.1483711518310887,
                                    0.029221729670219968,
                                    0.03894157069957944,
                                    0.018520227904025095};
  const Forward f = forward(target, kTorchLogits, labels, o, stream);
  EXPECT_NEAR(values(f.loss)[0], 2.802647849824765, 1e-13);
  EXPECT_NEAR(values(f.lse)[0], 2.373905090904424, 1e-13);
  EXPECT_NEAR(values(f.lse)[2], 2.5381160253571386, 1e-13);
  const std::vector<double> g = values(
      backward(target, test::full({}, DType::F64, 1), kTorchLogits, labels, f.lse, o, stream));
  for (std::size_t i = 0; i < grad.size(); ++i) EXPECT_NEAR(g[i], grad[i], 1e-13) << i;
}

INSTANTIATE_TEST_SUITE_P(, CrossEntropyTorch, ::testing::ValuesIn(test::all_targets()),
                         test::target_param_name);

// The row-block kernels that fused linear cross-entropy runs a chunk of rows at a time.
class CrossEntropyRowKernels : public ::testing::TestWithParam<Target> {};

TEST_P(CrossEntropyRowKernels, OnChunksEqualTheWholeOpAndRunInPlace) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const Device device = target.device;
  // Logits for rows [5, 13) in their own buffer, the labels / lse / per-row losses / upstream of
  // all 13 rows, all on the target's device.
  const std::int64_t n = 13, v = 1100, begin = 5, rows = 8;
  const Tensor logits = randn({n, v}, DType::F32, 12);
  const Tensor labels = make_labels(n, v, DType::I32, 13);
  const CrossEntropyOptions o{.reduction = Reduction::None,
                              .label_smoothing = 0.1,
                              .logits_multiplier = 0.8,
                              .z_loss_scale = 1e-3};
  const Forward whole = forward(target, logits, labels, o, stream);
  const Tensor dl = upstream(n, DType::F32, o.reduction);
  const Tensor whole_grad = backward(target, dl, logits, labels, whole.lse, o, stream);

  const Tensor chunk = on(logits.view().narrow(0, begin, rows), device, stream);
  const Tensor on_labels = on(labels, device, stream), on_dl = on(dl, device, stream);
  const Tensor lse = Tensor::zeros({n}, cross_entropy_lse_dtype(DType::F32), device, stream);
  const Tensor row_loss = on(test::full({n}, DType::F64, -1.0), device, stream);
  const detail::CrossEntropyShape shape{DType::F32, DType::F32, DType::I32, n, v};
  const detail::CrossEntropyRows block{DType::F32, DType::I32, begin, rows, v};
  if (target.backend == KernelBackend::CPU) {
    std::vector<double> row_grad;
    const detail::CrossEntropyUpstream up =
        detail::read_upstream(shape, on_dl.data_ptr<void>(), 0, o.reduction, row_grad);
    detail::cpu::cross_entropy_forward_rows(block, chunk.data_ptr<void>(),
                                            on_labels.data_ptr<void>(), lse.data_ptr<void>(),
                                            row_loss.data_ptr<double>(), o);
    detail::cpu::cross_entropy_backward_rows(block, chunk.data_ptr<void>(),
                                             on_labels.data_ptr<void>(), lse.data_ptr<void>(), up,
                                             chunk.data_ptr<void>(), o);
  } else {
#ifdef MESHFUSE_WITH_CUDA
    Tensor row_grad;
    const Tensor verdict =
        detail::cuda::check_labels("cross_entropy", shape, on_labels.data_ptr<void>(), o, stream);
    const detail::CrossEntropyUpstream up = detail::cuda::read_upstream(
        shape, on_dl.data_ptr<void>(), verdict, o.reduction, row_grad, stream);
    detail::cuda::cross_entropy_forward_rows(block, chunk.data_ptr<void>(),
                                             on_labels.data_ptr<void>(), lse.data_ptr<void>(),
                                             row_loss.data_ptr<double>(), o, stream);
    detail::cuda::cross_entropy_backward_rows(block, chunk.data_ptr<void>(),
                                              on_labels.data_ptr<void>(), lse.data_ptr<void>(), up,
                                              chunk.data_ptr<void>(), o, stream);
#endif
  }
  const std::vector<double> chunk_loss = values(to_cpu(row_loss, stream)),
                            chunk_lse = values(to_cpu(lse, stream));
  const std::vector<double> whole_loss = values(whole.loss), whole_lse = values(whole.lse);
  for (std::int64_t g = 0; g < n; ++g) {
    const bool inside = g >= begin && g < begin + rows;
    EXPECT_EQ(inside ? static_cast<float>(chunk_loss[g]) : chunk_loss[g],
              inside ? whole_loss[g] : -1.0)
        << g;
    EXPECT_EQ(chunk_lse[g], inside ? whole_lse[g] : 0.0) << g;
  }
  EXPECT_TRUE(
      testing::bitwise_equal(to_cpu(chunk, stream), whole_grad.view().narrow(0, begin, rows)));
}

INSTANTIATE_TEST_SUITE_P(, CrossEntropyRowKernels, ::testing::ValuesIn(test::kernel_targets()),
                         test::target_param_name);

// f32 logits whose lse is large (rows of values around 20 and 30: lse about 30 and 46), against
// the reference on the same values as f64. In f32 such an lse is off by up to half its ulp (2^-20
// to 2^-19), which every p = e^(v - lse) of the row takes whole: the forward must give it in
// double, and the backward must use it without rounding.
class CrossEntropyF32LargeLse : public ::testing::TestWithParam<Target> {};

TEST_P(CrossEntropyF32LargeLse, LseAndGradientAreWithinAFewUlpOfDouble) {
  const Target target = GetParam();
  MESHFUSE_REQUIRE_TARGET(target);
  const Stream stream{target.device};
  const std::int64_t n = 64, v = 4096;
  Tensor x64 = randn({n, v}, DType::F64, 21);
  double* x = x64.data_ptr<double>();
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < v; ++j) {
      double& e = x[detail::row_offset(i, v) + j];
      e = i % 2 ? 30 + 4 * e : 20 + 2 * e;
    }
  Tensor logits({n, v}, DType::F32);
  copy(x64, logits);
  copy(logits, x64);  // the truth takes the f32 values
  const Tensor labels = make_labels(n, v, DType::I64, 22);
  const CrossEntropyOptions o{.reduction = Reduction::None};
  const Tensor dl = upstream(n, DType::F32, o.reduction);
  const Forward truth = forward(kOracle, x64, labels, o, {});
  Tensor dl_f64({n}, DType::F64);
  copy(dl, dl_f64);
  const std::vector<double> truth_grad =
      values(backward(kOracle, dl_f64, x64, labels, truth.lse, o, {}));

  // The lse, in absolute terms: the relative error it gives every p of the row.
  const Forward got = forward(target, logits, labels, o, stream);
  const std::vector<double> lse = values(got.lse), truth_lse = values(truth.lse);
  double lse_err = 0;
  for (std::int64_t i = 0; i < n; ++i) lse_err = std::max(lse_err, std::abs(lse[i] - truth_lse[i]));
  EXPECT_LE(lse_err, 6e-7);

  // The gradient given the exact lse, relative to each value with a floor at 2^-10 of its row's
  // largest: a few ulp of the exp, the factors and the output rounding.
  const std::vector<double> grad =
      values(backward(target, dl, logits, labels, truth.lse, o, stream));
  double grad_err = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t row = detail::row_offset(i, v);
    double floor = 0;
    for (std::int64_t j = 0; j < v; ++j) floor = std::max(floor, std::abs(truth_grad[row + j]));
    floor *= 0x1p-10;
    if (floor == 0) continue;  // an ignored row: zeros (the other tests check them)
    for (std::int64_t j = 0; j < v; ++j)
      grad_err = std::max(grad_err, std::abs(grad[row + j] - truth_grad[row + j]) /
                                        std::max(std::abs(truth_grad[row + j]), floor));
  }
  EXPECT_LE(grad_err, 6e-7);
}

INSTANTIATE_TEST_SUITE_P(, CrossEntropyF32LargeLse, ::testing::ValuesIn(test::kernel_targets()),
                         test::target_param_name);

TEST(CrossEntropy, RowOffsetsPast2To31AreExact) {
  // The row kernels address row i of a block at row_offset(i, V): a 70000-row chunk of a LLaMA-3
  // vocabulary (128256) reaches element 8'977'920'000 > 2^31.
  EXPECT_EQ(detail::row_offset(70000, 128256), std::int64_t{8'977'920'000});
}

TEST(CudaCrossEntropy, RowsPastElement2To31AreAddressedIn64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{test::kCuda};
  // 16745 LLaMA-3 rows: the last starts at element 2'147'518'464 > 2^31. Rows 0, 16743 and
  // 16744 have values and labels; every other row is ignored, so its logits are never read.
  const std::int64_t rows = 16745, cols = 128256;
  std::optional<Tensor> logits, grad;
  try {
    logits.emplace(Shape{rows, cols}, DType::BF16, test::kCuda, stream);
    grad.emplace(Shape{rows, cols}, DType::BF16, test::kCuda, stream);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::OutOfMemory) GTEST_SKIP() << "needs 9 GB of device memory";
    throw;
  }
  const std::vector<std::int64_t> live = {0, rows - 2, rows - 1};
  const Tensor values_of_live = randn({3, cols}, DType::BF16, 16, 2.0);
  Tensor labels = test::full({rows}, DType::I64, -100);
  const Tensor live_labels = from({3}, DType::I64, {17, 128255, 4242});
  for (std::size_t k = 0; k < live.size(); ++k) {
    copy(values_of_live.view().narrow(0, k, 1), logits->view().narrow(0, live[k], 1), stream);
    copy(live_labels.view().narrow(0, k, 1), labels.view().narrow(0, live[k], 1));
  }
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  Tensor loss({rows}, DType::BF16, test::kCuda, stream),
      lse({rows}, DType::F32, test::kCuda, stream);
  const Tensor on_labels = on(labels, test::kCuda, stream);
  cross_entropy(*logits, on_labels, loss, lse, o, stream);
  const Tensor grad_loss = on(test::full({rows}, DType::BF16, 1), test::kCuda, stream);
  cross_entropy_backward(grad_loss, *logits, on_labels, lse, *grad, o, stream);

  const Forward ref = forward(kOracle, values_of_live, live_labels, o, {});
  const Tensor ref_grad = backward(kOracle, test::full({3}, DType::BF16, 1), values_of_live,
                                   live_labels, ref.lse, o, {});
  const std::vector<double> all_loss = values(to_cpu(loss, stream)),
                            all_lse = values(to_cpu(lse, stream));
  const std::vector<double> ref_loss = values(ref.loss), ref_lse = values(ref.lse);
  for (std::size_t k = 0; k < live.size(); ++k) {
    EXPECT_NEAR(all_loss[live[k]], ref_loss[k], 2e-2 * (1 + std::fabs(ref_loss[k]))) << live[k];
    EXPECT_NEAR(all_lse[live[k]], ref_lse[k], 1e-5 * (1 + std::fabs(ref_lse[k]))) << live[k];
    test::expect_close(to_cpu(grad->view().narrow(0, live[k], 1), stream),
                       ref_grad.view().narrow(0, k, 1),
                       "grad_logits row " + std::to_string(live[k]));
  }
  EXPECT_EQ(all_loss[rows - 3], 0.0);
  for (double g : values(to_cpu(grad->view().narrow(0, rows - 3, 1), stream))) ASSERT_EQ(g, 0.0);
}

TEST(CrossEntropy, LabelCheckNamesParseBackAndAnUnknownOneIsListed) {
  for (LabelCheck c : {LabelCheck::Raise, LabelCheck::DeviceAssert})
    EXPECT_EQ(parse_label_check(to_string(c)), c);
  EXPECT_EQ(parse_label_check("Device_Assert"), LabelCheck::DeviceAssert);
  test::expect_error([] { parse_label_check("trap"); }, ErrorCode::InvalidArgument,
                     {"label_check", "'trap'", "raise, device_assert"});
}

TEST(CrossEntropy, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor logits = randn({4, 8}, DType::F32, 15), labels = Tensor::zeros({4}, DType::I64);
  // lse: f64 for f32 logits, f32 for 16-bit ones.
  Tensor loss({}, DType::F32), lse({4}, DType::F64), lse16({4}, DType::F32);
  // u32 is for cu_seqlens only: labels stay i32 or i64.
  for (DType bad : {DType::F32, DType::U32})
    test::expect_error(
        [&] { cross_entropy(logits, Tensor::zeros({4}, bad), loss, lse); },
        ErrorCode::DTypeMismatch,
        {"cross_entropy", "'labels' must be i32 or i64, got " + std::string(to_string(bad))});
  test::expect_error([&] { cross_entropy(logits, Tensor::zeros({5}, DType::I64), loss, lse); },
                     ErrorCode::ShapeMismatch, {"cross_entropy", "'labels'", "[4]", "[5]"});
  test::expect_error(
      [&] {
        cross_entropy(randn({2, 2, 8}, DType::F32, 1), labels, loss, lse);
      },
      ErrorCode::InvalidArgument, {"cross_entropy", "'logits'", "2 dimensions", "3"});
  test::expect_error(
      [&] { cross_entropy(logits, labels, loss, lse, {.reduction = Reduction::None}); },
      ErrorCode::ShapeMismatch, {"cross_entropy", "'loss'", "[4]", "[]"});
  test::expect_error([&] { cross_entropy(logits, labels, loss, Tensor({4}, DType::F32)); },
                     ErrorCode::DTypeMismatch, {"cross_entropy", "'lse'", "f64", "f32"});
  test::expect_error([&] { cross_entropy(logits, labels, loss, lse, {.label_smoothing = 1.5}); },
                     ErrorCode::InvalidArgument, {"cross_entropy", "label_smoothing", "1.5"});
  test::expect_error(
      [&] { cross_entropy(logits, labels, loss, lse, {.logits_multiplier = std::nan("")}); },
      ErrorCode::InvalidArgument, {"cross_entropy", "logits_multiplier", "finite", "nan"});
  test::expect_error(
      [&] {
        cross_entropy(logits, labels, loss, lse,
                      {.z_loss_scale = std::numeric_limits<double>::infinity()});
      },
      ErrorCode::InvalidArgument, {"cross_entropy", "z_loss_scale", "finite", "inf"});
  test::expect_error([&] { cross_entropy(logits, labels, loss, lse, {.z_loss_scale = -1e-4}); },
                     ErrorCode::InvalidArgument,
                     {"cross_entropy", "z_loss_scale", ">= 0", "-0.0001"});
  test::expect_error(
      [&] {
        cross_entropy_backward(Tensor({}, DType::BF16), logits, labels, lse,
                               Tensor({4, 8}, DType::F32));
      },
      ErrorCode::DTypeMismatch, {"cross_entropy_backward", "'grad_loss'", "f32", "bf16"});
  const Tensor bf16_logits = randn({4, 8}, DType::BF16, 15);
  test::expect_error([&] { cross_entropy(bf16_logits, labels, Tensor({}, DType::F64), lse16); },
                     ErrorCode::DTypeMismatch,
                     {"cross_entropy", "'loss'", "'logits' (bf16) or f32", "f64"});
  test::expect_error(
      [&] {
        cross_entropy_backward(Tensor({}, DType::F16), bf16_logits, labels, lse16,
                               Tensor({4, 8}, DType::BF16));
      },
      ErrorCode::DTypeMismatch,
      {"cross_entropy_backward", "'grad_loss'", "'logits' (bf16) or f32", "f16"});
  // A shard must lie in its vocabulary (vocab_size 0: the logits' 8 columns from 0).
  for (const auto& [start, size] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 8}, {5, 12}, {-1, 8}, {2, 0}, {0, 7}, {0, -8}}) {
    const CrossEntropyOptions o{.vocab_start = start, .vocab_size = size};
    const std::vector<std::string> needles = {fmt::format("vocab_start = {}", start),
                                              fmt::format("vocab_size = {}", size), "8 columns"};
    std::vector<std::string> forward_needles = needles, backward_needles = needles;
    forward_needles.push_back("cross_entropy:");
    backward_needles.push_back("cross_entropy_backward:");
    test::expect_error([&] { cross_entropy(logits, labels, loss, lse, o); },
                       ErrorCode::InvalidArgument, forward_needles);
    test::expect_error(
        [&] {
          cross_entropy_backward(Tensor({}, DType::F32), logits, labels, lse,
                                 Tensor({4, 8}, DType::F32), o);
        },
        ErrorCode::InvalidArgument, backward_needles);
  }
  EXPECT_EQ(parse_reduction("sum"), Reduction::Sum);
  EXPECT_EQ(parse_reduction("MEAN"), Reduction::Mean);
  test::expect_error([] { parse_reduction("avg"); }, ErrorCode::InvalidArgument,
                     {"reduction: unknown name 'avg' (expected one of none, mean, sum)"});
}

}  // namespace
}  // namespace meshfuse
