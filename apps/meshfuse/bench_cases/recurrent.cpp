// rnn and gru at the sizes, not the model's: B = 16 sequences of S steps, N = 64 heads of
// H = 64, with an input state and both upstream gradients. S = 4096 on a GPU; 1024 on the CPU,
// where a 4096-step GRU backward would take seconds per call. Outside a transformer layer: run
// only when --ops names them.
#include "meshfuse/ops/recurrent.h"

#include <fmt/format.h>

#include "bench_cases/case.h"

namespace meshfuse::cli {
namespace {

constexpr std::int64_t kBatch = 16, kHeads = 64, kHeadDim = 64;
// The reference (one double step at a time) checks sequence 0 and its first kCheckHeads heads:
// the recurrence cannot be checked on a subset of its steps, but sequences and heads are
// independent.
constexpr std::int64_t kCheckHeads = 4;

std::int64_t seq_len(const BenchSetup& s) {
  if (s.seq_len > 0) return s.seq_len;
  return s.device.type == DeviceType::CPU ? 1024 : 4096;
}

// The tensors of one call: pairs() (input, weight) pairs, the input state, the outputs and the
// upstream gradients.
struct Problem {
  bool gru = false;
  std::vector<Tensor> inputs, weights, grad_inputs, grad_weights;
  Tensor state, output, final_state, grad_output, grad_final_state, grad_state;
  int pairs() const { return gru ? 3 : 1; }
};

GruParams params(const std::vector<Tensor>& in, const std::vector<Tensor>& w) {
  return {in[0], w[0], in[1], w[1], in[2], w[2]};
}

void run_forward(const Problem& p) {
  const Stream stream{p.output.device()};
  if (p.gru)
    gru(params(p.inputs, p.weights), p.state, p.output, p.final_state, {}, -1, stream);
  else
    rnn(p.inputs[0], p.weights[0], p.state, p.output, p.final_state, {}, -1, stream);
}

void run_backward(const Problem& p) {
  const Stream stream{p.output.device()};
  if (p.gru)
    gru_backward(p.grad_output, p.grad_final_state, p.output, params(p.inputs, p.weights), p.state,
                 params(p.grad_inputs, p.grad_weights), p.grad_state, {}, {}, -1, stream);
  else
    rnn_backward(p.grad_output, p.grad_final_state, p.output, p.weights[0], p.state,
                 p.grad_inputs[0], p.grad_weights[0], p.grad_state, {}, {}, -1, stream);
}

Problem make_problem(const BenchSetup& s, bool gru) {
  const std::int64_t b = kBatch, t = seq_len(s), n = kHeads, h = kHeadDim;
  Problem p;
  p.gru = gru;
  for (int k = 0; k < p.pairs(); ++k) {
    p.inputs.push_back(random_tensor(s, {b, t, n, h}, 10 * k + 1));
    // std 1/sqrt(H): the state neither dies out nor saturates over the steps.
    p.weights.push_back(random_tensor(s, {n, h, h}, 10 * k + 2, {}, 1.0 / std::sqrt(double(h))));
    p.grad_inputs.push_back(output_tensor(s, {b, t, n, h}));
    p.grad_weights.push_back(output_tensor(s, {n, h, h}));
  }
  p.state = random_tensor(s, {b, n, h}, 100, {}, 0.5);
  p.output = output_tensor(s, {b, t, n, h});
  p.final_state = output_tensor(s, {b, n, h});
  p.grad_output = random_tensor(s, {b, t, n, h}, 101);
  p.grad_final_state = random_tensor(s, {b, n, h}, 102);
  p.grad_state = output_tensor(s, {b, n, h});
  run_forward(p);  // the backward's output, also when only the backward is timed
  return p;
}

// Sequence 0, heads [0, kCheckHeads) of a (B, S, N, H) or (B, N, H) tensor; heads [0,
// kCheckHeads) of a weight (N, H, H). A contiguous copy on the same device.
Tensor token_part(const TensorView& t) {
  return Tensor::copy_of(t.narrow(0, 0, 1).narrow(t.dim() - 2, 0, kCheckHeads));
}
Tensor weight_part(const TensorView& t) { return Tensor::copy_of(t.narrow(0, 0, kCheckHeads)); }

// The same part of the problem as a problem of its own (1 sequence, kCheckHeads heads), run
// forward and backward on the current backend.
Problem part_of(const BenchSetup& s, const Problem& p) {
  Problem q;
  q.gru = p.gru;
  for (int k = 0; k < p.pairs(); ++k) {
    q.inputs.push_back(token_part(p.inputs[k]));
    q.weights.push_back(weight_part(p.weights[k]));
    q.grad_inputs.push_back(output_tensor(s, q.inputs[k].shape()));
    q.grad_weights.push_back(output_tensor(s, q.weights[k].shape()));
  }
  q.state = token_part(p.state);
  q.output = output_tensor(s, token_part(p.output).shape());
  q.final_state = output_tensor(s, q.state.shape());
  q.grad_output = token_part(p.grad_output);
  q.grad_final_state = token_part(p.grad_final_state);
  q.grad_state = output_tensor(s, q.state.shape());
  return q;
}

std::vector<Direction> directions(const BenchSetup& s, bool gru) {
  const std::string op = gru ? "gru" : "rnn";
  const Problem p = make_problem(s, gru);
  const std::int64_t b = kBatch, t = seq_len(s), n = kHeads, h = kHeadDim;
  const double e = static_cast<double>(element_size(s.dtype));
  const double tokens = double(b * t * n * h) * e, weights = double(n * h * h) * e,
               states = double(b * n * h) * e;
  const int pairs = p.pairs();
  const std::string shape = fmt::format("B={} S={} N={} H={}{}", b, t, n, h,
                                        gru ? " (input, forget_input, reset_input)" : "");
  // The state enters tanh (and the gates' sigmoids) after a sum of H products of size ~1/sqrt(H);
  // the tolerance allows for the fp32 state's difference to the reference's double one.
  const Tolerance tol = tolerance(s.dtype, 1.0, h);
  const std::string checked = fmt::format(
      "reference checked on sequence 0, heads 0-{} of {} x {} (sequences and heads are "
      "independent; the recurrence cannot be checked on fewer steps)",
      kCheckHeads - 1, b, n);

  Direction forward{.kernel = op,
                    .direction = "forward",
                    .shape = shape,
                    .bytes = (pairs + 1) * tokens + pairs * weights + 2 * states,
                    .formula = fmt::format(
                        "{}·B·S·N·H·e + {}N·H²·e + 2·B·N·H·e (read the input{}, write the output; "
                        "weights once; read input_state, write final_state)",
                        pairs + 1, pairs == 1 ? "" : "3·", pairs == 1 ? "" : "s")};
  forward.steps = t;
  forward.run = [=] { run_forward(p); };
  forward.check = [=] {
    Problem expected = part_of(s, p);
    on_reference([&] { run_forward(expected); });
    return std::vector{
        compare_output("output", token_part(p.output), expected.output, tol),
        compare_output("final_state", token_part(p.final_state), expected.final_state, tol)};
  };
  forward.notes.push_back(checked);

  // Read grad_output, output and (GRU) the 3 inputs; write the input gradients; weights read and
  // their gradients written once; read input_state and grad_final_state, write grad_input_state.
  Direction backward{
      .kernel = op + "_backward",
      .direction = "backward",
      .shape = shape,
      .bytes = (gru ? 8 : 3) * tokens + 2 * pairs * weights + 3 * states,
      .formula = fmt::format(
          "{}·B·S·N·H·e + {}·N·H²·e + 3·B·N·H·e (read grad_output, output{}; write the input "
          "gradient{}; weights read and their gradients written once; read input_state, "
          "grad_final_state, write grad_input_state)",
          gru ? 8 : 3, 2 * pairs, gru ? ", the 3 inputs" : "", gru ? "s" : "")};
  backward.steps = t;
  backward.run = [=] { run_backward(p); };
  backward.check = [=] {
    // Input and state gradients of the part come from the timed call itself; the weight
    // gradients sum over all sequences and heads, so the part's are compared run on its own.
    Problem ours = part_of(s, p), expected = part_of(s, p);
    copy(token_part(p.output), ours.output);
    copy(ours.output, expected.output);
    run_backward(ours);
    on_reference([&] { run_backward(expected); });
    std::vector<Comparison> c;
    const Tolerance grad_tol = tolerance(s.dtype, sqrt_of(t), t * h);
    for (int k = 0; k < pairs; ++k) {
      c.push_back(compare_output(fmt::format("grad input {}", k), token_part(p.grad_inputs[k]),
                                 expected.grad_inputs[k], grad_tol));
      c.push_back(compare_output(fmt::format("grad weight {} (part)", k), ours.grad_weights[k],
                                 expected.grad_weights[k], grad_tol));
    }
    c.push_back(compare_output("grad_input_state", token_part(p.grad_state), expected.grad_state,
                               grad_tol));
    return c;
  };
  backward.notes.push_back(checked);
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> recurrent_cases() {
  const auto rnn_directions = [](const BenchSetup& s) { return directions(s, false); };
  const auto gru_directions = [](const BenchSetup& s) { return directions(s, true); };
  return {{"rnn", "recurrent", {"rnn", "rnn_backward"}, rnn_directions, false},
          {"gru", "recurrent", {"gru", "gru_backward"}, gru_directions, false}};
}

}  // namespace meshfuse::cli
