#include <cmath>
#include <limits>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/softmax/softmax_kernels.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::from;
using test::values;
using test::make_labels;

using test::expect_close;
using test::randn;

constexpr double kInf = std::numeric_limits<double>::infinity();

Shape loss_shape(std::int64_t rows, Reduction r) {
  return r == Reduction::None ? Shape{rows} : Shape{};
}

struct Forward {
  Tensor loss, lse;
};

Forward forward(const TensorView& logits, const TensorView& labels, const CrossEntropyOptions& o) {
  const std::int64_t n = logits.size(0);
  Forward f{Tensor(loss_shape(n, o.reduction), logits.dtype()),
            Tensor({n}, logits.dtype() == DType::F64 ? DType::F64 : DType::F32)};
  cross_entropy(logits, labels, f.loss, f.lse, o);
  return f;
}

Tensor backward(const TensorView& grad_loss, const TensorView& logits, const TensorView& labels,
                const TensorView& lse, const CrossEntropyOptions& o) {
  Tensor grad(logits.shape(), logits.dtype());
  cross_entropy_backward(grad_loss, logits, labels, lse, grad, o);
  return grad;
}

// An upstream gradient of the loss's shape (varied per row for `none`).
Tensor upstream(std::int64_t rows, DType dtype, Reduction r) {
  return r == Reduction::None ? randn({rows}, dtype, 99) : test::full({}, dtype, 1.5);
}

// cpu against reference: loss, lse, and the gradient (both backwards given the reference lse).
void expect_matches_reference(const TensorView& logits, const TensorView& labels,
                              const CrossEntropyOptions& o, const std::string& what) {
  const Tensor dl = upstream(logits.size(0), logits.dtype(), o.reduction);
  Forward ref;
  Tensor ref_grad;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref = forward(logits, labels, o);
    ref_grad = backward(dl, logits, labels, ref.lse, o);
  }
  const Forward cpu = forward(logits, labels, o);
  expect_close(cpu.loss, ref.loss, what + " loss");
  expect_close(cpu.lse, ref.lse,
               testing::default_tolerance(logits.dtype() == DType::F64 ? DType::F64 : DType::F32),
               what + " lse");
  expect_close(backward(dl, logits, labels, ref.lse, o), ref_grad, what + " grad_logits");
}

std::vector<CrossEntropyOptions> option_sets(Reduction r) {
  return {{-100, r, 0.0, 1.0, 0.0}, {-100, r, 0.1, 0.7, 1e-3}};
}

class CrossEntropyTest : public ::testing::TestWithParam<DType> {};

TEST_P(CrossEntropyTest, CpuMatchesReferenceForEveryReductionOptionAndLabelDType) {
  for (std::int64_t vocab : {1, 7, 33, 1100}) {
    const Tensor logits = randn({10, vocab}, GetParam(), 1, 2.0);
    for (DType label_dtype : {DType::I32, DType::I64}) {
      const Tensor labels = make_labels(10, vocab, label_dtype, 2);
      for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
        for (const CrossEntropyOptions& o : option_sets(r))
          expect_matches_reference(logits, labels, o,
                                   fmt::format("V={} {} {} eps={}", vocab, to_string(label_dtype),
                                               to_string(r), o.label_smoothing));
    }
  }
}

TEST_P(CrossEntropyTest, Int32AndInt64LabelsGiveBitwiseTheSameResults) {
  const Tensor logits = randn({9, 100}, GetParam(), 3);
  const Tensor l64 = make_labels(9, 100, DType::I64, 4), l32({9}, DType::I32);
  copy(l64, l32);
  const CrossEntropyOptions o{-100, Reduction::None, 0.1, 1.0, 0.0};
  const Forward a = forward(logits, l64, o), b = forward(logits, l32, o);
  EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss));
  const Tensor dl = upstream(9, GetParam(), o.reduction);
  EXPECT_TRUE(testing::bitwise_equal(backward(dl, logits, l64, a.lse, o),
                                     backward(dl, logits, l32, a.lse, o)));
}

TEST_P(CrossEntropyTest, OneRowMatchesReference) {
  const Tensor logits = randn({1, 129}, GetParam(), 5);
  const Tensor labels = from({1}, DType::I64, {17});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum})
    expect_matches_reference(logits, labels, option_sets(r)[1], std::string(to_string(r)));
}

TEST_P(CrossEntropyTest, ZeroRowsGiveEmptyNanMeanAndZeroSum) {
  const Tensor logits({0, 16}, GetParam()), labels({0}, DType::I64);
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    EXPECT_EQ(forward(logits, labels, {.reduction = Reduction::None}).loss.shape(), Shape{0});
    EXPECT_TRUE(std::isnan(values(forward(logits, labels, {}).loss)[0]));
    EXPECT_EQ(values(forward(logits, labels, {.reduction = Reduction::Sum}).loss)[0], 0.0);
    const Forward f = forward(logits, labels, {});
    EXPECT_EQ(backward(test::full({}, GetParam(), 1), logits, labels, f.lse, {}).shape(),
              (Shape{0, 16}));
  }
}

TEST_P(CrossEntropyTest, AllLabelsIgnoredGiveZeroNoneNanMeanZeroSumAndZeroGrads) {
  // The ignored rows hold NaN logits: an ignored row is never read, so nothing leaks.
  Tensor logits = randn({4, 50}, GetParam(), 6);
  copy(test::full({1, 1}, DType::F64, NAN), logits.view().narrow(0, 2, 1).narrow(1, 7, 1));
  const Tensor labels = from({4}, DType::I32, {-100, -100, -100, -100});
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      const CrossEntropyOptions o{.reduction = r, .label_smoothing = 0.2, .z_loss_scale = 1e-4};
      const Forward f = forward(logits, labels, o);
      for (double v : values(f.loss)) {
        if (r == Reduction::Mean)
          EXPECT_TRUE(std::isnan(v)) << to_string(backend);
        else
          EXPECT_EQ(v, 0.0) << to_string(backend) << " " << to_string(r);
      }
      for (double g : values(backward(upstream(4, GetParam(), r), logits, labels, f.lse, o)))
        ASSERT_EQ(g, 0.0) << to_string(backend) << " " << to_string(r);
    }
  }
}

TEST_P(CrossEntropyTest, NonContiguousLogitsAndLabelsGiveTheContiguousResult) {
  const Tensor logits = randn({6, 40}, GetParam(), 7);
  const Tensor labels = make_labels(6, 40, DType::I64, 8);
  const auto lt = test::non_contiguous(logits);
  Tensor spread({6, 2}, DType::I64);  // labels in column 0: stride 2
  const TensorView strided_labels(spread.data_ptr<void>(), DType::I64, {6}, {2});
  copy(labels, strided_labels);
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.1};
  const Forward a = forward(logits, labels, o), b = forward(lt.view, strided_labels, o);
  EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss));
  EXPECT_TRUE(testing::bitwise_equal(a.lse, b.lse));
  const Tensor dl = upstream(6, GetParam(), o.reduction);
  EXPECT_TRUE(testing::bitwise_equal(backward(dl, logits, labels, a.lse, o),
                                     backward(dl, lt.view, strided_labels, a.lse, o)));
}

TEST_P(CrossEntropyTest, NonFiniteLogitsBehaveLikeTorch) {
  // Rows (V = 3000, special values at both ends and in the middle of a row):
  //   0: -inf away from the label: finite loss and gradient;  1: -inf at the label: loss +inf;
  //   2: entirely -inf: NaN;  3: a NaN: NaN;  4: a +inf: NaN;  5: finite.
  const std::int64_t v = 3000;
  Tensor logits = randn({6, v}, GetParam(), 9);
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
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    const CrossEntropyOptions o{.reduction = Reduction::None};
    const Forward f = forward(logits, labels, o);
    const std::vector<double> loss = values(f.loss);
    EXPECT_TRUE(std::isfinite(loss[0]));
    EXPECT_EQ(loss[1], kInf);
    for (int row : {2, 3, 4}) EXPECT_TRUE(std::isnan(loss[row])) << row;
    EXPECT_TRUE(std::isfinite(loss[5]));
    const std::vector<double> grad =
        values(backward(test::full({6}, GetParam(), 1), logits, labels, f.lse, o));
    for (std::int64_t j = 0; j < 2 * v; ++j) ASSERT_TRUE(std::isfinite(grad[j])) << j;
    // With label smoothing a -inf logit makes the loss +inf, as in PyTorch.
    const CrossEntropyOptions smooth{.reduction = Reduction::None, .label_smoothing = 0.1};
    EXPECT_EQ(values(forward(logits, labels, smooth).loss)[0], kInf);
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CrossEntropyTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

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

TEST(CrossEntropy, MatchesTorchWithIgnoreIndexAndLabelSmoothing) {
  const Tensor labels = from({3}, DType::I64, {2, -100, 0});
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (const TorchCase& c : kTorchCases) {
      const CrossEntropyOptions o{.reduction = c.reduction, .label_smoothing = c.label_smoothing};
      const std::string what = fmt::format("{} {} eps={}", to_string(backend),
                                           to_string(c.reduction), c.label_smoothing);
      const Forward f = forward(kTorchLogits, labels, o);
      const Tensor dl = c.reduction == Reduction::None ? from({3}, DType::F64, {1, 2, -0.5})
                                                       : test::full({}, DType::F64, 1);
      const Tensor grad = backward(dl, kTorchLogits, labels, f.lse, o);
      const std::vector<double> loss = values(f.loss), g = values(grad);
      for (std::size_t i = 0; i < c.loss.size(); ++i)
        EXPECT_NEAR(loss[i], c.loss[i], 1e-13) << what;
      for (std::size_t i = 0; i < c.grad.size(); ++i) EXPECT_NEAR(g[i], c.grad[i], 1e-13) << what;
    }
  }
}

TEST(CrossEntropy, LogitsMultiplierAndZLossMatchTorchComposition) {
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
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    const Forward f = forward(kTorchLogits, labels, o);
    EXPECT_NEAR(values(f.loss)[0], 2.802647849824765, 1e-13);
    EXPECT_NEAR(values(f.lse)[0], 2.373905090904424, 1e-13);
    EXPECT_NEAR(values(f.lse)[2], 2.5381160253571386, 1e-13);
    const std::vector<double> g =
        values(backward(test::full({}, DType::F64, 1), kTorchLogits, labels, f.lse, o));
    for (std::size_t i = 0; i < grad.size(); ++i) EXPECT_NEAR(g[i], grad[i], 1e-13) << i;
  }
}

TEST(CrossEntropy, DeterministicRunToRun) {
  const Tensor logits = randn({64, 3001}, DType::BF16, 10);
  const Tensor labels = make_labels(64, 3001, DType::I64, 11);
  const CrossEntropyOptions o{.label_smoothing = 0.1, .z_loss_scale = 1e-4};
  const Forward a = forward(logits, labels, o), b = forward(logits, labels, o);
  EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss));
  EXPECT_TRUE(testing::bitwise_equal(a.lse, b.lse));
  const Tensor dl = test::full({}, DType::BF16, 1);
  EXPECT_TRUE(testing::bitwise_equal(backward(dl, logits, labels, a.lse, o),
                                     backward(dl, logits, labels, a.lse, o)));
}

TEST(CrossEntropy, RowKernelsOnChunksEqualTheWholeOpAndRunInPlace) {
  // What fused linear cross-entropy does: logits for rows [5, 13) in their own buffer, the
  // labels / lse / per-row losses / upstream of all 13 rows.
  const std::int64_t n = 13, v = 1100, begin = 5, rows = 8;
  const Tensor logits = randn({n, v}, DType::F32, 12);
  const Tensor labels = make_labels(n, v, DType::I32, 13);
  const CrossEntropyOptions o{.reduction = Reduction::None,
                              .label_smoothing = 0.1,
                              .logits_multiplier = 0.8,
                              .z_loss_scale = 1e-3};
  const Forward whole = forward(logits, labels, o);
  const Tensor dl = upstream(n, DType::F32, o.reduction);
  const Tensor whole_grad = backward(dl, logits, labels, whole.lse, o);

  Tensor chunk = Tensor::copy_of(logits.view().narrow(0, begin, rows));
  Tensor lse = Tensor::zeros({n}, DType::F32);
  std::vector<double> row_loss(n, -1.0), row_grad = values(dl);
  const detail::CrossEntropyRows block{DType::F32, DType::I32, begin, rows, v};
  detail::cpu::cross_entropy_forward_rows(block, chunk.data_ptr<void>(), labels.data_ptr<void>(),
                                          lse.data_ptr<void>(), row_loss.data(), o);
  detail::cpu::cross_entropy_backward_rows(block, chunk.data_ptr<void>(), labels.data_ptr<void>(),
                                           lse.data_ptr<void>(), {1.0, row_grad.data()},
                                           chunk.data_ptr<void>(), o);
  const std::vector<double> whole_loss = values(whole.loss);
  const std::vector<double> whole_lse = values(whole.lse), chunk_lse = values(lse);
  for (std::int64_t g = 0; g < n; ++g) {
    const bool inside = g >= begin && g < begin + rows;
    EXPECT_EQ(inside ? static_cast<float>(row_loss[g]) : row_loss[g], inside ? whole_loss[g] : -1.0)
        << g;
    EXPECT_EQ(chunk_lse[g], inside ? whole_lse[g] : 0.0) << g;
  }
  EXPECT_TRUE(testing::bitwise_equal(chunk, whole_grad.view().narrow(0, begin, rows)));
}

TEST(CrossEntropy, RowOffsetsPast2To31AreExact) {
  // The row kernels address row i of a block at row_offset(i, V): a 70000-row chunk of a LLaMA-3
  // vocabulary (128256) reaches element 8'977'920'000 > 2^31.
  EXPECT_EQ(detail::row_offset(70000, 128256), std::int64_t{8'977'920'000});
}

TEST(CrossEntropy, LabelOutOfRangeNamesTheRowAndValueBeforeAnyWork) {
  const Tensor logits = randn({5, 4}, DType::F32, 14);
  const Tensor dl = test::full({}, DType::F32, 1), lse = Tensor::zeros({5}, DType::F32);
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    for (DType label_dtype : {DType::I32, DType::I64}) {
      const Tensor too_big = from({5}, label_dtype, {0, -100, 3, 4, 9});
      Tensor loss = test::full({}, DType::F32, 7), lse_out = test::full({5}, DType::F32, 7);
      test::expect_error([&] { cross_entropy(logits, too_big, loss, lse_out); },
                         ErrorCode::InvalidArgument,
                         {"cross_entropy", "labels[3] = 4", "[0, 4)", "-100"});
      EXPECT_EQ(values(loss)[0], 7.0);  // nothing written
      for (double l : values(lse_out)) EXPECT_EQ(l, 7.0);
      const Tensor negative = from({5}, label_dtype, {0, 1, -1, 2, 3});
      Tensor grad = test::full({5, 4}, DType::F32, 7);
      test::expect_error([&] { cross_entropy_backward(dl, logits, negative, lse, grad); },
                         ErrorCode::InvalidArgument, {"cross_entropy_backward", "labels[2] = -1"});
      for (double g : values(grad)) ASSERT_EQ(g, 7.0);
    }
  }
}

TEST(CrossEntropy, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor logits = randn({4, 8}, DType::F32, 15), labels = Tensor::zeros({4}, DType::I64);
  Tensor loss({}, DType::F32), lse({4}, DType::F32);
  test::expect_error([&] { cross_entropy(logits, Tensor::zeros({4}, DType::F32), loss, lse); },
                     ErrorCode::DTypeMismatch, {"cross_entropy", "'labels'", "i32 or i64", "f32"});
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
  test::expect_error([&] { cross_entropy(logits, labels, loss, Tensor({4}, DType::F64)); },
                     ErrorCode::DTypeMismatch, {"cross_entropy", "'lse'", "f32", "f64"});
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
  test::expect_error(
      [&] {
        cross_entropy_backward(Tensor({}, DType::BF16), logits, labels, lse,
                               Tensor({4, 8}, DType::F32));
      },
      ErrorCode::DTypeMismatch, {"cross_entropy_backward", "'grad_loss'", "f32", "bf16"});
  EXPECT_EQ(parse_reduction("sum"), Reduction::Sum);
  EXPECT_EQ(parse_reduction("avg"), std::nullopt);
}

}  // namespace
}  // namespace meshfuse
