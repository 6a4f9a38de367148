// cross_entropy over the model's vocabulary: logits (rows x vocab_size), labels uniform in
// [0, V). reduction=none, so that each row's loss and gradient stand alone and the first rows can
// be checked by themselves (mean and sum do the same work plus one sum over N values).
#include "meshfuse/ops/cross_entropy.h"

#include <fmt/format.h>

#include "bench_cases/case.h"

namespace meshfuse::cli {
namespace {

std::vector<Direction> cross_entropy_directions(const BenchSetup& s) {
  std::vector<std::string> notes;
  const std::int64_t n = vocab_rows(s, notes), v = s.model.vocab_size;
  const std::int64_t checked = std::min(n, kVocabCheckRows);
  note_rows_checked(notes, checked, n, "the reference takes one double exp per value");
  notes.push_back(fmt::format("cross_entropy: reduction none, labels uniform in [0, V), loss in {}",
                              to_string(loss_dtype(s))));
  const double e = static_cast<double>(element_size(s.dtype));
  const CrossEntropyOptions options{.reduction = Reduction::None};
  const DType ldt = loss_dtype(s);
  const Tensor logits = random_tensor(s, {n, v}, 41), grad_loss = random_tensor(s, {n}, 42, ldt);
  Tensor labels_host({n}, DType::I64);
  testing::fill_uniform_int(labels_host, 43, 0, v);
  const Tensor labels = labels_host.to(s.device);
  const Tensor loss = output_tensor(s, {n}, ldt),
               lse = output_tensor(s, {n}, cross_entropy_lse_dtype(s.dtype));
  const Tensor grad_logits = output_tensor(s, {n, v});
  const std::string shape = shape_text({{"logits", {n, v}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  cross_entropy(logits, labels, loss, lse, options, stream);  // the backward's lse

  Direction forward{.kernel = "cross_entropy",
                    .direction = "forward",
                    .shape = shape,
                    .bytes = n * v * e,
                    .formula = "N·V·e (read logits; loss and lse left out)",
                    .notes = notes};
  forward.run = [=] { cross_entropy(logits, labels, loss, lse, options, stream); };
  forward.check = [=] {
    const Tensor loss_ref = output_tensor(s, {checked}, ldt),
                 lse_ref = output_tensor(s, {checked}, cross_entropy_lse_dtype(s.dtype));
    on_reference([&] {
      cross_entropy(first_rows(logits, checked), first_rows(labels, checked), loss_ref, lse_ref,
                    options, stream);
    });
    return std::vector{
        compare_output("loss", first_rows(loss, checked), loss_ref, tolerance(ldt, 1.0, v)),
        compare_output("lse", first_rows(lse, checked), lse_ref, tolerance(DType::F32, 1.0, v))};
  };

  Direction backward{.kernel = "cross_entropy_backward",
                     .direction = "backward",
                     .shape = shape,
                     .bytes = 2 * n * v * e,
                     .formula = "2·N·V·e (read logits; write grad_logits)",
                     .notes = notes};
  backward.run = [=] {
    cross_entropy_backward(grad_loss, logits, labels, lse, grad_logits, options, stream);
  };
  backward.check = [=] {
    const Tensor grad_logits_ref = output_tensor(s, {checked, v});
    on_reference([&] {
      cross_entropy_backward(first_rows(grad_loss, checked), first_rows(logits, checked),
                             first_rows(labels, checked), first_rows(lse, checked), grad_logits_ref,
                             options, stream);
    });
    // grad_loss * (p - onehot): ~1/V off the label.
    return std::vector{compare_output("grad_logits", first_rows(grad_logits, checked),
                                      grad_logits_ref,
                                      tolerance(s.dtype, 1.0 / static_cast<double>(v), v))};
  };
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> cross_entropy_cases() {
  return {
      {"cross_entropy", "", {"cross_entropy", "cross_entropy_backward"}, cross_entropy_directions}};
}

}  // namespace meshfuse::cli
