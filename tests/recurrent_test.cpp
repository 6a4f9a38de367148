#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::randn;
using test::values;

// One RNN or GRU problem: inputs and weights in GruParams' order (candidate, forget, reset; the
// RNN has only the first), the optional input state, and the storage behind the views.
struct Problem {
  bool gru = false;
  std::vector<TensorView> inputs, weights;
  TensorView state;
  std::vector<Tensor> storage;

  TensorView own(Tensor t) {
    storage.push_back(std::move(t));
    return storage.back().view();
  }
  int pairs() const { return gru ? 3 : 1; }
  DType dtype() const { return inputs[0].dtype(); }
  std::int64_t head_dim() const { return inputs[0].size(-1); }
  std::int64_t heads() const {
    std::int64_t n = state.defined() ? state.size(1) : 0;
    for (int k = 0; k < pairs(); ++k) n = std::max({n, inputs[k].size(-2), weights[k].size(0)});
    return n;
  }
  GruParams params() const {
    return {inputs[0], weights[0], inputs[1], weights[1], inputs[2], weights[2]};
  }
};

std::int64_t batch_of(const Problem& p, const TensorView& cu) {
  return cu.defined() ? cu.size(0) - 1 : p.inputs[0].size(0);
}

// Random inputs (std 1), weights (std 1/sqrt(H): the state neither dies nor saturates) and state.
// `lead` is (B, S) padded or (T,) packed; head counts per tensor default to `heads`.
Problem random_problem(bool gru, DType dtype, Shape lead, std::int64_t batch, std::int64_t heads,
                       std::int64_t h, std::uint64_t seed, bool with_state = true,
                       std::int64_t input_heads = 0, std::int64_t weight_heads = 0) {
  Problem p;
  p.gru = gru;
  for (int k = 0; k < p.pairs(); ++k) {
    Shape shape = lead;
    shape.push_back(input_heads > 0 ? input_heads : heads);
    shape.push_back(h);
    p.inputs.push_back(p.own(randn(shape, dtype, seed + 10 * k)));
    p.weights.push_back(p.own(randn({weight_heads > 0 ? weight_heads : heads, h, h}, dtype,
                                    seed + 10 * k + 1, 1.0 / std::sqrt(double(h)))));
  }
  if (with_state) p.state = p.own(randn({batch, heads, h}, dtype, seed + 100, 0.5));
  return p;
}

struct Forward {
  Tensor output, final_state;
};

Forward forward(const Problem& p, const TensorView& cu = {}, std::int64_t max_seqlen = -1) {
  Shape out_shape = p.inputs[0].shape();
  out_shape[out_shape.size() - 2] = p.heads();
  Forward f{Tensor(out_shape, p.dtype()),
            Tensor({batch_of(p, cu), p.heads(), p.head_dim()}, p.dtype())};
  if (p.gru)
    gru(p.params(), p.state, f.output, f.final_state, cu, max_seqlen);
  else
    rnn(p.inputs[0], p.weights[0], p.state, f.output, f.final_state, cu, max_seqlen);
  return f;
}

struct Grads {
  std::vector<Tensor> inputs, weights;
  Tensor state;
};

// The backward at the forward output `output`, upstream gradients dy and dhn (each optional).
Grads backward(const Problem& p, const TensorView& output, const TensorView& dy,
               const TensorView& dhn, std::optional<double> clip = std::nullopt,
               const TensorView& cu = {}, std::int64_t max_seqlen = -1) {
  Grads g;
  for (int k = 0; k < p.pairs(); ++k) {
    g.inputs.push_back(Tensor::zeros(p.inputs[k].shape(), p.dtype()));
    g.weights.push_back(Tensor::zeros(p.weights[k].shape(), p.dtype()));
  }
  if (p.state.defined()) g.state = Tensor::zeros(p.state.shape(), p.dtype());
  if (p.gru) {
    const GruParams grads{g.inputs[0],  g.weights[0], g.inputs[1],
                          g.weights[1], g.inputs[2],  g.weights[2]};
    gru_backward(dy, dhn, output, p.params(), p.state, grads, g.state, clip, cu, max_seqlen);
  } else {
    rnn_backward(dy, dhn, output, p.weights[0], p.state, g.inputs[0], g.weights[0], g.state, clip,
                 cu, max_seqlen);
  }
  return g;
}

// Upstream gradients for a forward result.
struct Upstream {
  Tensor dy, dhn;
};
Upstream random_upstream(const Forward& f, std::uint64_t seed) {
  return {randn(f.output.shape(), f.output.dtype(), seed),
          randn(f.final_state.shape(), f.output.dtype(), seed + 1)};
}

double max_abs(const TensorView& t) {
  double m = 0;
  for (double v : values(t)) m = std::max(m, std::fabs(v));
  return m;
}

// |actual - expected| <= tol * (max |expected| + |expected|): gradients are sums over many steps
// whose terms cancel, so the error scales with the tensor's magnitude, not each element's.
void expect_near(const TensorView& actual, const TensorView& expected, double tol,
                 const std::string& what) {
  test::expect_close(actual, expected, tol, what);
  const testing::Diff d =
      testing::compare(actual, expected, tol * std::max(1.0, max_abs(expected)), tol);
  EXPECT_EQ(d.violations, 0) << what << ": max abs err " << d.max_abs_err << " (tol " << tol << ")";
}

void expect_grads_near(const Grads& a, const Grads& b, double tol, const std::string& what) {
  for (std::size_t k = 0; k < a.inputs.size(); ++k) {
    expect_near(a.inputs[k], b.inputs[k], tol, what + " grad input " + std::to_string(k));
    expect_near(a.weights[k], b.weights[k], tol, what + " grad weight " + std::to_string(k));
  }
  if (a.state.defined()) {
    expect_near(a.state, b.state, tol, what + " grad input_state");
  }
}

void expect_grads_bitwise(const Grads& a, const Grads& b, const std::string& what) {
  for (std::size_t k = 0; k < a.inputs.size(); ++k) {
    EXPECT_TRUE(testing::bitwise_equal(a.inputs[k], b.inputs[k])) << what << " input " << k;
    EXPECT_TRUE(testing::bitwise_equal(a.weights[k], b.weights[k])) << what << " weight " << k;
  }
  if (a.state.defined()) {
    EXPECT_TRUE(testing::bitwise_equal(a.state, b.state)) << what << " input_state";
  }
}

double tolerance(DType dtype) {
  // f32: fp32 state and sums against double ones, through a few dozen chained steps.
  return dtype == DType::F32 ? 1e-4 : testing::default_tolerance(dtype);
}

// The cpu backend against the reference, forward and backward; the backward of both runs at the
// reference's forward output (so that rounding differences of the forward do not carry over).
void expect_cpu_matches_reference(const Problem& p, const TensorView& cu = {},
                                  std::optional<double> clip = std::nullopt) {
  const double tol = tolerance(p.dtype());
  Forward ref;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref = forward(p, cu);
  }
  const Forward cpu = forward(p, cu);
  expect_near(cpu.output, ref.output, tol, "output");
  expect_near(cpu.final_state, ref.final_state, tol, "final_state");
  const Upstream up = random_upstream(ref, 77);
  Grads ref_grads;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref_grads = backward(p, ref.output, up.dy, up.dhn, clip, cu);
  }
  expect_grads_near(backward(p, ref.output, up.dy, up.dhn, clip, cu), ref_grads, tol, "cpu");
}

Tensor cu_seqlens(std::vector<std::int64_t> offsets, DType dtype = DType::I64) {
  Tensor t({static_cast<std::int64_t>(offsets.size())}, dtype);
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    if (dtype == DType::I64)
      t.data_ptr<std::int64_t>()[i] = offsets[i];
    else
      t.data_ptr<std::int32_t>()[i] = static_cast<std::int32_t>(offsets[i]);
  }
  return t;
}

class RecurrentTest : public ::testing::TestWithParam<std::tuple<bool, DType>> {
 protected:
  bool gru() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
};

TEST_P(RecurrentTest, CpuMatchesReferenceOnPaddedInputAtOddHeadSizes) {
  for (std::int64_t h : {1, 5, 73}) {  // 73: register blocks of 64 and 8 columns, then one
    const Problem p = random_problem(gru(), dtype(), {3, 6}, 3, 2, h, 10 + h);
    expect_cpu_matches_reference(p);
  }
}

TEST_P(RecurrentTest, CpuMatchesReferenceOnPackedInputWithEmptySequences) {
  const Tensor cu = cu_seqlens({0, 4, 4, 5, 12, 12}, DType::I32);
  const Problem p = random_problem(gru(), dtype(), {12}, 5, 3, 19, 20);
  expect_cpu_matches_reference(p, cu);
}

TEST_P(RecurrentTest, CpuMatchesReferenceWithBroadcastHeadsAndNoInputState) {
  const Problem p = random_problem(gru(), dtype(), {2, 5}, 2, 4, 9, 30, false, 2, 1);
  expect_cpu_matches_reference(p);
}

TEST_P(RecurrentTest, CpuMatchesReferenceWithGradientClipping) {
  const Problem p = random_problem(gru(), dtype(), {2, 7}, 2, 2, 16, 40);
  expect_cpu_matches_reference(p, {}, 0.3);
}

// Sequence b of a packed problem as a padded problem (1, length, heads, H) of its own.
Problem sequence_of(const Problem& p, const std::vector<std::int64_t>& cu, std::int64_t b) {
  Problem q;
  q.gru = p.gru;
  const std::int64_t len = cu[b + 1] - cu[b];
  for (int k = 0; k < p.pairs(); ++k) {
    const TensorView rows = p.inputs[k].narrow(0, cu[b], len);
    q.inputs.push_back(q.own(Tensor::copy_of(rows.reshape({1, len, rows.size(1), rows.size(2)}))));
    q.weights.push_back(p.weights[k]);
  }
  if (p.state.defined()) q.state = q.own(Tensor::copy_of(p.state.narrow(0, b, 1)));
  return q;
}

// Rows [first, first + len) of a packed (T, heads, H) tensor as a padded (1, len, heads, H) one.
Tensor as_padded(const TensorView& t, std::int64_t first, std::int64_t len) {
  const TensorView rows = t.narrow(0, first, len);
  return Tensor::copy_of(rows.reshape({1, len, rows.size(1), rows.size(2)}));
}

TEST_P(RecurrentTest, PackedEqualsEachSequenceRunOnItsOwnThroughTheReference) {
  const std::vector<std::int64_t> offsets = {0, 3, 3, 4, 9};
  const Tensor cu = cu_seqlens(offsets);
  const Problem p = random_problem(gru(), dtype(), {9}, 4, 2, 6, 50);
  const Forward f = forward(p, cu);
  const Upstream up = random_upstream(f, 51);
  const Grads g = backward(p, f.output, up.dy, up.dhn, std::nullopt, cu);
  ForceKernelBackend force(KernelBackend::Reference);
  const double tol = tolerance(dtype());
  std::vector<Tensor> weight_sums;
  for (int k = 0; k < p.pairs(); ++k)
    weight_sums.push_back(Tensor::zeros(p.weights[k].shape(), DType::F64));
  for (std::int64_t b = 0; b < 4; ++b) {
    const std::int64_t first = offsets[b], len = offsets[b + 1] - first;
    const std::string what = "sequence " + std::to_string(b);
    const Problem q = sequence_of(p, offsets, b);
    const Forward fq = forward(q);
    expect_near(as_padded(f.output, first, len), fq.output, tol, what + " output");
    expect_near(f.final_state.view().narrow(0, b, 1), fq.final_state, tol, what + " final");
    // The sequence's backward at the packed run's outputs and upstream gradients.
    const Grads gq = backward(q, as_padded(f.output, first, len), as_padded(up.dy, first, len),
                              up.dhn.view().narrow(0, b, 1));
    for (int k = 0; k < p.pairs(); ++k) {
      expect_near(as_padded(g.inputs[k], first, len), gq.inputs[k], tol, what + " grad input");
      const std::vector<double> part = values(gq.weights[k]);
      for (std::size_t e = 0; e < part.size(); ++e) weight_sums[k].data_ptr<double>()[e] += part[e];
    }
    expect_near(g.state.view().narrow(0, b, 1), gq.state, tol, what + " grad input_state");
  }
  for (int k = 0; k < p.pairs(); ++k)
    expect_near(g.weights[k], weight_sums[k], 2 * tol, "grad weight (sum over sequences)");
}

TEST_P(RecurrentTest, PaddedAndPackedGiveBitwiseTheSameResults) {
  const Problem padded = random_problem(gru(), dtype(), {3, 5}, 3, 2, 8, 60);
  Problem packed;
  packed.gru = gru();
  for (int k = 0; k < padded.pairs(); ++k) {
    packed.inputs.push_back(padded.inputs[k].reshape({15, 2, 8}));
    packed.weights.push_back(padded.weights[k]);
  }
  packed.state = padded.state;
  const Tensor cu = cu_seqlens({0, 5, 10, 15}, DType::I32);
  for (KernelBackend backend : {KernelBackend::CPU, KernelBackend::Reference}) {
    ForceKernelBackend force(backend);
    const Forward a = forward(padded), b = forward(packed, cu, 5);
    EXPECT_TRUE(testing::bitwise_equal(a.output.view().reshape({15, 2, 8}), b.output));
    EXPECT_TRUE(testing::bitwise_equal(a.final_state, b.final_state));
    const Upstream up = random_upstream(a, 61);
    const Grads ga = backward(padded, a.output, up.dy, up.dhn, 0.5);
    const Grads gb =
        backward(packed, b.output, up.dy.view().reshape({15, 2, 8}), up.dhn, 0.5, cu, 5);
    for (int k = 0; k < padded.pairs(); ++k) {
      EXPECT_TRUE(testing::bitwise_equal(ga.inputs[k].view().reshape({15, 2, 8}), gb.inputs[k]));
      EXPECT_TRUE(testing::bitwise_equal(ga.weights[k], gb.weights[k]));
    }
    EXPECT_TRUE(testing::bitwise_equal(ga.state, gb.state));
  }
}

// Repeats each head of a tensor `times` times along dimension `dim`.
Tensor repeat_heads(const TensorView& t, std::int64_t dim, std::int64_t times) {
  Shape shape = t.shape();
  shape[dim] *= times;
  Tensor out(shape, t.dtype());
  for (std::int64_t k = 0; k < t.size(dim); ++k)
    for (std::int64_t r = 0; r < times; ++r)
      copy(t.narrow(dim, k, 1), out.view().narrow(dim, k * times + r, 1));
  return out;
}

// Sums each run of `times` consecutive heads along `dim` (a broadcast tensor's gradient), in f64.
Tensor sum_heads(const TensorView& t, std::int64_t dim, std::int64_t times) {
  Shape shape = t.shape();
  shape[dim] /= times;
  Tensor out = Tensor::zeros(shape, DType::F64);
  for (std::int64_t k = 0; k < shape[dim]; ++k) {
    Tensor acc = Tensor::zeros(out.view().narrow(dim, k, 1).shape(), DType::F64);
    for (std::int64_t r = 0; r < times; ++r) {
      const std::vector<double> part = values(Tensor::copy_of(t.narrow(dim, k * times + r, 1)));
      for (std::size_t e = 0; e < part.size(); ++e) acc.data_ptr<double>()[e] += part[e];
    }
    copy(acc, out.view().narrow(dim, k, 1));
  }
  return out;
}

TEST_P(RecurrentTest, BroadcastHeadsEqualRepeatedTensorsWithGradientsSummed) {
  // N = 4 heads: the input has 1 head (GRU: forget 2, reset 4), the weight 2 (GRU: 1, 4).
  const std::int64_t in_heads[3] = {1, 2, 4}, w_heads[3] = {2, 1, 4};
  Problem p, full;
  p.gru = full.gru = gru();
  for (int k = 0; k < p.pairs(); ++k) {
    p.inputs.push_back(p.own(randn({2, 5, in_heads[k], 6}, dtype(), 70 + k)));
    p.weights.push_back(p.own(randn({w_heads[k], 6, 6}, dtype(), 80 + k, 0.4)));
    full.inputs.push_back(full.own(repeat_heads(p.inputs[k], 2, 4 / in_heads[k])));
    full.weights.push_back(full.own(repeat_heads(p.weights[k], 0, 4 / w_heads[k])));
  }
  p.state = full.state = p.own(randn({2, 4, 6}, dtype(), 90, 0.5));
  const double tol = tolerance(dtype());
  for (KernelBackend backend : {KernelBackend::CPU, KernelBackend::Reference}) {
    ForceKernelBackend force(backend);
    const Forward a = forward(p), b = forward(full);
    EXPECT_TRUE(testing::bitwise_equal(a.output, b.output));
    EXPECT_TRUE(testing::bitwise_equal(a.final_state, b.final_state));
    const Upstream up = random_upstream(a, 91);
    const Grads ga = backward(p, a.output, up.dy, up.dhn),
                gb = backward(full, b.output, up.dy, up.dhn);
    for (int k = 0; k < p.pairs(); ++k) {
      expect_near(ga.inputs[k], sum_heads(gb.inputs[k], 2, 4 / in_heads[k]), tol, "grad input");
      expect_near(ga.weights[k], sum_heads(gb.weights[k], 0, 4 / w_heads[k]), tol, "grad weight");
    }
    EXPECT_TRUE(testing::bitwise_equal(ga.state, gb.state));
  }
}

TEST_P(RecurrentTest, EmptySequencesWriteNoRowsAndKeepTheirInputState) {
  const Tensor cu = cu_seqlens({0, 0, 3, 3, 3, 5});
  const Problem p = random_problem(gru(), dtype(), {5}, 5, 2, 4, 100);
  for (KernelBackend backend : {KernelBackend::CPU, KernelBackend::Reference}) {
    ForceKernelBackend force(backend);
    const Forward f = forward(p, cu);
    const Upstream up = random_upstream(f, 101);
    const Grads g = backward(p, f.output, up.dy, up.dhn, 0.1, cu);
    for (std::int64_t b : {0, 2, 3}) {
      EXPECT_TRUE(
          testing::bitwise_equal(f.final_state.view().narrow(0, b, 1), p.state.narrow(0, b, 1)));
      // Not clamped: the clamp acts at steps, and an empty sequence has none.
      EXPECT_TRUE(
          testing::bitwise_equal(g.state.view().narrow(0, b, 1), up.dhn.view().narrow(0, b, 1)));
    }
  }
}

TEST_P(RecurrentTest, AllSequencesEmptyAndZeroStepsKeepTheStateAndGiveZeroWeightGradients) {
  struct Case {
    Shape lead;
    Tensor cu;
  };
  const Case cases[] = {{{0}, cu_seqlens({0, 0, 0})}, {{2, 0}, Tensor()}};
  for (const Case& c : cases) {
    for (bool with_state : {true, false}) {
      const Problem p = random_problem(gru(), dtype(), c.lead, 2, 3, 5, 110, with_state);
      const Forward f = forward(p, c.cu);
      EXPECT_EQ(f.output.numel(), 0);
      const Tensor zeros = Tensor::zeros({2, 3, 5}, dtype());
      EXPECT_TRUE(testing::bitwise_equal(f.final_state, with_state ? p.state : zeros.view()));
      const Upstream up = random_upstream(f, 111);
      const Grads g = backward(p, f.output, up.dy, up.dhn, std::nullopt, c.cu);
      for (int k = 0; k < p.pairs(); ++k) {
        EXPECT_TRUE(
            testing::bitwise_equal(g.weights[k], Tensor::zeros(g.weights[k].shape(), dtype())));
      }
      if (with_state) {
        EXPECT_TRUE(testing::bitwise_equal(g.state, up.dhn));
      }
    }
  }
}

TEST_P(RecurrentTest, UpstreamGradientsAreOptionalAndMeanZeros) {
  const Problem p = random_problem(gru(), dtype(), {2, 4}, 2, 2, 7, 120);
  const Forward f = forward(p);
  const Upstream up = random_upstream(f, 121);
  const Tensor dy0 = Tensor::zeros(up.dy.shape(), dtype()),
               dhn0 = Tensor::zeros(up.dhn.shape(), dtype());
  // grad_final_state only; grad_output only.
  expect_grads_bitwise(backward(p, f.output, {}, up.dhn), backward(p, f.output, dy0, up.dhn),
                       "grad_output absent");
  expect_grads_bitwise(backward(p, f.output, up.dy, {}), backward(p, f.output, up.dy, dhn0),
                       "grad_final_state absent");
}

TEST_P(RecurrentTest, NonContiguousInputsGiveTheContiguousResult) {
  const Problem p = random_problem(gru(), dtype(), {2, 3}, 2, 2, 5, 130);
  Problem q;
  q.gru = gru();
  // Storage with the last two dimensions swapped, viewed back: the same values, other strides.
  const auto swapped = [&](const TensorView& t) {
    Shape shape = t.shape();
    std::swap(shape[shape.size() - 1], shape[shape.size() - 2]);
    const TensorView view = q.own(Tensor(shape, dtype())).transpose(t.dim() - 2, t.dim() - 1);
    copy(t, view);
    return view;
  };
  for (int k = 0; k < p.pairs(); ++k) {
    q.inputs.push_back(swapped(p.inputs[k]));
    q.weights.push_back(swapped(p.weights[k]));
  }
  q.state = swapped(p.state);
  ASSERT_FALSE(q.inputs[0].is_contiguous());
  const Forward a = forward(p), b = forward(q);
  EXPECT_TRUE(testing::bitwise_equal(a.output, b.output));
  EXPECT_TRUE(testing::bitwise_equal(a.final_state, b.final_state));
  const Upstream up = random_upstream(a, 131);
  expect_grads_bitwise(backward(p, a.output, up.dy, up.dhn),
                       backward(q, swapped(a.output), swapped(up.dy), swapped(up.dhn)), "strided");
}

TEST_P(RecurrentTest, NanInOneSequenceStaysInThatSequence) {
  Problem p = random_problem(gru(), dtype(), {2, 3}, 2, 1, 4, 140);
  const Tensor x = Tensor::copy_of(p.inputs[0]);
  copy(test::full({1, 1, 1, 1}, dtype(), NAN),
       x.view().narrow(0, 0, 1).narrow(1, 1, 1).narrow(3, 2, 1));
  p.inputs[0] = p.own(x);
  const Forward f = forward(p);
  EXPECT_FALSE(std::isnan(values(f.output)[0]));  // sequence 0, step 0: before the NaN
  EXPECT_TRUE(std::isnan(values(f.final_state)[0]));
  for (double v : values(f.output.view().narrow(0, 1, 1))) EXPECT_FALSE(std::isnan(v));
  for (double v : values(f.final_state.view().narrow(0, 1, 1))) EXPECT_FALSE(std::isnan(v));
}

INSTANTIATE_TEST_SUITE_P(RnnAndGru, RecurrentTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::ValuesIn(test::kFloatDTypes)),
                         [](const ::testing::TestParamInfo<std::tuple<bool, DType>>& info) {
                           return std::string(std::get<0>(info.param) ? "gru_" : "rnn_") +
                                  std::string(to_string(std::get<1>(info.param)));
                         });

// --- PyTorch semantics -----------------------------------------------------------------------

// The values sin(a * i + b) * scale, i = 0, 1, ... row-major (what the torch script used).
Tensor pattern(Shape shape, double a, double b, double scale = 1.0) {
  Tensor t(std::move(shape), DType::F64);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data_ptr<double>()[i] = std::sin(a * double(i) + b) * scale;
  return t;
}

using Expected = std::map<std::string, std::vector<double>>;

// From a per-step loop in PyTorch (float64) with autograd, B=2, S=3, N=2, H=3:
//   h = tanh(h @ W + x_t)  (rnn), or f, r = sigmoid(h @ W_f/r + x_f/r,t),
//   z = tanh((h * r) @ W + x_t), h = f * h + (1 - f) * z  (gru),
//   and, clipped, h.register_hook(lambda g: g.clamp(-0.05, 0.05)) on each new h;
//   torch.autograd.backward([output, h_final], [dy, dh_final]).
// Inputs: x = pattern(0.7, 0.3), W = pattern(1.3, 0.1, 0.6), h0 = pattern(0.9, 1.1, 0.5),
// x_f = pattern(0.3, 0.8), W_f = pattern(0.4, 0.5, 0.6), x_r = pattern(1.1, 0.6),
// W_r = pattern(0.8, 0.9, 0.6), dy = pattern(0.5, 0.2), dh_final = pattern(1.7, 0.4).
const Expected kRnn = {
    {"output",
     {0.185297600608,  0.713318255287,  0.81025644758,    0.585785622964,   0.0684919273371,
      -0.532168498006, -0.666654027281, -0.770573451867,  -0.551609513836,  -0.148530389311,
      0.608437964735,  0.879486874977,  0.566480157969,   -0.0583057875171, -0.570935412506,
      -0.505269183647, -0.666048780294, -0.631779489639,  0.380153400267,   0.640307439626,
      0.696390449861,  0.37809375488,   -0.0438582554318, -0.391348837261,  -0.682966879211,
      -0.700887127925, -0.45649637338,  0.0256378546392,  0.664049865444,   0.852546350497,
      0.565692172387,  -0.123095318871, -0.614525413609,  -0.568678629322,  -0.652779127721,
      -0.555251920067}},
    {"final",
     {0.566480157969, -0.0583057875171, -0.570935412506, -0.505269183647, -0.666048780294,
      -0.631779489639, 0.565692172387, -0.123095318871, -0.614525413609, -0.568678629322,
      -0.652779127721, -0.555251920067}},
    {"grad_input",
     {-0.181157465825, 0.30738150494,     0.46199987855,   0.542395168448,   1.4051922573,
      -0.202594018945, 0.407083051831,    -0.500644426073, -0.447051080256,  -0.379217882801,
      -1.04438156082,  -0.00858771879477, 0.208028053456,  1.26374843747,    0.122545876879,
      0.210473865912,  0.964982897439,    0.699388886865,  0.331908895348,   -0.146818926315,
      -0.462627945847, -0.734995539318,   -1.55911431173,  -0.0124266477637, -0.235806229659,
      0.230871588367,  0.166540638837,    0.524190025585,  1.0051817329,     0.0179281186569,
      -0.29673284702,  -0.251400660845,   0.322497077463,  -0.561026064805,  -1.14176720214,
      -0.45980323804}},
    {"grad_weight",
     {0.00474062497811, -0.554607765175, -0.165368440325, 0.253848223698, -0.933120594615,
      -0.530553226051, 0.314384203479, -0.856663316709, -0.614483298236, -0.317438606837,
      -1.00797692745, -0.0533264373797, -0.334917118463, -0.501939262447, 0.224000989196,
      -0.100228884001, 0.373714621127, 0.290812424614}},
    {"grad_state",
     {0.289363743027, 0.0151253252299, -0.311323667419, 0.0857796037581, -0.744487513836,
      0.995115468977, -0.185558969007, -0.163874765393, 0.423482941091, -0.177194048557,
      0.899739737493, -1.12910623308}},
};
const Expected kRnnClipped = {
    {"output",
     {0.185297600608,  0.713318255287,  0.81025644758,    0.585785622964,   0.0684919273371,
      -0.532168498006, -0.666654027281, -0.770573451867,  -0.551609513836,  -0.148530389311,
      0.608437964735,  0.879486874977,  0.566480157969,   -0.0583057875171, -0.570935412506,
      -0.505269183647, -0.666048780294, -0.631779489639,  0.380153400267,   0.640307439626,
      0.696390449861,  0.37809375488,   -0.0438582554318, -0.391348837261,  -0.682966879211,
      -0.700887127925, -0.45649637338,  0.0256378546392,  0.664049865444,   0.852546350497,
      0.565692172387,  -0.123095318871, -0.614525413609,  -0.568678629322,  -0.652779127721,
      -0.555251920067}},
    {"final",
     {0.566480157969, -0.0583057875171, -0.570935412506, -0.505269183647, -0.666048780294,
      -0.631779489639, 0.565692172387, -0.123095318871, -0.614525413609, -0.568678629322,
      -0.652779127721, -0.555251920067}},
    {"grad_input",
     {0.0482832399604,  0.0245588533337,  0.0171742244577,  0.0328427601964,  0.0497654427945,
      0.0358398344865,  -0.0101309775884, -0.0203108277639, -0.0347863472123, -0.0488969361726,
      -0.0314901621535, -0.0113251418372, 0.0339550115313,  0.0498300217571,  0.0337016377373,
      0.0372351526028,  0.0278189511135,  0.0300427338236,  0.0427741696133,  -0.029500319138,
      -0.0257520170671, -0.042852255626,  -0.0499038226715, -0.0423423043787, -0.0266778120951,
      0.0254378616955,  0.0395805530545,  0.0499671350205,  0.0279518888102,  0.0136582360127,
      -0.033999618305,  -0.0492423771236, 0.0311179258014,  -0.0338302308276, -0.0286939705206,
      -0.0345847652631}},
    {"grad_weight",
     {0.0146814400448, 0.0140887311853, -0.0302359792222, 0.0145291107542, -0.00417481247789,
      -0.05101328894, -0.00492537652292, -0.0141193766174, -0.0429796186419, -0.0309719655499,
      -0.0335318799517, -0.0225022287257, -0.00837747279916, -0.0147949686708, -0.0107466522806,
      0.0214324656354, 0.0150666307343, 0.00747752255866}},
    {"grad_state",
     {0.0218170285143, -0.0309779575361, 0.0231587716729, 0.0222872999037, -0.0397813754115,
      0.0354698711297, -0.0214840104014, -0.00950535699278, 0.0352845018094, -0.0219319276814,
      0.0418511513076, -0.038830277723}},
};
const Expected kGru = {
    {"output",
     {0.38546870976,   0.505178336933,  0.257379483756,  -0.124116709274, -0.375739369582,
      -0.385525991957, 0.0633760404624, 0.0904891609718, 0.0170017120805, 0.0725222146539,
      0.282966623032,  0.438126627926,  0.418715688057,  0.041770052464,  -0.379248007794,
      -0.487072190957, -0.324666771065, -0.023816724941, 0.19017352084,   0.531073541448,
      0.558269072421,  0.225108275518,  -0.236441135844, -0.49788186566,  0.00822137869805,
      0.244867489281,  0.29163814981,   0.206552602837,  0.209599061193,  0.291076392676,
      0.310091900546,  0.0604018687887, -0.319515425651, -0.500010967939, -0.441734462763,
      -0.162523413861}},
    {"final",
     {0.418715688057, 0.041770052464, -0.379248007794, -0.487072190957, -0.324666771065,
      -0.023816724941, 0.310091900546, 0.0604018687887, -0.319515425651, -0.500010967939,
      -0.441734462763, -0.162523413861}},
    {"grad_input",
     {0.0795162201129,  0.0254428091393,  0.0483132865996,  0.0581255609006,  0.121809458108,
      0.0833406440864,  0.0486115212699,  -0.0856896699697, -0.303904830892,  -0.601036258641,
      -0.227410725682,  0.122219663895,   0.146900131759,   0.90751756247,    0.0912816273873,
      0.103181478523,   0.645636226953,   0.546962812667,   -0.0359545928064, -0.0171427658155,
      -0.0533857487895, -0.0663884085795, -0.145463403119,  -0.160095700448,  -0.0420579394205,
      0.0210501410432,  0.172986499312,   0.335811831957,   0.301944973645,   0.0221621810264,
      -0.162122921447,  -0.159824234078,  0.236530182805,   -0.292974697761,  -0.838535237331,
      -0.424640506188}},
    {"grad_weight",
     {0.0342906320506, 0.026649577415, -0.0433012344174, 0.0142924601465, 0.0167215052734,
      -0.0280896669221, -0.0139039223345, -0.0148912574533, 0.00638772233183, 0.0200767956284,
      -0.0338267026734, -0.036427651282, 0.00383304866818, -0.0438615869349, -0.0027358415193,
      -0.0131327389085, -0.0251202317643, 0.0687913560559}},
    {"grad_forget_input",
     {0.0154607990617, -0.00935992040594, -0.072171594279,  -0.0612394813438, -0.0475299591664,
      0.0187820885967, 0.105306854738,    -0.138325598807,  -0.104265067603,  0.107807955357,
      0.154591786047,  -0.101513467609,   -0.0319783181658, 0.0175429783498,  0.0208950117498,
      0.0440241141358, 0.36976892134,     0.238863670451,   0.00431721872597, 0.00391472157115,
      0.023115230262,  0.0208193242463,   0.0238693847968,  0.00090213437596, -0.0764495493394,
      0.0419274915255, 0.122656179792,    0.010033548537,   -0.234409618396,  -0.0315732242332,
      0.0600653670562, -0.0175351060826,  0.0963051176812,  -0.143572027701,  -0.326217802426,
      -0.0840823730549}},
    {"grad_forget_weight",
     {0.0318747273819, -0.0481287972061, -0.04442261354, 0.03338196539, -0.0528152223467,
      0.0155139625866, 0.00519500073905, -0.016364796206, 0.071874411834, -0.0165294449597,
      -0.0953187309744, -0.000197833370087, -0.0364046275246, 0.0498983039147, 0.0859024025944,
      -0.0601409214634, 0.127227919178, 0.128654640985}},
    {"grad_reset_input",
     {0.00318982314542,  -0.00347471988883, 0.000748798870849,  -0.00420578044569,
      0.00972139698738,  -0.00612819048181, -0.0101954842859,   -0.00372020233094,
      0.011458677252,    -0.00660222838119, -0.0070810668011,   0.0368218325832,
      0.00721964959059,  -0.0100250390867,  0.000669122760063,  0.006700179807,
      -0.0360704826843,  0.0319247042692,   -0.000584106425165, 0.00161770167959,
      0.000451506307739, -0.00255138777912, -0.0100715662407,   0.00999798728483,
      0.00219904087099,  0.00542009038104,  -0.0137863190845,   -0.00171001472507,
      0.0105926454388,   -0.0333286221401,  -7.93399620961e-05, 0.0119541058013,
      -0.0143432063734,  -0.0176896145133,  0.0310094270407,    -0.0285766692194}},
    {"grad_reset_weight",
     {-0.00169636985882, -0.00231467996004, 0.00210188566415, -0.00216103471347, 0.00216625933663,
      -0.00444118372759, -0.0011787447894, 0.0056982557885, -0.00862565411773, -0.00173108497288,
      0.00295605544125, -0.0126710723816, 0.00397336326179, -0.00526370267289, -0.00297203627387,
      0.00378637980928, -0.00735394054804, 0.00500232869243}},
    {"grad_state",
     {0.236577584991, 0.135173458258, 0.563450388696, 0.405999670602, 0.398092943565,
      0.290654604246, -0.0532103328125, -0.0271839973474, -0.220559896275, -0.246654412606,
      -0.27351853199, -0.468139257694}},
};
const Expected kGruClipped = {
    {"output",
     {0.38546870976,   0.505178336933,  0.257379483756,  -0.124116709274, -0.375739369582,
      -0.385525991957, 0.0633760404624, 0.0904891609718, 0.0170017120805, 0.0725222146539,
      0.282966623032,  0.438126627926,  0.418715688057,  0.041770052464,  -0.379248007794,
      -0.487072190957, -0.324666771065, -0.023816724941, 0.19017352084,   0.531073541448,
      0.558269072421,  0.225108275518,  -0.236441135844, -0.49788186566,  0.00822137869805,
      0.244867489281,  0.29163814981,   0.206552602837,  0.209599061193,  0.291076392676,
      0.310091900546,  0.0604018687887, -0.319515425651, -0.500010967939, -0.441734462763,
      -0.162523413861}},
    {"final",
     {0.418715688057, 0.041770052464, -0.379248007794, -0.487072190957, -0.324666771065,
      -0.023816724941, 0.310091900546, 0.0604018687887, -0.319515425651, -0.500010967939,
      -0.441734462763, -0.162523413861}},
    {"grad_input",
     {0.0116974601862,   0.00542530104275,  0.00367529766909,  0.00685315461495, 0.0120733730817,
      0.0107639802794,   -0.00222300224435, -0.00846126648071, -0.0198151953807, -0.025328253179,
      -0.0177402680079,  -0.014324147388,   0.0239775144985,   0.0357837197197,  0.0251035809335,
      0.0182539436996,   0.0186126849319,   0.0234951662816,   0.0195927186172,  -0.0109502581359,
      -0.00791825903641, -0.0123705126009,  -0.0158136543454,  -0.0125355134986, -0.00404642708244,
      0.00553910817573,  0.0132018444813,   0.0189194502097,   0.0143363094537,  0.0108732211955,
      -0.0185760272348,  -0.0313051094676,  0.0228229314083,   -0.0176665618118, -0.0210733898603,
      -0.0319399495539}},
    {"grad_weight",
     {0.00481819862055, 0.000700875707398, -0.00183127141037, 0.00665652573925, -0.00383489759075,
      -0.000328045181796, 0.00164025026105, -0.00382535677913, 0.000815129996406, 0.000310619117379,
      -0.0011999804488, -0.0020106626082, 0.00102451618798, 4.3724754783e-06, -0.00105903345267,
      0.00299289722147, 0.00266801467912, 0.00132808739016}},
    {"grad_forget_input",
     {0.00227440491027, -0.00199586396535, -0.00549025145871, -0.00722029392381, -0.00471102111846,
      0.00242582755961, -0.00481567678428, -0.0136587030038,  -0.00679828839795, 0.00454313221329,
      0.0120596762007,  0.0118973807124,   -0.00521960449099, 0.000691725478689, 0.00574638767494,
      0.0077883522543,  0.0106598609917,   0.01026055433,     -0.00235257988214, 0.00250060067295,
      0.00342848765917, 0.00387937771732,  0.00259489460936,  7.06372352024e-05, -0.00735527063736,
      0.0110327484562,  0.0093607756485,   0.000565284495384, -0.0111297392624,  -0.015490472284,
      0.00688228342016, -0.00343463817367, 0.0092925353925,   -0.00865748517263, -0.0081982421535,
      -0.00632437724289}},
    {"grad_forget_weight",
     {-0.00276884671783, -0.00377166437891, -0.00247748318623, -0.00514912141098, -0.00160307959098,
      0.00337680690325, -0.004216423059, 0.00254309250404, 0.0071736208477, 0.00098120804457,
      -0.00319206962458, -0.00626015440664, 0.000945980166896, 0.000942607630807, -0.00046481591955,
      -0.00080135002328, 0.00336555154943, 0.00497923061987}},
    {"grad_reset_input",
     {0.000480615928643, -0.000640577257868, 0.000169810814832,  -0.000485236506507,
      0.00104238907111,  -0.00061800666869,  -0.000828823497809, 0.000157781892539,
      0.00051442674252,  8.33228254859e-05,  -0.00114872984621,  0.00173661708484,
      0.000368492050006, -0.000479783666014, 2.45129407339e-05,  0.000166399411671,
      -0.00119576647793, 0.00145174577501,   -0.000164836242691, -0.00053266651897,
      0.00150571710964,  -0.000161702856547, -0.000978163365211, 0.00140738385591,
      0.000259986943778, 0.000203861157862,  -0.00104916898732,  0.000137941664014,
      0.000683707910583, -0.0015819444606,   -2.50821252046e-05, 0.00171374214695,
      -0.00161275034415, -0.000818569312435, 0.00111268686071,   -0.00080556920877}},
    {"grad_reset_weight",
     {-5.04610932241e-05, -0.000259465680214, 0.000224689001573, -0.000108987169158,
      3.3604293939e-05, 6.38037311256e-05, -8.60911912967e-05, 0.00032914744206, -0.000223717127721,
      -5.87298819579e-06, 1.168524758e-05, -0.000286848623628, 0.00010472885942, -5.06214606265e-05,
      -0.000167407163337, -3.21565119979e-05, 6.2503356865e-05, 1.10551963817e-05}},
    {"grad_state",
     {0.0375016858081, 0.0325846049761, 0.0452740644652, 0.0471254074965, 0.0397448576614,
      0.0371058988195, 0.0259542566187, -0.0329909352277, -0.0276680212901, -0.040281922873,
      -0.0313805783492, -0.039125749194}},
};

struct KnownCase {
  Problem problem;
  Tensor dy, dhn;
};

KnownCase known_case(bool gru) {
  KnownCase c;
  Problem& p = c.problem;
  p.gru = gru;
  const double in[3][2] = {{0.7, 0.3}, {0.3, 0.8}, {1.1, 0.6}};
  const double w[3][2] = {{1.3, 0.1}, {0.4, 0.5}, {0.8, 0.9}};
  for (int k = 0; k < p.pairs(); ++k) {
    p.inputs.push_back(p.own(pattern({2, 3, 2, 3}, in[k][0], in[k][1])));
    p.weights.push_back(p.own(pattern({2, 3, 3}, w[k][0], w[k][1], 0.6)));
  }
  p.state = p.own(pattern({2, 2, 3}, 0.9, 1.1, 0.5));
  c.dy = pattern({2, 3, 2, 3}, 0.5, 0.2);
  c.dhn = pattern({2, 2, 3}, 1.7, 0.4);
  return c;
}

void expect_values(const TensorView& t, const std::vector<double>& expected,
                   const std::string& what) {
  const std::vector<double> v = values(t);
  ASSERT_EQ(v.size(), expected.size()) << what;
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], expected[i], 1e-10) << what << i;
}

void expect_torch_values(bool gru, std::optional<double> clip, const Expected& e) {
  for (KernelBackend backend : {KernelBackend::Reference, KernelBackend::CPU}) {
    ForceKernelBackend force(backend);
    const std::string name(to_string(backend));
    const KnownCase c = known_case(gru);
    const Forward f = forward(c.problem);
    expect_values(f.output, e.at("output"), name + " output");
    expect_values(f.final_state, e.at("final"), name + " final_state");
    const Grads g = backward(c.problem, f.output, c.dy, c.dhn, clip);
    const char* inputs[3] = {"grad_input", "grad_forget_input", "grad_reset_input"};
    const char* weights[3] = {"grad_weight", "grad_forget_weight", "grad_reset_weight"};
    for (int k = 0; k < c.problem.pairs(); ++k) {
      expect_values(g.inputs[k], e.at(inputs[k]), name + " " + inputs[k]);
      expect_values(g.weights[k], e.at(weights[k]), name + " " + weights[k]);
    }
    expect_values(g.state, e.at("grad_state"), name + " grad_input_state");
  }
}

TEST(Rnn, MatchesAPerStepTorchLoopWithAutogradOnKnownValues) {
  expect_torch_values(false, std::nullopt, kRnn);
}

TEST(Gru, MatchesAPerStepTorchLoopWithAutogradOnKnownValues) {
  expect_torch_values(true, std::nullopt, kGru);
}

TEST(Rnn, GradientClippingClampsTheStateGradientAtEveryStepLikeTorchClampHooks) {
  expect_torch_values(false, 0.05, kRnnClipped);
  EXPECT_NE(kRnnClipped.at("grad_weight"), kRnn.at("grad_weight"));  // the clamp bites
}

TEST(Gru, GradientClippingClampsTheStateGradientAtEveryStepLikeTorchClampHooks) {
  expect_torch_values(true, 0.05, kGruClipped);
  EXPECT_NE(kGruClipped.at("grad_weight"), kGru.at("grad_weight"));
}

TEST(Recurrent, DeterministicRunToRun) {
  for (bool is_gru : {false, true}) {
    const Problem p = random_problem(is_gru, DType::BF16, {4, 20}, 4, 8, 64, 150, true, 2, 4);
    const Forward a = forward(p), b = forward(p);
    EXPECT_TRUE(testing::bitwise_equal(a.output, b.output));
    const Upstream up = random_upstream(a, 151);
    expect_grads_bitwise(backward(p, a.output, up.dy, up.dhn, 1.0),
                         backward(p, a.output, up.dy, up.dhn, 1.0), "run to run");
  }
}

TEST(Recurrent, ManySequencesShareWeightGradientPartials) {
  // B x N = 1200 pairs: the cpu backend sums the weight gradients of 2 sequences per partial.
  const Problem p = random_problem(true, DType::F32, {300, 2}, 300, 4, 2, 155);
  expect_cpu_matches_reference(p);
}

TEST(Recurrent, Int32AndInt64CuSeqlensAgree) {
  const Problem p = random_problem(true, DType::F32, {6}, 2, 2, 3, 160);
  const Forward a = forward(p, cu_seqlens({0, 2, 6}, DType::I32)),
                b = forward(p, cu_seqlens({0, 2, 6}, DType::I64));
  EXPECT_TRUE(testing::bitwise_equal(a.output, b.output));
}

TEST(Recurrent, LengthOneSequencesTakeOneStep) {
  // h = tanh(h0 @ W + x) with H = 1: tanh(0.5 * 2 + 0.25), per sequence.
  Problem p;
  p.inputs.push_back(p.own(test::from({3, 1, 1}, DType::F64, {0.25, -1, 0})));
  p.weights.push_back(p.own(test::from({1, 1, 1}, DType::F64, {2})));
  p.state = p.own(test::from({3, 1, 1}, DType::F64, {0.5, 0.5, -3}));
  const Forward f = forward(p, cu_seqlens({0, 1, 2, 3}));
  const std::vector<double> out = values(f.output);
  EXPECT_NEAR(out[0], std::tanh(1.25), 1e-15);
  EXPECT_NEAR(out[1], std::tanh(0.0), 1e-15);
  EXPECT_NEAR(out[2], std::tanh(-6.0), 1e-15);
  EXPECT_EQ(values(f.final_state), out);
}

TEST(Recurrent, BadCuSeqlensAreClearErrors) {
  const Problem p = random_problem(false, DType::F32, {5}, 2, 1, 3, 170);
  const auto run = [&](const Tensor& cu, std::int64_t max_seqlen = -1) {
    forward(p, cu, max_seqlen);
  };
  test::expect_error(
      [&] {
        run(cu_seqlens({1, 3, 5}));
      },
      ErrorCode::InvalidArgument, {"rnn", "cu_seqlens must start at 0", "cu_seqlens[0] = 1"});
  test::expect_error(
      [&] {
        run(cu_seqlens({0, 4, 3, 5}));
      },
      ErrorCode::InvalidArgument,
      {"rnn", "non-decreasing", "cu_seqlens[2] = 3 < cu_seqlens[1] = 4"});
  test::expect_error(
      [&] {
        run(cu_seqlens({0, 2, 4}));
      },
      ErrorCode::InvalidArgument,
      {"rnn", "must end at the number of rows T = 5", "cu_seqlens[2] = 4"});
  test::expect_error(
      [&] {
        run(cu_seqlens({0, 2, 5}), 2);
      },
      ErrorCode::InvalidArgument, {"rnn", "max_seqlen = 2", "longest sequence (3 rows)"});
  test::expect_error([&] { run(Tensor({3}, DType::F32)); }, ErrorCode::DTypeMismatch,
                     {"rnn", "'cu_seqlens'", "i32 or i64", "f32"});
  Tensor y({5, 1, 3}, DType::F32);
  test::expect_error([&] { rnn(p.inputs[0], p.weights[0], {}, y, {}, Tensor({0}, DType::I64)); },
                     ErrorCode::InvalidArgument, {"rnn", "'cu_seqlens'", "B+1"});
  forward(p, cu_seqlens({0, 2, 5}), 3);  // max_seqlen equal to the longest is fine
  const Problem padded = random_problem(true, DType::F32, {2, 3}, 2, 1, 3, 171);
  test::expect_error([&] { forward(padded, {}, 3); }, ErrorCode::InvalidArgument,
                     {"gru", "max_seqlen", "without cu_seqlens"});
  test::expect_error(
      [&] {
        forward(padded, cu_seqlens({0, 3, 6}));
      },
      ErrorCode::InvalidArgument, {"gru", "'input'", "3 dimensions (T, heads, H) with cu_seqlens"});
}

TEST(Recurrent, BadArgumentsNameTheOpArgumentAndWhatCame) {
  const Tensor x = randn({2, 3, 4, 5}, DType::F32, 1), w = randn({4, 5, 5}, DType::F32, 2),
               y({2, 3, 4, 5}, DType::F32), hn({2, 4, 5}, DType::F32);
  const Tensor w16 = randn({4, 5, 5}, DType::BF16, 3);
  test::expect_error([&] { rnn(x, w16, {}, y, hn); }, ErrorCode::DTypeMismatch,
                     {"rnn", "'weight'", "f32", "bf16"});
  const Tensor w6 = randn({4, 6, 6}, DType::F32, 4);
  test::expect_error([&] { rnn(x, w6, {}, y, hn); }, ErrorCode::ShapeMismatch,
                     {"rnn", "'weight'", "[heads, 5, 5]", "[4, 6, 6]"});
  const Tensor w3 = randn({3, 5, 5}, DType::F32, 5);
  test::expect_error([&] { rnn(x, w3, {}, y, hn); }, ErrorCode::ShapeMismatch,
                     {"rnn", "'weight'", "(3) must divide", "N = 4"});
  const Tensor h0 = randn({2, 2, 5}, DType::F32, 6);
  test::expect_error([&] { rnn(x, w, h0, y, hn); }, ErrorCode::ShapeMismatch,
                     {"rnn", "'input_state'", "[2, 4, 5]", "[2, 2, 5]"});
  Tensor y2({2, 3, 2, 5}, DType::F32);
  test::expect_error([&] { rnn(x, w, {}, y2, hn); }, ErrorCode::ShapeMismatch,
                     {"rnn", "'output'", "[2, 3, 4, 5]"});
  Tensor yt({2, 3, 5, 4}, DType::F32);
  test::expect_error([&] { rnn(x, w, {}, yt.view().transpose(2, 3), hn); },
                     ErrorCode::InvalidArgument, {"rnn", "'output'", "contiguous"});
  const Tensor x3 = randn({2, 3, 5}, DType::F32, 7);
  test::expect_error([&] { rnn(x3, w, {}, y, hn); }, ErrorCode::InvalidArgument,
                     {"rnn", "'input'", "4 dimensions"});
  const Tensor labels = Tensor::zeros({2, 3, 4, 5}, DType::I64);
  test::expect_error([&] { rnn(labels, w, {}, y, hn); }, ErrorCode::DTypeMismatch,
                     {"rnn", "'input'", "i64"});
  Tensor dx({2, 3, 4, 5}, DType::F32), dw({4, 5, 5}, DType::F32), dh0({2, 4, 5}, DType::F32);
  test::expect_error([&] { rnn_backward(y, {}, y, w, {}, dx, dw, dh0); },
                     ErrorCode::InvalidArgument,
                     {"rnn_backward", "'grad_input_state'", "'input_state'"});
  for (double clip : {-1.0, double(NAN)})
    test::expect_error([&] { rnn_backward(y, {}, y, w, {}, dx, dw, {}, clip); },
                       ErrorCode::InvalidArgument, {"rnn_backward", "gradient_clipping", ">= 0"});
  const Tensor dy2 = randn({2, 3, 4, 6}, DType::F32, 8);
  test::expect_error([&] { rnn_backward(dy2, {}, y, w, {}, dx, dw, {}); }, ErrorCode::ShapeMismatch,
                     {"rnn_backward", "'grad_output'", "[2, 3, 4, 5]"});
  const GruParams params{x, w, x, w3, x, w};
  test::expect_error([&] { gru(params, {}, y, hn); }, ErrorCode::ShapeMismatch,
                     {"gru", "'forget_weight'", "(3) must divide"});
}

}  // namespace
}  // namespace meshfuse
