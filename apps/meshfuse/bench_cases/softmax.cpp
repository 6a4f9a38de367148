// softmax over the model's vocabulary: logits (rows x vocab_size), the largest row-wise op of a
// language model.
#include "meshfuse/ops/softmax.h"

#include "bench_cases/case.h"

namespace meshfuse::cli {
namespace {

std::vector<Direction> softmax_directions(const BenchSetup& s) {
  std::vector<std::string> notes;
  const std::int64_t n = vocab_rows(s, notes), v = s.model.vocab_size;
  const std::int64_t checked = std::min(n, kVocabCheckRows);
  note_rows_checked(notes, checked, n, "the reference takes one double exp per value");
  const double e = static_cast<double>(element_size(s.dtype));
  const Tensor x = random_tensor(s, {n, v}, 31), grad_y = random_tensor(s, {n, v}, 32);
  const Tensor y = output_tensor(s, {n, v}), grad_x = output_tensor(s, {n, v});
  // Probabilities and their gradients are ~1/V each, normalised by a sum over V.
  const Tolerance tol = tolerance(s.dtype, 1.0 / static_cast<double>(v), v);
  const std::string shape = shape_text({{"x", {n, v}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  softmax(x, y, 1.0, stream);     // the backward's y

  Direction forward{.kernel = "softmax",
                    .direction = "forward",
                    .shape = shape,
                    .bytes = 2 * n * v * e,
                    .formula = "2·N·V·e (read x; write y)",
                    .notes = notes};
  forward.run = [=] { softmax(x, y, 1.0, stream); };
  forward.check = [=] {
    const Tensor y_ref = output_tensor(s, {checked, v});
    on_reference([&] { softmax(first_rows(x, checked), y_ref, 1.0, stream); });
    return std::vector{compare_output("y", first_rows(y, checked), y_ref, tol)};
  };

  Direction backward{.kernel = "softmax_backward",
                     .direction = "backward",
                     .shape = shape,
                     .bytes = 3 * n * v * e,
                     .formula = "3·N·V·e (read y, grad_y; write grad_x)",
                     .notes = notes};
  backward.run = [=] { softmax_backward(grad_y, y, grad_x, 1.0, stream); };
  backward.check = [=] {
    const Tensor grad_x_ref = output_tensor(s, {checked, v});
    on_reference([&] {
      softmax_backward(first_rows(grad_y, checked), first_rows(y, checked), grad_x_ref, 1.0,
                       stream);
    });
    return std::vector{compare_output("grad_x", first_rows(grad_x, checked), grad_x_ref, tol)};
  };
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> softmax_cases() {
  return {{"softmax", "", {"softmax", "softmax_backward"}, softmax_directions}};
}

}  // namespace meshfuse::cli
