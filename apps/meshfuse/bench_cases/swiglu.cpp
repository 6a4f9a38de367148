// swiglu at the model's MLP width: gate and up (tokens x intermediate_size).
#include "meshfuse/ops/swiglu.h"

#include "bench_cases/case.h"

namespace meshfuse::cli {
namespace {

std::vector<Direction> swiglu_directions(const BenchSetup& s) {
  const std::int64_t n = s.tokens, i = s.model.intermediate_size;
  const double e = static_cast<double>(element_size(s.dtype));
  const Tensor gate = random_tensor(s, {n, i}, 1), up = random_tensor(s, {n, i}, 2);
  const Tensor grad_out = random_tensor(s, {n, i}, 3);
  const Tensor out = output_tensor(s, {n, i}), grad_gate = output_tensor(s, {n, i}),
               grad_up = output_tensor(s, {n, i});
  const Tolerance tol = tolerance(s.dtype);
  const std::string shape = shape_text({{"gate, up", {n, i}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device

  // Elementwise: the reference is cheap, so it checks every row.
  Direction forward{.kernel = "swiglu",
                    .direction = "forward",
                    .shape = shape,
                    .bytes = 3 * n * i * e,
                    .formula = "3·N·I·e (read gate, up; write out)"};
  forward.run = [=] { swiglu(gate, up, out, stream); };
  forward.check = [=] {
    const Tensor expected = output_tensor(s, {n, i});
    on_reference([&] { swiglu(gate, up, expected, stream); });
    return std::vector{compare_output("out", out, expected, tol)};
  };

  Direction backward{.kernel = "swiglu_backward",
                     .direction = "backward",
                     .shape = shape,
                     .bytes = 5 * n * i * e,
                     .formula = "5·N·I·e (read grad_out, gate, up; write grad_gate, grad_up)"};
  backward.run = [=] { swiglu_backward(grad_out, gate, up, grad_gate, grad_up, stream); };
  backward.check = [=] {
    const Tensor expected_gate = output_tensor(s, {n, i}), expected_up = output_tensor(s, {n, i});
    on_reference([&] { swiglu_backward(grad_out, gate, up, expected_gate, expected_up, stream); });
    return std::vector{compare_output("grad_gate", grad_gate, expected_gate, tol),
                       compare_output("grad_up", grad_up, expected_up, tol)};
  };
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> swiglu_cases() {
  return {{"swiglu", "", {"swiglu", "swiglu_backward"}, swiglu_directions}};
}

}  // namespace meshfuse::cli
