// rnn and gru (forward and backward) on CUDA tensors against the reference backend on the CPU.
// Skipped without a GPU.
#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "meshfuse/ops/recurrent.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::randn;
using test::to_cpu;
using test::to_cuda;

// One problem, on the CPU: inputs and weights in GruParams' order (candidate, forget, reset; the
// RNN uses the first), optional input_state and cu_seqlens.
struct Problem {
  bool gru = false;
  std::vector<Tensor> inputs, weights;
  Tensor state, cu;

  int pairs() const { return gru ? 3 : 1; }
  DType dtype() const { return inputs[0].dtype(); }
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
};

Tensor on(const Tensor& t, Device device, const Stream& stream = {}) {
  return t.defined() ? t.to(device, stream) : Tensor{};
}

Problem on(const Problem& p, Device device, const Stream& stream = {}) {
  Problem q;
  q.gru = p.gru;
  for (int k = 0; k < p.pairs(); ++k) {
    q.inputs.push_back(on(p.inputs[k], device, stream));
    q.weights.push_back(on(p.weights[k], device, stream));
  }
  q.state = on(p.state, device, stream);
  q.cu = on(p.cu, device, stream);
  return q;
}

Tensor offsets(const std::vector<std::int64_t>& values, DType dtype = DType::I64) {
  Tensor t({static_cast<std::int64_t>(values.size())}, DType::I64);
  std::copy(values.begin(), values.end(), t.data_ptr<std::int64_t>());
  if (dtype == DType::I64) return t;
  Tensor c(t.shape(), dtype);
  copy(t, c);
  return c;
}

// Head counts per tensor; 0 = N.
struct Heads {
  std::int64_t inputs[3] = {0, 0, 0}, weights[3] = {0, 0, 0};
};

// Random inputs (std 1), weights (std 1/sqrt(H): the state neither dies nor saturates), state
// (std 0.5). `lead` is (B, S), or (T,) with cu.
Problem make_problem(bool gru, DType dtype, Shape lead, std::int64_t heads, std::int64_t h,
                     std::uint64_t seed, Tensor cu = {}, bool with_state = true,
                     Heads counts = {}) {
  Problem p;
  p.gru = gru;
  p.cu = std::move(cu);
  for (int k = 0; k < p.pairs(); ++k) {
    Shape shape = lead;
    shape.push_back(counts.inputs[k] > 0 ? counts.inputs[k] : heads);
    shape.push_back(h);
    p.inputs.push_back(randn(shape, dtype, seed + 10 * k));
    p.weights.push_back(randn({counts.weights[k] > 0 ? counts.weights[k] : heads, h, h}, dtype,
                              seed + 10 * k + 1, 1.0 / std::sqrt(double(h))));
  }
  const std::int64_t batch = p.packed() ? p.cu.size(0) - 1 : lead[0];
  if (with_state) p.state = randn({batch, heads, h}, dtype, seed + 100, 0.5);
  return p;
}

GruParams params(const std::vector<TensorView>& in, const std::vector<TensorView>& w) {
  return {in[0], w[0], in[1], w[1], in[2], w[2]};
}

std::vector<TensorView> views(const std::vector<Tensor>& ts) { return {ts.begin(), ts.end()}; }

struct Forward {
  Tensor output, final_state;
};

// Runs the forward of p (all tensors on one device); returns the results on that device.
Forward forward(const Problem& p, Device device, const Stream& stream = {}) {
  Forward f{Tensor(p.output_shape(), p.dtype(), device, stream),
            Tensor({p.batch(), p.heads(), p.head_dim()}, p.dtype(), device, stream)};
  if (p.gru)
    gru(params(views(p.inputs), views(p.weights)), p.state, f.output, f.final_state, p.cu, -1,
        stream);
  else
    rnn(p.inputs[0], p.weights[0], p.state, f.output, f.final_state, p.cu, -1, stream);
  return f;
}

struct Grads {
  std::vector<Tensor> inputs, weights;
  Tensor state;
};

// The backward of p at the forward output `output`, with upstream gradients dy and dhn (each
// optional); grad_input_state when p has a state. Results on the device of p.
Grads backward(const Problem& p, const TensorView& output, const TensorView& dy,
               const TensorView& dhn, std::optional<double> clip, Device device,
               const Stream& stream = {}) {
  Grads g;
  for (int k = 0; k < p.pairs(); ++k) {
    g.inputs.emplace_back(p.inputs[k].shape(), p.dtype(), device, stream);
    g.weights.emplace_back(p.weights[k].shape(), p.dtype(), device, stream);
  }
  if (p.state.defined()) g.state = Tensor(p.state.shape(), p.dtype(), device, stream);
  if (p.gru) {
    const std::vector<TensorView> gi = views(g.inputs), gw = views(g.weights);
    gru_backward(dy, dhn, output, params(views(p.inputs), views(p.weights)), p.state,
                 params(gi, gw), g.state, clip, p.cu, -1, stream);
  } else {
    rnn_backward(dy, dhn, output, p.weights[0], p.state, g.inputs[0], g.weights[0], g.state, clip,
                 p.cu, -1, stream);
  }
  return g;
}

Forward to_host(const Forward& f, const Stream& stream = {}) {
  return {to_cpu(f.output, stream), to_cpu(f.final_state, stream)};
}

Grads to_host(const Grads& g, const Stream& stream = {}) {
  Grads h;
  for (const Tensor& t : g.inputs) h.inputs.push_back(to_cpu(t, stream));
  for (const Tensor& t : g.weights) h.weights.push_back(to_cpu(t, stream));
  if (g.state.defined()) h.state = to_cpu(g.state, stream);
  return h;
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

// EXPECT |actual - expected| <= tol * (max |expected| + |expected|) everywhere and NaN / inf in
// the same places (gradients are sums over many steps whose terms cancel: their error follows the
// tensor's scale). A failure names the worst element: index, both values, the error.
void expect_near(const TensorView& actual, const TensorView& expected, double tol,
                 const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  const std::vector<double> a = test::values(actual), e = test::values(expected);
  double scale = 0;
  for (double v : e)
    if (std::isfinite(v)) scale = std::max(scale, std::fabs(v));
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
      ratio = err / (tol * (scale + std::fabs(e[i])) + 1e-300);
    }
    if (ratio > 1) ++bad;
    if (ratio > worst_ratio || worst < 0) {
      worst_ratio = ratio;
      worst = static_cast<std::int64_t>(i);
    }
  }
  if (bad == 0) return;
  ADD_FAILURE() << what << " " << shape_str(expected.shape()) << ": " << bad << " of " << a.size()
                << " elements off; max abs err " << max_err << " (tol " << tol << " x (scale "
                << scale << " + |expected|)); worst at " << index_str(expected.shape(), worst)
                << ": got " << a[worst] << ", expected " << e[worst];
}

void expect_bitwise(const TensorView& a, const TensorView& b, const std::string& what) {
  EXPECT_TRUE(testing::bitwise_equal(a, b)) << what << " differs bitwise " << shape_str(a.shape());
}

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return 1e-10;
    case DType::F32:
      return 1e-4;  // fp32 state and sums against double ones, through chained steps
    default:
      return testing::default_tolerance(dtype);
  }
}

const char* kGradName[3] = {"candidate", "forget", "reset"};

void expect_grads_near(const Grads& a, const Grads& b, double tol, const std::string& what) {
  for (std::size_t k = 0; k < a.inputs.size(); ++k) {
    expect_near(a.inputs[k], b.inputs[k], tol, what + ": grad input (" + kGradName[k] + ")");
    expect_near(a.weights[k], b.weights[k], tol, what + ": grad weight (" + kGradName[k] + ")");
  }
  ASSERT_EQ(a.state.defined(), b.state.defined());
  if (a.state.defined()) expect_near(a.state, b.state, tol, what + ": grad input_state");
}

void expect_grads_bitwise(const Grads& a, const Grads& b, const std::string& what) {
  for (std::size_t k = 0; k < a.inputs.size(); ++k) {
    expect_bitwise(a.inputs[k], b.inputs[k], what + ": grad input " + kGradName[k]);
    expect_bitwise(a.weights[k], b.weights[k], what + ": grad weight " + kGradName[k]);
  }
  if (a.state.defined()) expect_bitwise(a.state, b.state, what + ": grad input_state");
}

struct Upstream {
  bool dy = true, dhn = true;
  double scale = 1.0;
  std::optional<double> clip{};
};

// cuda against the reference on the CPU, forward and backward; both backwards run at the
// reference's forward output (rounding differences of the forward do not carry over).
void expect_matches_reference(const Problem& p, const std::string& what, Upstream up = {}) {
  SCOPED_TRACE(what);
  const double tol = tolerance(p.dtype());
  Forward ref;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref = forward(p, Device{});
  }
  const Problem gp = on(p, kCuda);
  const Forward gpu = to_host(forward(gp, kCuda));
  expect_near(gpu.output, ref.output, tol, what + ": output");
  expect_near(gpu.final_state, ref.final_state, tol, what + ": final_state");

  const Tensor dy = up.dy ? randn(ref.output.shape(), p.dtype(), 77, up.scale) : Tensor{};
  const Tensor dhn = up.dhn ? randn(ref.final_state.shape(), p.dtype(), 78, up.scale) : Tensor{};
  Grads ref_grads;
  {
    ForceKernelBackend force(KernelBackend::Reference);
    ref_grads = backward(p, ref.output, dy, dhn, up.clip, Device{});
  }
  const Grads gpu_grads =
      to_host(backward(gp, on(ref.output, kCuda), on(dy, kCuda), on(dhn, kCuda), up.clip, kCuda));
  expect_grads_near(gpu_grads, ref_grads, tol, what);
}

std::string describe(bool gru, std::int64_t h, const std::string& more = "") {
  return std::string(gru ? "gru" : "rnn") + " H=" + std::to_string(h) + more;
}

class CudaRecurrentTest : public ::testing::TestWithParam<std::tuple<bool, DType>> {
 protected:
  bool gru() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
};

// H = 64 and 128 take the constant-size kernels, the others the generic one; B = 10 fills one
// group of 8 sequences and part of a second.
TEST_P(CudaRecurrentTest, MatchesTheReferenceOnPaddedInput) {
  MESHFUSE_REQUIRE_CUDA();
  for (std::int64_t h : {64, 128, 1, 7, 33}) {
    const std::int64_t batch = h >= 64 ? 10 : 3;
    expect_matches_reference(make_problem(gru(), dtype(), {batch, 5}, 2, h, 10 + h),
                             describe(gru(), h, " padded B=" + std::to_string(batch)));
  }
}

TEST_P(CudaRecurrentTest, MatchesTheReferenceOnPackedInputWithEmptyAndLengthOneSequences) {
  MESHFUSE_REQUIRE_CUDA();
  // lengths 3, 0, 1, 5, 0, 7 (the second group of 8 is not reached; the last sequence is the
  // longest)
  const std::vector<std::int64_t> cu = {0, 3, 3, 4, 9, 9, 16};
  for (DType index : {DType::I32, DType::I64})
    for (std::int64_t h : {64, 7}) {
      expect_matches_reference(
          make_problem(gru(), dtype(), {16}, 2, h, 20 + h, offsets(cu, index)),
          describe(gru(), h, std::string(" packed, cu_seqlens ") + std::string(to_string(index))));
    }
}

TEST_P(CudaRecurrentTest, BroadcastsTheHeadsOfInputsAndWeights) {
  MESHFUSE_REQUIRE_CUDA();
  // N = 4; each tensor has 1, 2 or 4 heads.
  const Heads cases[] = {{{2, 1, 4}, {1, 4, 2}}, {{1, 4, 2}, {2, 2, 4}}, {{4, 2, 1}, {4, 1, 1}}};
  for (const Heads& c : cases)
    for (std::int64_t h : {64, 7}) {
      std::ostringstream what;
      what << " inputs " << c.inputs[0] << "/" << c.inputs[1] << "/" << c.inputs[2]
           << " heads, weights " << c.weights[0] << "/" << c.weights[1] << "/" << c.weights[2];
      expect_matches_reference(make_problem(gru(), dtype(), {9, 4}, 4, h, 30 + h, {}, true, c),
                               describe(gru(), h, what.str()));
    }
}

TEST_P(CudaRecurrentTest, ClipsTheStateGradientAtEveryStep) {
  MESHFUSE_REQUIRE_CUDA();
  for (double clip : {0.5, 0.0})
    for (std::int64_t h : {64, 7}) {
      expect_matches_reference(make_problem(gru(), dtype(), {3, 6}, 2, h, 40 + h),
                               describe(gru(), h, " clip " + std::to_string(clip)),
                               {.scale = 10.0, .clip = clip});
    }
}

TEST_P(CudaRecurrentTest, TakesEitherUpstreamGradientAloneAndNoInputState) {
  MESHFUSE_REQUIRE_CUDA();
  const Problem with_state = make_problem(gru(), dtype(), {3, 5}, 2, 64, 50);
  const Problem without_state = make_problem(gru(), dtype(), {3, 5}, 2, 64, 50, {}, false);
  expect_matches_reference(with_state, "grad_final_state only", {.dy = false});
  expect_matches_reference(with_state, "grad_output only", {.dhn = false});
  expect_matches_reference(with_state, "no upstream gradient", {.dy = false, .dhn = false});
  expect_matches_reference(without_state, "no input_state");
}

// S = 0, every sequence empty, B = 0: final_state is the input state, grad_input_state the final
// state's gradient, weight gradients are zeros.
TEST_P(CudaRecurrentTest, HandlesBatchesWithoutSteps) {
  MESHFUSE_REQUIRE_CUDA();
  expect_matches_reference(make_problem(gru(), dtype(), {3, 0}, 2, 64, 60), "S = 0");
  expect_matches_reference(make_problem(gru(), dtype(), {0}, 2, 7, 61, offsets({0, 0, 0})),
                           "all sequences empty");
  expect_matches_reference(make_problem(gru(), dtype(), {0}, 2, 7, 62, offsets({0})), "B = 0");
}

TEST_P(CudaRecurrentTest, IsBitwiseDeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  Heads broadcast;  // weight partials of several heads and input gradients of several heads add up
  for (int k = 0; k < 3; ++k) broadcast.inputs[k] = broadcast.weights[k] = 2;
  for (std::int64_t h : {64, 33}) {
    SCOPED_TRACE(describe(gru(), h));
    const Problem p =
        on(make_problem(gru(), dtype(), {16, 9}, 4, h, 70 + h, {}, true, broadcast), kCuda, stream);
    const Forward f1 = forward(p, kCuda, stream), f2 = forward(p, kCuda, stream);
    expect_bitwise(to_cpu(f1.output, stream), to_cpu(f2.output, stream), "output");
    expect_bitwise(to_cpu(f1.final_state, stream), to_cpu(f2.final_state, stream), "final_state");
    const Tensor dy = on(randn(f1.output.shape(), dtype(), 71), kCuda, stream);
    const Tensor dhn = on(randn(f1.final_state.shape(), dtype(), 72), kCuda, stream);
    const Grads g1 = backward(p, f1.output, dy, dhn, 1.0, kCuda, stream),
                g2 = backward(p, f1.output, dy, dhn, 1.0, kCuda, stream);
    expect_grads_bitwise(to_host(g1, stream), to_host(g2, stream), "backward");
  }
}

INSTANTIATE_TEST_SUITE_P(RnnAndGru, CudaRecurrentTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::ValuesIn(test::kFloatDTypes)),
                         [](const ::testing::TestParamInfo<std::tuple<bool, DType>>& info) {
                           return std::string(std::get<0>(info.param) ? "Gru_" : "Rnn_") +
                                  std::string(to_string(std::get<1>(info.param)));
                         });

// A packed batch gives, row for row, bitwise the forward of each sequence run on its own (the
// sequences of a block do not interact).
TEST(CudaRecurrent, PackedForwardIsBitwiseEachSequenceRunAlone) {
  MESHFUSE_REQUIRE_CUDA();
  const std::vector<std::int64_t> cu = {0, 4, 4, 5, 11};
  for (bool gru : {false, true}) {
    SCOPED_TRACE(gru ? "gru" : "rnn");
    const Problem packed = make_problem(gru, DType::BF16, {11}, 2, 64, 80, offsets(cu));
    const Forward all = to_host(forward(on(packed, kCuda), kCuda));
    for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
      const std::int64_t first = cu[b], len = cu[b + 1] - cu[b];
      Problem one;
      one.gru = gru;
      for (int k = 0; k < packed.pairs(); ++k) {
        one.inputs.push_back(Tensor::copy_of(packed.inputs[k].view().narrow(0, first, len)));
        one.weights.push_back(packed.weights[k]);
      }
      one.state = Tensor::copy_of(packed.state.view().narrow(0, b, 1));
      one.cu = offsets({0, len});
      const Forward alone = to_host(forward(on(one, kCuda), kCuda));
      const std::string what = "sequence " + std::to_string(b);
      expect_bitwise(alone.output, all.output.view().narrow(0, first, len), what + " output");
      expect_bitwise(alone.final_state, all.final_state.view().narrow(0, b, 1),
                     what + " final_state");
    }
  }
}

// A NaN input poisons its sequence's state from that step on; +-inf saturates the activation. The
// forward puts NaN and inf where the reference does.
TEST(CudaRecurrent, NanAndInfInputsGiveTheReferencesNonFiniteValues) {
  MESHFUSE_REQUIRE_CUDA();
  for (DType dtype : {DType::F32, DType::BF16})
    for (bool gru : {false, true}) {
      Problem p = make_problem(gru, dtype, {3, 4}, 2, 7, 85);
      const std::pair<Shape, double> poison[] = {
          {{0, 1, 0, 2}, NAN}, {{1, 2, 1, 0}, INFINITY}, {{2, 0, 0, 0}, -INFINITY}};
      for (const auto& [at, value] : poison) {
        TensorView v = p.inputs[0].view();
        for (std::size_t d = 0; d < at.size(); ++d) v = v.narrow(d, at[d], 1);
        copy(test::full({1, 1, 1, 1}, DType::F64, value), v);
      }
      Forward ref;
      {
        ForceKernelBackend force(KernelBackend::Reference);
        ref = forward(p, Device{});
      }
      const Forward gpu = to_host(forward(on(p, kCuda), kCuda));
      const std::string what = describe(gru, 7, std::string(" ") + std::string(to_string(dtype)));
      expect_near(gpu.output, ref.output, tolerance(dtype), what + ": output");
      expect_near(gpu.final_state, ref.final_state, tolerance(dtype), what + ": final_state");
    }
}

// Transposed views (input, weights, state, upstream gradients) give bitwise the results of their
// contiguous copies.
TEST(CudaRecurrent, NonContiguousInputsGiveBitwiseTheSameResults) {
  MESHFUSE_REQUIRE_CUDA();
  for (bool gru : {false, true}) {
    SCOPED_TRACE(gru ? "gru" : "rnn");
    const Problem p = on(make_problem(gru, DType::F32, {3, 5}, 2, 33, 90), kCuda);
    // Storage with two dims swapped; the view swaps them back.
    std::vector<Tensor> storage;
    auto transposed = [&](const Tensor& t, std::int64_t d0, std::int64_t d1) {
      Shape s = t.shape();
      std::swap(s[d0], s[d1]);
      const TensorView v = storage.emplace_back(s, t.dtype(), kCuda).view().transpose(d0, d1);
      copy(t, v);
      EXPECT_FALSE(v.is_contiguous());
      return v;
    };
    std::vector<TensorView> in, w;
    for (int k = 0; k < p.pairs(); ++k) {
      in.push_back(transposed(p.inputs[k], 1, 2));
      w.push_back(transposed(p.weights[k], 1, 2));
    }
    const TensorView state = transposed(p.state, 0, 1);
    const Forward contiguous = forward(p, kCuda);
    Forward strided{Tensor(contiguous.output.shape(), DType::F32, kCuda),
                    Tensor(contiguous.final_state.shape(), DType::F32, kCuda)};
    if (gru)
      meshfuse::gru(params(in, w), state, strided.output, strided.final_state);
    else
      rnn(in[0], w[0], state, strided.output, strided.final_state);
    expect_bitwise(to_cpu(strided.output), to_cpu(contiguous.output), "output");
    expect_bitwise(to_cpu(strided.final_state), to_cpu(contiguous.final_state), "final_state");

    const Tensor dy = on(randn(contiguous.output.shape(), DType::F32, 91), kCuda);
    const Tensor dhn = on(randn(contiguous.final_state.shape(), DType::F32, 92), kCuda);
    const Grads expected = to_host(backward(p, contiguous.output, dy, dhn, {}, kCuda));
    Grads got;
    for (int k = 0; k < p.pairs(); ++k) {
      got.inputs.emplace_back(p.inputs[k].shape(), DType::F32, kCuda);
      got.weights.emplace_back(p.weights[k].shape(), DType::F32, kCuda);
    }
    got.state = Tensor(p.state.shape(), DType::F32, kCuda);
    const TensorView sdy = transposed(dy, 1, 2), sdhn = transposed(dhn, 0, 1),
                     sout = transposed(contiguous.output, 1, 2);
    if (gru) {
      const std::vector<TensorView> gi = views(got.inputs), gw = views(got.weights);
      gru_backward(sdy, sdhn, sout, params(in, w), state, params(gi, gw), got.state);
    } else {
      rnn_backward(sdy, sdhn, sout, w[0], state, got.inputs[0], got.weights[0], got.state);
    }
    expect_grads_bitwise(to_host(got), expected, "backward");
  }
}

// Head sizes whose weights (and, for the GRU's backward, state arrays) do not fit in shared
// memory run from global memory, in several passes over the column pairs.
TEST(CudaRecurrent, HeadSizesBeyondSharedMemoryMatchTheReference) {
  MESHFUSE_REQUIRE_CUDA();
  for (bool gru : {false, true})
    expect_matches_reference(make_problem(gru, DType::F32, {2, 3}, 1, 811, 95), describe(gru, 811));
}

// The reference backend forced on CUDA tensors runs through host copies: bitwise the CPU's.
TEST(CudaRecurrent, ForcedReferenceOnCudaTensorsMatchesTheCpuReference) {
  MESHFUSE_REQUIRE_CUDA();
  for (bool gru : {false, true}) {
    SCOPED_TRACE(gru ? "gru" : "rnn");
    const Problem p = make_problem(gru, DType::BF16, {7}, 2, 7, 96, offsets({0, 2, 7}));
    ForceKernelBackend force(KernelBackend::Reference);
    const Forward cpu = forward(p, Device{});
    const Problem gp = on(p, kCuda);
    const Forward staged = forward(gp, kCuda);
    EXPECT_EQ(staged.output.device(), kCuda);
    expect_bitwise(to_cpu(staged.output), cpu.output, "output");
    expect_bitwise(to_cpu(staged.final_state), cpu.final_state, "final_state");
    const Tensor dy = randn(cpu.output.shape(), DType::BF16, 97);
    const Grads cg = backward(p, cpu.output, dy, {}, 2.0, Device{});
    const Grads sg = backward(gp, on(cpu.output, kCuda), on(dy, kCuda), {}, 2.0, kCuda);
    expect_grads_bitwise(to_host(sg), cg, "backward");
  }
}

// Zeros written on the device: a copy from one zero element broadcast with zero strides.
Tensor cuda_zeros(const Shape& shape, DType dtype) {
  const Tensor zero = Tensor::zeros({1}, dtype, kCuda);
  Tensor t(shape, dtype, kCuda);
  copy(TensorView(zero.data_ptr<char>(), dtype, shape, Shape(shape.size(), 0), kCuda), t);
  return t;
}

// One sequence of S = 32771 steps of 1024 heads of 64: its last rows start past element 2^31
// (4 GiB per bf16 tensor, 16 GiB in all). The inputs are zero but for the last 3 steps, so the
// state is zero until then and the last 3 rows equal a 3-step run (bitwise); zero states add
// nothing to the weight gradient, and the clipped gradient stays finite through the zero steps.
TEST(CudaRecurrent, RowsPastElementTwoToThe31AreAddressedWith64Bits) {
  MESHFUSE_REQUIRE_CUDA();
  constexpr std::int64_t kHeads = 1024, kH = 64, kTail = 3;
  constexpr std::int64_t kSteps = (std::int64_t{1} << 31) / (kHeads * kH) + kTail;
  const Problem small = make_problem(false, DType::BF16, {1, kTail}, kHeads, kH, 98, {}, false,
                                     Heads{{0, 0, 0}, {1, 1, 1}});
  Problem big;
  big.inputs.push_back(cuda_zeros({1, kSteps, kHeads, kH}, DType::BF16));
  big.weights.push_back(on(small.weights[0], kCuda));
  copy(small.inputs[0], big.inputs[0].view().narrow(1, kSteps - kTail, kTail));
  const Problem gsmall = on(small, kCuda);

  const Forward fs = forward(gsmall, kCuda), fb = forward(big, kCuda);
  expect_bitwise(to_cpu(fb.output.view().narrow(1, kSteps - kTail, kTail)), to_cpu(fs.output),
                 "last rows of the output");
  expect_bitwise(to_cpu(fb.final_state), to_cpu(fs.final_state), "final_state");

  const Tensor dy_small = on(randn(fs.output.shape(), DType::BF16, 99), kCuda);
  const Tensor dy = cuda_zeros(fb.output.shape(), DType::BF16);
  copy(dy_small, dy.view().narrow(1, kSteps - kTail, kTail));
  const Grads gs = backward(gsmall, fs.output, dy_small, {}, 1.0, kCuda);
  const Grads gb = backward(big, fb.output, dy, {}, 1.0, kCuda);
  expect_bitwise(to_cpu(gb.inputs[0].view().narrow(1, kSteps - kTail, kTail)), to_cpu(gs.inputs[0]),
                 "last rows of grad_input");
  expect_bitwise(to_cpu(gb.weights[0]), to_cpu(gs.weights[0]), "grad_weight");
}

}  // namespace
}  // namespace meshfuse
