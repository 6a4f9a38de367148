// rnn and gru, forward and backward, padded and packed (cu_seqlens), on every backend the build
// has against the reference backend on the CPU; CUDA cases skip without a GPU.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::randn;
using test::to_cpu;
using test::values;

// One RNN or GRU problem: inputs and weights in GruParams' order (candidate, forget, reset; the
// RNN has only the first), the optional input state and cu_seqlens, and the storage behind the
// views (which may be strided).
struct Problem {
  bool gru = false;
  std::vector<TensorView> inputs, weights;
  TensorView state, cu;
  std::vector<Tensor> storage;

  TensorView own(Tensor t) {
    storage.push_back(std::move(t));
    return storage.back().view();
  }
  int pairs() const { return gru ? 3 : 1; }
  DType dtype() const { return inputs[0].dtype(); }
  Device device() const { return inputs[0].device(); }
  std::int64_t head_dim() const { return inputs[0].size(-1); }
  bool packed() const { return cu.defined(); }
  std::int64_t batch() const { return packed() ? cu.size(0) - 1 : inputs[0].size(0); }
  std::int64_t heads() const {
    std::int64_t n = state.defined() ? state.size(1) : 1;
    for (int k = 0; k < pairs(); ++k) n = std::max({n, inputs[k].size(-2), weights[k].size(0)});
    return n;
  }
  Shape output_shape() const {
    Shape s = inputs[0].shape();
    s[s.size() - 2] = heads();
    return s;
  }
  GruParams params() const {
    return {inputs[0], weights[0], inputs[1], weights[1], inputs[2], weights[2]};
  }
};

// Contiguous copies of every tensor of p on `device`.
Problem on(const Problem& p, Device device, const Stream& stream) {
  Problem q;
  q.gru = p.gru;
  for (int k = 0; k < p.pairs(); ++k) {
    q.inputs.push_back(q.own(test::on(p.inputs[k], device, stream)));
    q.weights.push_back(q.own(test::on(p.weights[k], device, stream)));
  }
  if (p.state.defined()) q.state = q.own(test::on(p.state, device, stream));
  if (p.cu.defined()) q.cu = q.own(test::on(p.cu, device, stream));
  return q;
}

Tensor cu_seqlens(const std::vector<std::int64_t>& offsets, DType dtype = DType::I64) {
  Tensor t({static_cast<std::int64_t>(offsets.size())}, DType::I64);
  std::copy(offsets.begin(), offsets.end(), t.data_ptr<std::int64_t>());
  if (dtype == DType::I64) return t;
  Tensor c(t.shape(), dtype);
  copy(t, c);
  return c;
}

// Head counts per tensor; 0 = N.
struct Heads {
  std::int64_t inputs[3] = {0, 0, 0}, weights[3] = {0, 0, 0};
};

// Random inputs (std 1), weights (std 1/sqrt(H): the state neither dies nor saturates) and state
// (std 0.5), on the CPU. `lead` is (B, S), or (T,) with cu.
Problem random_problem(bool gru, DType dtype, Shape lead, std::int64_t heads, std::int64_t h,
                       std::uint64_t seed, const Tensor& cu = {}, bool with_state = true,
                       Heads counts = {}) {
  Problem p;
  p.gru = gru;
  if (cu.defined()) p.cu = p.own(cu);
  for (int k = 0; k < p.pairs(); ++k) {
    Shape shape = lead;
    shape.push_back(counts.inputs[k] > 0 ? counts.inputs[k] : heads);
    shape.push_back(h);
    p.inputs.push_back(p.own(randn(shape, dtype, seed + 10 * k)));
    p.weights.push_back(p.own(randn({counts.weights[k] > 0 ? counts.weights[k] : heads, h, h},
                                    dtype, seed + 10 * k + 1, 1.0 / std::sqrt(double(h)))));
  }
  if (with_state) p.state = p.own(randn({p.batch(), heads, h}, dtype, seed + 100, 0.5));
  return p;
}

struct Forward {
  Tensor output, final_state;
};

// The forward of p, its results on p's device.
Forward forward(const Problem& p, const Stream& stream = {}, std::int64_t max_seqlen = -1) {
  Forward f{Tensor(p.output_shape(), p.dtype(), p.device(), stream),
            Tensor({p.batch(), p.heads(), p.head_dim()}, p.dtype(), p.device(), stream)};
  if (p.gru)
    gru(p.params(), p.state, f.output, f.final_state, p.cu, max_seqlen, stream);
  else
    rnn(p.inputs[0], p.weights[0], p.state, f.output, f.final_state, p.cu, max_seqlen, stream);
  return f;
}

struct Grads {
  std::vector<Tensor> inputs, weights;
  Tensor state;
};

// The backward of p at the forward output `output`, upstream gradients dy and dhn (each
// optional); grad_input_state when p has a state. Results on p's device, in outputs the op
// writes whole (never pre-zeroed).
Grads backward(const Problem& p, const TensorView& output, const TensorView& dy,
               const TensorView& dhn, std::optional<double> clip, const Stream& stream = {},
               std::int64_t max_seqlen = -1) {
  Grads g;
  for (int k = 0; k < p.pairs(); ++k) {
    g.inputs.emplace_back(p.inputs[k].shape(), p.dtype(), p.device(), stream);
    g.weights.emplace_back(p.weights[k].shape(), p.dtype(), p.device(), stream);
  }
  if (p.state.defined()) g.state = Tensor(p.state.shape(), p.dtype(), p.device(), stream);
  if (p.gru) {
    const GruParams grads{g.inputs[0],  g.weights[0], g.inputs[1],
                          g.weights[1], g.inputs[2],  g.weights[2]};
    gru_backward(dy, dhn, output, p.params(), p.state, grads, g.state, clip, p.cu, max_seqlen,
                 stream);
  } else {
    rnn_backward(dy, dhn, output, p.weights[0], p.state, g.inputs[0], g.weights[0], g.state, clip,
                 p.cu, max_seqlen, stream);
  }
  return g;
}

Forward to_host(const Forward& f, const Stream& stream) {
  return {to_cpu(f.output, stream), to_cpu(f.final_state, stream)};
}

Grads to_host(const Grads& g, const Stream& stream) {
  Grads h;
  for (const Tensor& t : g.inputs) h.inputs.push_back(to_cpu(t, stream));
  for (const Tensor& t : g.weights) h.weights.push_back(to_cpu(t, stream));
  if (g.state.defined()) h.state = to_cpu(g.state, stream);
  return h;
}

// How close a backend comes to the reference: |actual - expected| <= tol * (floor + |expected|).
// Gradients are sums over many steps whose terms cancel, so cuda's errors (other summation
// orders, fp32 state) are held to the tensor's scale: floor = max |expected|, f64 to 1e-10. The
// cpu backend (and the reference against itself) is held to each element, floor 1.
struct Bound {
  double tol;
  bool tensor_scale;
};

Bound bound(KernelBackend backend, DType dtype) {
  const bool cuda = backend == KernelBackend::CUDA;
  switch (dtype) {
    case DType::F64:
      return {cuda ? 1e-10 : testing::default_tolerance(dtype), cuda};
    case DType::F32:
      return {1e-4, cuda};  // fp32 state and sums against double ones, through chained steps
    default:
      return {testing::default_tolerance(dtype), cuda};
  }
}

std::string index_str(const Shape& shape, std::int64_t flat) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  std::ostringstream s;
  s << "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s << (d ? ", " : "") << idx[d];
  s << "]";
  return s.str();
}

// EXPECT `actual` within `b` of `expected` everywhere (CPU tensors) and NaN / inf in the same
// places. A failure names the worst element: index, both values, the error.
void expect_near(const TensorView& actual, const TensorView& expected, Bound b,
                 const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  const std::vector<double> a = values(actual), e = values(expected);
  double floor = 1;
  if (b.tensor_scale) {
    floor = 0;
    for (double v : e)
      if (std::isfinite(v)) floor = std::max(floor, std::fabs(v));
  }
  std::int64_t bad = 0, worst = -1;
  double worst_ratio = 0, max_err = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double ratio;
    if (!std::isfinite(a[i]) || !std::isfinite(e[i])) {
      const bool same = (std::isnan(a[i]) && std::isnan(e[i])) || a[i] == e[i];
      ratio = same ? 0.0 : INFINITY;
    } else {
      const double err = std::fabs(a[i] - e[i]);
      max_err = std::max(max_err, err);
      ratio = err / (b.tol * (floor + std::fabs(e[i])) + 1e-300);
    }
    if (ratio > 1) ++bad;
    if (ratio > worst_ratio || worst < 0) {
      worst_ratio = ratio;
      worst = static_cast<std::int64_t>(i);
    }
  }
  if (bad == 0) return;
  ADD_FAILURE() << what << " " << shape_str(expected.shape()) << ": " << bad << " of " << a.size()
                << " elements off; max abs err " << max_err << " (tol " << b.tol << " x (" << floor
                << " + |expected|)); worst at " << index_str(expected.shape(), worst) << ": got "
                << a[worst] << ", expected " << e[worst];
}

void expect_bitwise(const TensorView& a, const TensorView& b, const std::string& what) {
  EXPECT_TRUE(testing::bitwise_equal(a, b)) << what << " differs bitwise " << shape_str(a.shape());
}

const char* kGradName[3] = {"candidate", "forget", "reset"};

void expect_grads_near(const Grads& a, const Grads& b, Bound bound, const std::string& what) {
  for (std::size_t k = 0; k < a.inputs.size(); ++k) {
    expect_near(a.inputs[k], b.inputs[k], bound, what + ": grad input (" + kGradName[k] + ")");
    expect_near(a.weights[k], b.weights[k], bound, what + ": grad weight (" + kGradName[k] + ")");
  }
  ASSERT_EQ(a.state.defined(), b.state.defined());
  if (a.state.defined()) expect_near(a.state, b.state, bound, what + ": grad input_state");
}

void expect_grads_bitwise(const Grads& a, const Grads& b, const std::string& what) {
  for (std::size_t k = 0; k < a.inputs.size(); ++k) {
    expect_bitwise(a.inputs[k], b.inputs[k], what + ": grad input " + kGradName[k]);
    expect_bitwise(a.weights[k], b.weights[k], what + ": grad weight " + kGradName[k]);
  }
  if (a.state.defined()) expect_bitwise(a.state, b.state, what + ": grad input_state");
}

// The upstream gradients of expect_matches_reference: which are given, their scale, the clip.
struct Upstream {
  bool dy = true, dhn = true;
  double scale = 1.0;
  std::optional<double> clip{};
};

std::string describe(bool gru, std::int64_t h, const std::string& more = "") {
  return std::string(gru ? "gru" : "rnn") + " H=" + std::to_string(h) + more;
}

// One case of the cross-backend suites: rnn or gru, and the OpCase. The target's backend is
// forced for the whole test (the oracle nests its own guard), its tensors live on the target's
// device and its work runs on `stream`.
class RecurrentCase : public ::testing::TestWithParam<std::tuple<bool, test::OpCase>> {
 protected:
  void SetUp() override { MESHFUSE_REQUIRE_TARGET(target); }

  Tensor on(const TensorView& t) const { return test::on(t, target.device, stream); }
  Problem on(const Problem& p) const { return meshfuse::on(p, target.device, stream); }
  Bound tolerance() const { return bound(target.backend, dt); }

  // The target against the reference on the CPU, forward and backward; both backwards run at the
  // reference's forward output (rounding differences of the forward do not carry over).
  void expect_matches_reference(const Problem& p, const std::string& what, Upstream up = {}) const {
    SCOPED_TRACE(what);
    ForceKernelBackend reference(KernelBackend::Reference);
    const Forward ref = forward(p);
    const Tensor dy = up.dy ? randn(ref.output.shape(), dt, 77, up.scale) : Tensor{};
    const Tensor dhn = up.dhn ? randn(ref.final_state.shape(), dt, 78, up.scale) : Tensor{};
    const Grads ref_grads = backward(p, ref.output, dy, dhn, up.clip);
    ForceKernelBackend force(target.backend);
    const Problem tp = on(p);
    const Forward got = to_host(forward(tp, stream), stream);
    expect_near(got.output, ref.output, tolerance(), what + ": output");
    expect_near(got.final_state, ref.final_state, tolerance(), what + ": final_state");
    const Grads got_grads =
        to_host(backward(tp, on(ref.output), on(dy), on(dhn), up.clip, stream), stream);
    expect_grads_near(got_grads, ref_grads, tolerance(), what);
  }

  const bool is_gru = std::get<0>(GetParam());
  const test::Target target = std::get<1>(GetParam()).target;
  const DType dt = std::get<1>(GetParam()).dtype;
  const Stream stream{target.device};

 private:
  ForceKernelBackend force_{target.backend};
};

// (rnn or gru) x op_cases(targets, dtypes); `grus` picks the kinds.
std::vector<std::tuple<bool, test::OpCase>> recurrent_cases(
    const std::vector<test::Target>& targets, const std::vector<DType>& dtypes = test::kFloatDTypes,
    const std::vector<bool>& grus = {false, true}) {
  std::vector<std::tuple<bool, test::OpCase>> out;
  for (const bool gru : grus)
    for (const test::OpCase& c : test::op_cases(targets, dtypes)) out.emplace_back(gru, c);
  return out;
}

// "rnn_cpu_f32", "gru_cuda_bf16", "gru_reference_cuda_f64".
std::string recurrent_case_name(
    const ::testing::TestParamInfo<std::tuple<bool, test::OpCase>>& info) {
  const auto& [gru, c] = info.param;
  return std::string(gru ? "gru_" : "rnn_") + test::target_name(c.target) + "_" +
         std::string(to_string(c.dtype));
}

// cpu and cuda against the reference.
class RecurrentBackends : public RecurrentCase {};
// Invariances of the cpu backend (and the reference), each checked on both.
class RecurrentCpu : public RecurrentCase {};

// H = 64 and 128 take cuda's constant-size kernels, the others the generic one; B = 10 fills one
// group of 8 sequences and part of a second. H = 73: the cpu backend's register blocks of 64 and
// 8 columns, then one.
TEST_P(RecurrentBackends, MatchesTheReferenceOnPaddedInput) {
  struct Case {
    std::int64_t h, batch, steps;
  };
  for (const Case c : {Case{64, 10, 5}, Case{128, 10, 5}, Case{1, 3, 5}, Case{7, 3, 5},
                       Case{33, 3, 5}, Case{1, 3, 6}, Case{5, 3, 6}, Case{73, 3, 6}})
    expect_matches_reference(
        random_problem(is_gru, dt, {c.batch, c.steps}, 2, c.h, 10 + c.h),
        describe(is_gru, c.h, fmt::format(" padded B={} S={}", c.batch, c.steps)));
}

TEST_P(RecurrentBackends, MatchesTheReferenceOnPackedInputWithEmptyAndLengthOneSequences) {
  // lengths 3, 0, 1, 5, 0, 7 (cuda's second group of 8 is not reached; the last sequence is the
  // longest)
  const std::vector<std::int64_t> cu = {0, 3, 3, 4, 9, 9, 16};
  for (DType index : {DType::I32, DType::U32, DType::I64})
    for (std::int64_t h : {64, 7})
      expect_matches_reference(
          random_problem(is_gru, dt, {16}, 2, h, 20 + h, cu_seqlens(cu, index)),
          describe(is_gru, h, fmt::format(" packed, cu_seqlens {}", to_string(index))));
  // lengths 4, 0, 1, 7, 0 (the last sequence empty), 3 heads
  expect_matches_reference(
      random_problem(is_gru, dt, {12}, 3, 19, 20, cu_seqlens({0, 4, 4, 5, 12, 12}, DType::I32)),
      describe(is_gru, 19, " packed, the last sequence empty"));
}

TEST_P(RecurrentBackends, BroadcastsTheHeadsOfInputsAndWeights) {
  // N = 4; each tensor has 1, 2 or 4 heads.
  const Heads cases[] = {{{2, 1, 4}, {1, 4, 2}}, {{1, 4, 2}, {2, 2, 4}}, {{4, 2, 1}, {4, 1, 1}}};
  for (const Heads& c : cases)
    for (std::int64_t h : {64, 7}) {
      std::ostringstream what;
      what << " inputs " << c.inputs[0] << "/" << c.inputs[1] << "/" << c.inputs[2]
           << " heads, weights " << c.weights[0] << "/" << c.weights[1] << "/" << c.weights[2];
      expect_matches_reference(random_problem(is_gru, dt, {9, 4}, 4, h, 30 + h, {}, true, c),
                               describe(is_gru, h, what.str()));
    }
  expect_matches_reference(
      random_problem(is_gru, dt, {2, 5}, 4, 9, 30, {}, false, Heads{{2, 2, 2}, {1, 1, 1}}),
      describe(is_gru, 9, " inputs 2 heads, weights 1, no input_state"));
}

TEST_P(RecurrentBackends, ClipsTheStateGradientAtEveryStep) {
  for (double clip : {0.5, 0.0})
    for (std::int64_t h : {64, 7})
      expect_matches_reference(random_problem(is_gru, dt, {3, 6}, 2, h, 40 + h),
                               describe(is_gru, h, " clip " + std::to_string(clip)),
                               {.scale = 10.0, .clip = clip});
  expect_matches_reference(random_problem(is_gru, dt, {2, 7}, 2, 16, 40),
                           describe(is_gru, 16, " clip 0.3"), {.clip = 0.3});
}

TEST_P(RecurrentBackends, TakesEitherUpstreamGradientAloneAndNoInputState) {
  const Problem with_state = random_problem(is_gru, dt, {3, 5}, 2, 64, 50);
  const Problem without_state = random_problem(is_gru, dt, {3, 5}, 2, 64, 50, {}, false);
  expect_matches_reference(with_state, "grad_final_state only", {.dy = false});
  expect_matches_reference(with_state, "grad_output only", {.dhn = false});
  expect_matches_reference(with_state, "no upstream gradient", {.dy = false, .dhn = false});
  expect_matches_reference(without_state, "no input_state");
}

TEST_P(RecurrentBackends, UpstreamGradientsAreOptionalAndMeanZeros) {
  const Problem p = on(random_problem(is_gru, dt, {2, 4}, 2, 7, 120));
  const Forward f = forward(p, stream);
  const Tensor dy = on(randn(f.output.shape(), dt, 121)),
               dhn = on(randn(f.final_state.shape(), dt, 122));
  const Tensor dy0 = on(Tensor::zeros(dy.shape(), dt)), dhn0 = on(Tensor::zeros(dhn.shape(), dt));
  const auto grads = [&](const TensorView& dy, const TensorView& dhn) {
    return to_host(backward(p, f.output, dy, dhn, std::nullopt, stream), stream);
  };
  expect_grads_bitwise(grads({}, dhn), grads(dy0, dhn), "grad_output absent");
  expect_grads_bitwise(grads(dy, {}), grads(dy, dhn0), "grad_final_state absent");
}

// S = 0, every sequence empty, B = 0: final_state is the input state, grad_input_state the final
// state's gradient, weight gradients are zeros.
TEST_P(RecurrentBackends, HandlesBatchesWithoutSteps) {
  expect_matches_reference(random_problem(is_gru, dt, {3, 0}, 2, 64, 60), "S = 0");
  expect_matches_reference(random_problem(is_gru, dt, {0}, 2, 7, 61, cu_seqlens({0, 0, 0})),
                           "all sequences empty");
  expect_matches_reference(random_problem(is_gru, dt, {0}, 2, 7, 62, cu_seqlens({0})), "B = 0");
}

TEST_P(RecurrentBackends, AllSequencesEmptyAndZeroStepsKeepTheStateAndGiveZeroWeightGradients) {
  struct Case {
    Shape lead;
    Tensor cu;
  };
  const Case cases[] = {{{0}, cu_seqlens({0, 0, 0})}, {{2, 0}, Tensor()}};
  for (const Case& c : cases) {
    for (bool with_state : {true, false}) {
      const Problem p = on(random_problem(is_gru, dt, c.lead, 3, 5, 110, c.cu, with_state));
      const Forward f = to_host(forward(p, stream), stream);
      EXPECT_EQ(f.output.numel(), 0);
      const Tensor zeros = Tensor::zeros({2, 3, 5}, dt);
      EXPECT_TRUE(
          testing::bitwise_equal(f.final_state, with_state ? to_cpu(p.state, stream) : zeros));
      const Tensor dy = on(randn(f.output.shape(), dt, 111)),
                   dhn = on(randn(f.final_state.shape(), dt, 112));
      const Grads g = to_host(backward(p, on(f.output), dy, dhn, std::nullopt, stream), stream);
      for (int k = 0; k < p.pairs(); ++k)
        EXPECT_TRUE(testing::bitwise_equal(g.weights[k], Tensor::zeros(g.weights[k].shape(), dt)));
      if (with_state) {
        EXPECT_TRUE(testing::bitwise_equal(g.state, to_cpu(dhn, stream)));
      }
    }
  }
}

TEST_P(RecurrentBackends, EmptySequencesWriteNoRowsAndKeepTheirInputState) {
  const Problem p = on(random_problem(is_gru, dt, {5}, 2, 4, 100, cu_seqlens({0, 0, 3, 3, 3, 5})));
  const Forward f = forward(p, stream);
  const Tensor dhn = on(randn(f.final_state.shape(), dt, 102));
  const Grads g = to_host(
      backward(p, f.output, on(randn(f.output.shape(), dt, 101)), dhn, 0.1, stream), stream);
  const Tensor final_state = to_cpu(f.final_state, stream), state = to_cpu(p.state, stream),
               dhn_host = to_cpu(dhn, stream);
  for (std::int64_t b : {0, 2, 3}) {
    expect_bitwise(final_state.view().narrow(0, b, 1), state.view().narrow(0, b, 1),
                   fmt::format("final_state of sequence {}", b));
    // Not clamped: the clamp acts at steps, and an empty sequence has none.
    expect_bitwise(g.state.view().narrow(0, b, 1), dhn_host.view().narrow(0, b, 1),
                   fmt::format("grad_input_state of sequence {}", b));
  }
}

TEST_P(RecurrentBackends, IsBitwiseDeterministicRunToRunOnAStream) {
  // A stream of its own on CUDA (non-blocking with respect to the default stream).
  std::optional<CudaStream> cuda_stream;
  if (target.device.type == DeviceType::CUDA) cuda_stream.emplace(target.device.index);
  const Stream own = cuda_stream ? cuda_stream->stream() : stream;
  Heads broadcast;  // weight partials of several heads and input gradients of several heads add up
  for (int k = 0; k < 3; ++k) broadcast.inputs[k] = broadcast.weights[k] = 2;
  struct Case {
    Shape lead;
    std::int64_t heads, h;
    Heads counts;
  };
  for (const Case& c : {Case{{16, 9}, 4, 64, broadcast}, Case{{16, 9}, 4, 33, broadcast},
                        Case{{4, 20}, 8, 64, Heads{{2, 2, 2}, {4, 4, 4}}}}) {
    SCOPED_TRACE(describe(is_gru, c.h, fmt::format(" {}", shape_str(c.lead))));
    const Problem p =
        meshfuse::on(random_problem(is_gru, dt, c.lead, c.heads, c.h, 70 + c.h, {}, true, c.counts),
                     target.device, own);
    const Forward f1 = forward(p, own), f2 = forward(p, own);
    expect_bitwise(to_cpu(f1.output, own), to_cpu(f2.output, own), "output");
    expect_bitwise(to_cpu(f1.final_state, own), to_cpu(f2.final_state, own), "final_state");
    const Tensor dy = test::on(randn(f1.output.shape(), dt, 71), target.device, own);
    const Tensor dhn = test::on(randn(f1.final_state.shape(), dt, 72), target.device, own);
    const Grads g1 = backward(p, f1.output, dy, dhn, 1.0, own),
                g2 = backward(p, f1.output, dy, dhn, 1.0, own);
    expect_grads_bitwise(to_host(g1, own), to_host(g2, own), "backward");
  }
}

// Sequence b of a packed problem as a problem of its own: padded (1, length, heads, H), or packed
// with one sequence.
Problem sequence_of(const Problem& p, const std::vector<std::int64_t>& cu, std::int64_t b,
                    bool packed) {
  Problem q;
  q.gru = p.gru;
  const std::int64_t first = cu[b], len = cu[b + 1] - first;
  for (int k = 0; k < p.pairs(); ++k) {
    const TensorView rows = p.inputs[k].narrow(0, first, len);
    q.inputs.push_back(
        q.own(Tensor::copy_of(packed ? rows : rows.reshape({1, len, rows.size(1), rows.size(2)}))));
    q.weights.push_back(p.weights[k]);
  }
  if (p.state.defined()) q.state = q.own(Tensor::copy_of(p.state.narrow(0, b, 1)));
  if (packed) q.cu = q.own(cu_seqlens({0, len}));
  return q;
}

// Rows [first, first + len) of a packed (T, heads, H) tensor as a padded (1, len, heads, H) one.
Tensor as_padded(const TensorView& t, std::int64_t first, std::int64_t len) {
  const TensorView rows = t.narrow(0, first, len);
  return Tensor::copy_of(rows.reshape({1, len, rows.size(1), rows.size(2)}));
}

TEST_P(RecurrentBackends, PackedEqualsEachSequenceRunOnItsOwnThroughTheReference) {
  const std::vector<std::int64_t> offsets = {0, 3, 3, 4, 9};
  const Problem p = random_problem(is_gru, dt, {9}, 2, 6, 50, cu_seqlens(offsets));
  const Problem tp = on(p);
  const Forward f = to_host(forward(tp, stream), stream);
  const Tensor dy = randn(f.output.shape(), dt, 51), dhn = randn(f.final_state.shape(), dt, 52);
  const Grads g =
      to_host(backward(tp, on(f.output), on(dy), on(dhn), std::nullopt, stream), stream);
  ForceKernelBackend force(KernelBackend::Reference);
  const Bound tol = tolerance();
  std::vector<Tensor> weight_sums;
  for (int k = 0; k < p.pairs(); ++k)
    weight_sums.push_back(Tensor::zeros(p.weights[k].shape(), DType::F64));
  for (std::int64_t b = 0; b < 4; ++b) {
    const std::int64_t first = offsets[b], len = offsets[b + 1] - first;
    const std::string what = "sequence " + std::to_string(b);
    const Problem q = sequence_of(p, offsets, b, false);
    const Forward fq = forward(q);
    expect_near(as_padded(f.output, first, len), fq.output, tol, what + " output");
    expect_near(f.final_state.view().narrow(0, b, 1), fq.final_state, tol, what + " final");
    // The sequence's backward at the packed run's outputs and upstream gradients.
    const Grads gq = backward(q, as_padded(f.output, first, len), as_padded(dy, first, len),
                              dhn.view().narrow(0, b, 1), std::nullopt);
    for (int k = 0; k < p.pairs(); ++k) {
      expect_near(as_padded(g.inputs[k], first, len), gq.inputs[k], tol, what + " grad input");
      const std::vector<double> part = values(gq.weights[k]);
      for (std::size_t e = 0; e < part.size(); ++e) weight_sums[k].data_ptr<double>()[e] += part[e];
    }
    expect_near(g.state.view().narrow(0, b, 1), gq.state, tol, what + " grad input_state");
  }
  for (int k = 0; k < p.pairs(); ++k)
    expect_near(g.weights[k], weight_sums[k], {2 * tol.tol, tol.tensor_scale},
                "grad weight (sum over sequences)");
}

// A packed batch gives, row for row, bitwise the forward of each sequence run on its own (the
// sequences of a block do not interact).
TEST_P(RecurrentBackends, PackedForwardIsBitwiseEachSequenceRunAlone) {
  const std::vector<std::int64_t> cu = {0, 4, 4, 5, 11};
  const Problem packed = random_problem(is_gru, dt, {11}, 2, 64, 80, cu_seqlens(cu));
  const Forward all = to_host(forward(on(packed), stream), stream);
  for (std::int64_t b = 0; b + 1 < static_cast<std::int64_t>(cu.size()); ++b) {
    const std::int64_t first = cu[b], len = cu[b + 1] - cu[b];
    const Forward alone = to_host(forward(on(sequence_of(packed, cu, b, true)), stream), stream);
    const std::string what = "sequence " + std::to_string(b);
    expect_bitwise(alone.output, all.output.view().narrow(0, first, len), what + " output");
    expect_bitwise(alone.final_state, all.final_state.view().narrow(0, b, 1),
                   what + " final_state");
  }
}

TEST_P(RecurrentBackends, CuSeqlensOfEveryIndexDTypeGiveBitwiseTheSameResults) {
  const Problem p = random_problem(is_gru, dt, {6}, 2, 3, 160, cu_seqlens({0, 2, 6}));
  const Tensor dy = randn(p.output_shape(), dt, 161), dhn = randn(p.state.shape(), dt, 162);
  const auto run = [&](DType index) {
    Problem q = on(p);
    q.cu = q.own(on(cu_seqlens({0, 2, 6}, index)));
    const Forward f = forward(q, stream);
    return std::pair(to_host(f, stream),
                     to_host(backward(q, f.output, on(dy), on(dhn), std::nullopt, stream), stream));
  };
  const auto [forward32, grads32] = run(DType::I32);
  for (DType index : {DType::U32, DType::I64}) {
    const auto [f, g] = run(index);
    const std::string what = std::string(to_string(index)) + " against i32";
    expect_bitwise(f.output, forward32.output, what + ": output");
    expect_bitwise(f.final_state, forward32.final_state, what + ": final_state");
    expect_grads_bitwise(g, grads32, what);
  }
}

// B x N = 1200 pairs: the cpu backend sums the weight gradients of 2 sequences per partial.
TEST_P(RecurrentBackends, ManySequencesShareWeightGradientPartials) {
  expect_matches_reference(random_problem(is_gru, dt, {300, 2}, 4, 2, 155), "B = 300");
}

// A NaN input poisons its sequence's state from that step on; +-inf saturates the activation. The
// forward puts NaN and inf where the reference does.
TEST_P(RecurrentBackends, NanAndInfInputsGiveTheReferencesNonFiniteValues) {
  Problem p = random_problem(is_gru, dt, {3, 4}, 2, 7, 85);
  const std::pair<Shape, double> poison[] = {
      {{0, 1, 0, 2}, NAN}, {{1, 2, 1, 0}, INFINITY}, {{2, 0, 0, 0}, -INFINITY}};
  for (const auto& [at, value] : poison) {
    TensorView v = p.inputs[0];
    for (std::size_t d = 0; d < at.size(); ++d) v = v.narrow(d, at[d], 1);
    copy(test::full({1, 1, 1, 1}, DType::F64, value), v);
  }
  Forward ref;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref = forward(p);
  }
  const Forward got = to_host(forward(on(p), stream), stream);
  expect_near(got.output, ref.output, tolerance(), "output");
  expect_near(got.final_state, ref.final_state, tolerance(), "final_state");
}

TEST_P(RecurrentBackends, NanInOneSequenceStaysInThatSequence) {
  Problem p = random_problem(is_gru, dt, {2, 3}, 1, 4, 140);
  fill(p.inputs[0].narrow(0, 0, 1).narrow(1, 1, 1).narrow(3, 2, 1), NAN);
  const Forward f = to_host(forward(on(p), stream), stream);
  EXPECT_FALSE(std::isnan(values(f.output)[0]));  // sequence 0, step 0: before the NaN
  EXPECT_TRUE(std::isnan(values(f.final_state)[0]));
  for (double v : values(f.output.view().narrow(0, 1, 1))) EXPECT_FALSE(std::isnan(v));
  for (double v : values(f.final_state.view().narrow(0, 1, 1))) EXPECT_FALSE(std::isnan(v));
}

// Strided views (input, weights, state, upstream gradients, forward output) give bitwise the
// results of their contiguous copies: the last two dimensions swapped, and steps and heads swapped
// in (B, S, N, H) with batch and heads in the states.
TEST_P(RecurrentBackends, NonContiguousInputsGiveBitwiseTheContiguousResult) {
  struct Case {
    Shape lead;
    std::int64_t h;
    std::uint64_t seed;
    std::int64_t x_dim, state_dim;  // the first of the two dims swapped
  };
  for (const Case& c : {Case{{2, 3}, 5, 130, 2, 1}, Case{{3, 5}, 33, 90, 1, 0}}) {
    SCOPED_TRACE(describe(is_gru, c.h));
    const Problem p = on(random_problem(is_gru, dt, c.lead, 2, c.h, c.seed));
    Problem q;
    q.gru = is_gru;
    // Storage with dims d and d + 1 swapped, viewed back: the same values, other strides.
    const auto strided = [&](const TensorView& t, std::int64_t d) {
      Shape shape = t.shape();
      std::swap(shape[d], shape[d + 1]);
      const TensorView v = q.own(Tensor(shape, dt, target.device, stream)).transpose(d, d + 1);
      copy(t, v, stream);
      return v;
    };
    for (int k = 0; k < p.pairs(); ++k) {
      q.inputs.push_back(strided(p.inputs[k], c.x_dim));
      q.weights.push_back(strided(p.weights[k], 1));
    }
    q.state = strided(p.state, c.state_dim);
    ASSERT_FALSE(q.inputs[0].is_contiguous());
    const Forward a = forward(p, stream), b = forward(q, stream);
    expect_bitwise(to_cpu(b.output, stream), to_cpu(a.output, stream), "output");
    expect_bitwise(to_cpu(b.final_state, stream), to_cpu(a.final_state, stream), "final_state");
    const Tensor dy = on(randn(a.output.shape(), dt, c.seed + 1)),
                 dhn = on(randn(a.final_state.shape(), dt, c.seed + 2));
    const Grads expected = backward(p, a.output, dy, dhn, std::nullopt, stream);
    const Grads got = backward(q, strided(a.output, c.x_dim), strided(dy, c.x_dim),
                               strided(dhn, c.state_dim), std::nullopt, stream);
    expect_grads_bitwise(to_host(got, stream), to_host(expected, stream), "backward");
  }
}

// Head sizes whose weights (and, for the GRU's backward, state arrays) do not fit in cuda's shared
// memory run from global memory, in several passes over the column pairs.
TEST_P(RecurrentBackends, HeadSizesBeyondSharedMemoryMatchTheReference) {
  expect_matches_reference(random_problem(is_gru, dt, {2, 3}, 1, 811, 95), describe(is_gru, 811));
}

TEST_P(RecurrentCpu, PaddedAndPackedGiveBitwiseTheSameResults) {
  const Problem padded = random_problem(is_gru, dt, {3, 5}, 2, 8, 60);
  Problem packed;
  packed.gru = is_gru;
  for (int k = 0; k < padded.pairs(); ++k) {
    packed.inputs.push_back(padded.inputs[k].reshape({15, 2, 8}));
    packed.weights.push_back(padded.weights[k]);
  }
  packed.state = padded.state;
  packed.cu = packed.own(cu_seqlens({0, 5, 10, 15}, DType::I32));
  for (KernelBackend backend : {KernelBackend::CPU, KernelBackend::Reference}) {
    ForceKernelBackend force(backend);
    const Forward a = forward(padded, stream), b = forward(packed, stream, 5);
    EXPECT_TRUE(testing::bitwise_equal(a.output.view().reshape({15, 2, 8}), b.output));
    EXPECT_TRUE(testing::bitwise_equal(a.final_state, b.final_state));
    const Tensor dy = randn(a.output.shape(), dt, 61), dhn = randn(a.final_state.shape(), dt, 62);
    const Grads ga = backward(padded, a.output, dy, dhn, 0.5, stream);
    const Grads gb = backward(packed, b.output, dy.view().reshape({15, 2, 8}), dhn, 0.5, stream, 5);
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

TEST_P(RecurrentCpu, BroadcastHeadsEqualRepeatedTensorsWithGradientsSummed) {
  // N = 4 heads: the input has 1 head (GRU: forget 2, reset 4), the weight 2 (GRU: 1, 4).
  const std::int64_t in_heads[3] = {1, 2, 4}, w_heads[3] = {2, 1, 4};
  Problem p, full;
  p.gru = full.gru = is_gru;
  for (int k = 0; k < p.pairs(); ++k) {
    p.inputs.push_back(p.own(randn({2, 5, in_heads[k], 6}, dt, 70 + k)));
    p.weights.push_back(p.own(randn({w_heads[k], 6, 6}, dt, 80 + k, 0.4)));
    full.inputs.push_back(full.own(repeat_heads(p.inputs[k], 2, 4 / in_heads[k])));
    full.weights.push_back(full.own(repeat_heads(p.weights[k], 0, 4 / w_heads[k])));
  }
  p.state = full.state = p.own(randn({2, 4, 6}, dt, 90, 0.5));
  for (KernelBackend backend : {KernelBackend::CPU, KernelBackend::Reference}) {
    ForceKernelBackend force(backend);
    const Forward a = forward(p, stream), b = forward(full, stream);
    EXPECT_TRUE(testing::bitwise_equal(a.output, b.output));
    EXPECT_TRUE(testing::bitwise_equal(a.final_state, b.final_state));
    const Tensor dy = randn(a.output.shape(), dt, 91), dhn = randn(a.final_state.shape(), dt, 92);
    const Grads ga = backward(p, a.output, dy, dhn, std::nullopt, stream),
                gb = backward(full, b.output, dy, dhn, std::nullopt, stream);
    for (int k = 0; k < p.pairs(); ++k) {
      expect_near(ga.inputs[k], sum_heads(gb.inputs[k], 2, 4 / in_heads[k]), tolerance(),
                  "grad input");
      expect_near(ga.weights[k], sum_heads(gb.weights[k], 0, 4 / w_heads[k]), tolerance(),
                  "grad weight");
    }
    EXPECT_TRUE(testing::bitwise_equal(ga.state, gb.state));
  }
}

INSTANTIATE_TEST_SUITE_P(, RecurrentBackends,
                         ::testing::ValuesIn(recurrent_cases(test::kernel_targets())),
                         recurrent_case_name);
INSTANTIATE_TEST_SUITE_P(, RecurrentCpu,
                         ::testing::ValuesIn(recurrent_cases({{KernelBackend::CPU, Device{}}})),
                         recurrent_case_name);

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

// PyTorch's numbers (float64) on every target, the reference on CPU and CUDA tensors included.
class RecurrentKnownValues : public RecurrentCase {
 protected:
  void expect_torch_values(std::optional<double> clip, const Expected& e) const {
    const KnownCase c = known_case(is_gru);
    const Problem p = on(c.problem);
    const Forward f = forward(p, stream), host = to_host(f, stream);
    expect_values(host.output, e.at("output"), "output");
    expect_values(host.final_state, e.at("final"), "final_state");
    const Grads g = to_host(backward(p, f.output, on(c.dy), on(c.dhn), clip, stream), stream);
    const char* inputs[3] = {"grad_input", "grad_forget_input", "grad_reset_input"};
    const char* weights[3] = {"grad_weight", "grad_forget_weight", "grad_reset_weight"};
    for (int k = 0; k < p.pairs(); ++k) {
      expect_values(g.inputs[k], e.at(inputs[k]), inputs[k]);
      expect_values(g.weights[k], e.at(weights[k]), weights[k]);
    }
    expect_values(g.state, e.at("grad_state"), "grad_input_state");
  }
  const Expected& unclipped() const { return is_gru ? kGru : kRnn; }
  const Expected& clipped() const { return is_gru ? kGruClipped : kRnnClipped; }
};

TEST_P(RecurrentKnownValues, MatchesAPerStepTorchLoopWithAutogradOnKnownValues) {
  expect_torch_values(std::nullopt, unclipped());
}

TEST_P(RecurrentKnownValues, GradientClippingClampsTheStateGradientAtEveryStepLikeTorchClampHooks) {
  expect_torch_values(0.05, clipped());
  EXPECT_NE(clipped().at("grad_weight"), unclipped().at("grad_weight"));  // the clamp bites
}

// rnn's values known in closed form, on every target.
class RnnKnownValues : public RecurrentCase {};

TEST_P(RnnKnownValues, LengthOneSequencesTakeOneStep) {
  // h = tanh(h0 @ W + x) with H = 1: tanh(0.5 * 2 + 0.25), per sequence.
  Problem p;
  p.inputs.push_back(p.own(test::from({3, 1, 1}, dt, {0.25, -1, 0})));
  p.weights.push_back(p.own(test::from({1, 1, 1}, dt, {2})));
  p.state = p.own(test::from({3, 1, 1}, dt, {0.5, 0.5, -3}));
  p.cu = p.own(cu_seqlens({0, 1, 2, 3}));
  const Forward f = to_host(forward(on(p), stream), stream);
  const std::vector<double> out = values(f.output);
  EXPECT_NEAR(out[0], std::tanh(1.25), 1e-15);
  EXPECT_NEAR(out[1], std::tanh(0.0), 1e-15);
  EXPECT_NEAR(out[2], std::tanh(-6.0), 1e-15);
  EXPECT_EQ(values(f.final_state), out);
}

INSTANTIATE_TEST_SUITE_P(, RecurrentKnownValues,
                         ::testing::ValuesIn(recurrent_cases(test::all_targets(), {DType::F64})),
                         recurrent_case_name);
INSTANTIATE_TEST_SUITE_P(, RnnKnownValues,
                         ::testing::ValuesIn(recurrent_cases(test::all_targets(), {DType::F64},
                                                             {false})),
                         recurrent_case_name);

TEST(Recurrent, BadCuSeqlensAreClearErrors) {
  const Problem p = random_problem(false, DType::F32, {5}, 1, 3, 170, cu_seqlens({0, 2, 5}));
  const auto run = [&](const Tensor& cu, std::int64_t max_seqlen = -1) {
    Problem q = p;
    q.cu = q.own(cu);
    forward(q, {}, max_seqlen);
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
                     {"rnn", "'cu_seqlens'", "i32 or u32 or i64, got f32"});
  // A u32 offset past 2^31 is read as unsigned: a wrong end, not a decreasing offset.
  test::expect_error(
      [&] {
        run(cu_seqlens({0, 2, 3'000'000'000}, DType::U32));
      },
      ErrorCode::InvalidArgument,
      {"rnn", "must end at the number of rows T = 5", "cu_seqlens[2] = 3000000000"});
  Tensor y({5, 1, 3}, DType::F32);
  test::expect_error([&] { rnn(p.inputs[0], p.weights[0], {}, y, {}, Tensor({0}, DType::I64)); },
                     ErrorCode::InvalidArgument, {"rnn", "'cu_seqlens'", "B+1"});
  run(cu_seqlens({0, 2, 5}), 3);  // max_seqlen equal to the longest is fine
  const Problem padded = random_problem(true, DType::F32, {2, 3}, 1, 3, 171);
  test::expect_error([&] { forward(padded, {}, 3); }, ErrorCode::InvalidArgument,
                     {"gru", "max_seqlen", "without cu_seqlens"});
  test::expect_error(
      [&] {
        Problem q = padded;
        q.cu = q.own(cu_seqlens({0, 3, 6}));
        forward(q);
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

// The reference backend forced on CUDA tensors runs through host copies: bitwise the CPU's.
TEST(CudaRecurrent, ForcedReferenceOnCudaTensorsMatchesTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{kCuda};
  for (bool gru : {false, true}) {
    SCOPED_TRACE(gru ? "gru" : "rnn");
    const Problem p = random_problem(gru, DType::BF16, {7}, 2, 7, 96, cu_seqlens({0, 2, 7}));
    ForceKernelBackend force(KernelBackend::Reference);
    const Forward cpu = forward(p);
    const Problem gp = on(p, kCuda, stream);
    const Forward staged = forward(gp, stream);
    EXPECT_EQ(staged.output.device(), kCuda);
    expect_bitwise(to_cpu(staged.output, stream), cpu.output, "output");
    expect_bitwise(to_cpu(staged.final_state, stream), cpu.final_state, "final_state");
    const Tensor dy = randn(cpu.output.shape(), DType::BF16, 97);
    const Grads cg = backward(p, cpu.output, dy, {}, 2.0);
    const Grads sg = backward(gp, test::on(cpu.output, kCuda, stream), test::on(dy, kCuda, stream),
                              {}, 2.0, stream);
    expect_grads_bitwise(to_host(sg, stream), cg, "backward");
  }
}

// Zeros written on the device: a copy from one zero element broadcast with zero strides.
Tensor cuda_zeros(const Shape& shape, DType dtype, const Stream& stream) {
  const Tensor zero = Tensor::zeros({1}, dtype, kCuda, stream);
  Tensor t(shape, dtype, kCuda, stream);
  copy(TensorView(zero.data_ptr<char>(), dtype, shape, Shape(shape.size(), 0), kCuda), t, stream);
  return t;
}

// One sequence of S = 32771 steps of 1024 heads of 64: its last rows start past element 2^31
// (4 GiB per bf16 tensor, 16 GiB in all). The inputs are zero but for the last 3 steps, so the
// state is zero until then and the last 3 rows equal a 3-step run (bitwise); zero states add
// nothing to the weight gradient, and the clipped gradient stays finite through the zero steps.
TEST(CudaRecurrent, RowsPastElementTwoToThe31AreAddressedWith64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  const Stream stream{kCuda};
  constexpr std::int64_t kHeads = 1024, kH = 64, kTail = 3;
  constexpr std::int64_t kSteps = (std::int64_t{1} << 31) / (kHeads * kH) + kTail;
  const Problem small = random_problem(false, DType::BF16, {1, kTail}, kHeads, kH, 98, {}, false,
                                       Heads{{0, 0, 0}, {1, 1, 1}});
  Problem big;
  big.inputs.push_back(big.own(cuda_zeros({1, kSteps, kHeads, kH}, DType::BF16, stream)));
  big.weights.push_back(big.own(test::on(small.weights[0], kCuda, stream)));
  copy(small.inputs[0], big.inputs[0].narrow(1, kSteps - kTail, kTail), stream);
  const Problem gsmall = on(small, kCuda, stream);

  const Forward fs = forward(gsmall, stream), fb = forward(big, stream);
  expect_bitwise(to_cpu(fb.output.view().narrow(1, kSteps - kTail, kTail), stream),
                 to_cpu(fs.output, stream), "last rows of the output");
  expect_bitwise(to_cpu(fb.final_state, stream), to_cpu(fs.final_state, stream), "final_state");

  const Tensor dy_small = test::on(randn(fs.output.shape(), DType::BF16, 99), kCuda, stream);
  const Tensor dy = cuda_zeros(fb.output.shape(), DType::BF16, stream);
  copy(dy_small, dy.view().narrow(1, kSteps - kTail, kTail), stream);
  const Grads gs = backward(gsmall, fs.output, dy_small, {}, 1.0, stream);
  const Grads gb = backward(big, fb.output, dy, {}, 1.0, stream);
  expect_bitwise(to_cpu(gb.inputs[0].view().narrow(1, kSteps - kTail, kTail), stream),
                 to_cpu(gs.inputs[0], stream), "last rows of grad_input");
  expect_bitwise(to_cpu(gb.weights[0], stream), to_cpu(gs.weights[0], stream), "grad_weight");
}

}  // namespace
}  // namespace meshfuse
