// fused_linear_cross_entropy: the language-model head, x (rows x hidden) @ weight^T (vocab x
// hidden), and its cross-entropy, in chunks of rows. GEMM-bound (2·N·V·H flops per product), so
// rated in TFLOP/s against the vendor GEMM doing the same products (blas.h).
//
// It runs on at most kRows rows (its products are N·V·H multiply-adds: 34 G for 64 rows of
// llama-3.2-1b). Inputs: x std-normal, weight normal(0, 1/H) as initialised, so that the logits
// are ~N(0, 1) and the softmax spreads over the vocabulary like a model's; reduction none with a
// random upstream per row, so that rows can be checked on their own.
//
// Check: the reference computes the unfused composition in double over the whole (rows, V)
// logits, so it runs on the first kCheckRows rows; loss and grad_x rows of the timed call are
// compared with it, and grad_weight (a sum over all rows) from our call on those same rows, on
// the label rows (where it is largest) and the first kWeightCheckRows vocabulary rows: comparing
// all V x H values would take longer than the reference itself.
#include "meshfuse/ops/fused_linear_cross_entropy.h"

#include <fmt/format.h>

#include <cmath>

#include "bench_cases/blas.h"
#include "bench_cases/case.h"

namespace meshfuse::cli {
namespace {

constexpr std::int64_t kRows = 64;
constexpr std::int64_t kCheckRows = 4;
constexpr std::int64_t kWeightCheckRows = 1024;

std::vector<Direction> fused_linear_cross_entropy_directions(const BenchSetup& s) {
  std::vector<std::string> notes;
  const std::int64_t n = std::min(s.tokens, kRows), v = s.model.vocab_size, h = s.model.hidden_size,
                     checked = std::min(n, kCheckRows);
  if (n < s.tokens)
    notes.push_back(fmt::format("runs on {} of the {} tokens ({:.0f} M multiply-adds per row)", n,
                                s.tokens, static_cast<double>(v * h) / 1e6));
  note_rows_checked(notes, checked, n, "the reference holds the whole logits in double");
  notes.push_back(fmt::format(
      "weight ~ N(0, 1/H); reduction none, a random upstream per row; grad_weight checked from a "
      "call on those rows, at their labels' rows and the first {} vocabulary rows",
      std::min(v, kWeightCheckRows)));
  const double inv_sqrt_h = 1.0 / std::sqrt(static_cast<double>(h));
  const Tensor x = random_tensor(s, {n, h}, 61),
               weight = random_tensor(s, {v, h}, 62, {}, inv_sqrt_h);
  const Tensor grad_loss = random_tensor(s, {n}, 63);
  Tensor labels_host({n}, DType::I64);
  testing::fill_uniform_int(labels_host, 64, 0, v);
  std::vector<std::int64_t> weight_rows;  // of grad_weight, compared
  for (std::int64_t r = 0; r < std::min(v, kWeightCheckRows); ++r) weight_rows.push_back(r);
  for (std::int64_t i = 0; i < checked; ++i)
    weight_rows.push_back(labels_host.data_ptr<std::int64_t>()[i]);
  const Tensor labels = labels_host.to(s.device);
  const Tensor loss = output_tensor(s, {n}), grad_x = output_tensor(s, {n, h}),
               grad_weight = output_tensor(s, {v, h});
  const CrossEntropyOptions options{.reduction = Reduction::None};
  const std::string shape = shape_text({{"x", {n, h}}, {"weight", {v, h}}});
  const double e = static_cast<double>(element_size(s.dtype));
  const double product =
      2.0 * static_cast<double>(n) * static_cast<double>(v) * static_cast<double>(h);
  // Loss: ~log V from sums over H (logits) and V (lse). grad_x = dlogits @ weight: a sum over V
  // whose partial sums are weight rows, ~1/√H. grad_weight = dlogits^T @ x over the rows: ~1 at
  // label rows (where rtol applies), else p·x, with p at most ~100/V for N(0, 1) logits.
  const Tolerance loss_tol = tolerance(s.dtype, 1.0, v),
                  grad_x_tol = tolerance(s.dtype, inv_sqrt_h, v),
                  grad_weight_tol = tolerance(
                      s.dtype, 100.0 * sqrt_of(checked) / static_cast<double>(v), checked);

  // Our op and the reference on the first `rows` rows, for the check.
  const auto run_rows = [=](std::int64_t rows, const Tensor& loss_out, const Tensor& grad_x_out,
                            const Tensor& grad_weight_out) {
    fused_linear_cross_entropy(first_rows(x, rows), weight, TensorView{}, first_rows(labels, rows),
                               first_rows(grad_loss, rows), loss_out, grad_x_out, grad_weight_out,
                               TensorView{}, options);
  };

  // The vendor GEMM's f32 operands (CPU only: on a GPU the yardstick would be cuBLAS).
  const bool on_cpu = s.device.type == DeviceType::CPU;
  const Tensor x32 = on_cpu ? widened_to_f32(x) : Tensor();
  const Tensor w32 = on_cpu ? widened_to_f32(weight) : Tensor();
  const Tensor logits32 = on_cpu ? Tensor({n, v}, DType::F32) : Tensor();

  Direction forward{.kernel = "fused_linear_cross_entropy",
                    .direction = "forward",
                    .shape = shape,
                    .flops = product,
                    .formula = "2·N·V·H (the logits; loss only, no gradient outputs)",
                    .working_set = (n * h + v * h) * e,
                    .notes = notes};
  forward.run = [=] {
    fused_linear_cross_entropy(x, weight, TensorView{}, labels, TensorView{}, loss, TensorView{},
                               TensorView{}, TensorView{}, options);
  };
  if (on_cpu)
    forward.blas = [=] {
      vendor_sgemm(false, true, n, v, h, x32.data_ptr<float>(), w32.data_ptr<float>(),
                   logits32.data_ptr<float>());
    };
  forward.check = [=] {
    const Tensor loss_ref = output_tensor(s, {checked});
    on_reference([&] {
      fused_linear_cross_entropy(first_rows(x, checked), weight, TensorView{},
                                 first_rows(labels, checked), TensorView{}, loss_ref, TensorView{},
                                 TensorView{}, TensorView{}, options);
    });
    return std::vector{compare_output("loss", first_rows(loss, checked), loss_ref, loss_tol)};
  };

  Direction backward{
      .kernel = "fused_linear_cross_entropy_backward",
      .direction = "backward",
      .shape = shape,
      .flops = 3 * product,
      .formula = "3 x 2·N·V·H (logits, grad_x, grad_weight: loss and gradients in one call)",
      .working_set = (2 * n * h + 2 * v * h) * e,
      .notes = notes};
  backward.run = [=] {
    fused_linear_cross_entropy(x, weight, TensorView{}, labels, grad_loss, loss, grad_x,
                               grad_weight, TensorView{}, options);
  };
  if (on_cpu) {
    const Tensor dx32({n, h}, DType::F32), dw32({v, h}, DType::F32);
    backward.blas = [=] {
      float* logits = logits32.data_ptr<float>();
      vendor_sgemm(false, true, n, v, h, x32.data_ptr<float>(), w32.data_ptr<float>(), logits);
      vendor_sgemm(false, false, n, h, v, logits, w32.data_ptr<float>(), dx32.data_ptr<float>());
      vendor_sgemm(true, false, v, h, n, logits, x32.data_ptr<float>(), dw32.data_ptr<float>());
    };
  }
  backward.check = [=] {
    const Tensor loss_ref = output_tensor(s, {checked}),
                 grad_x_ref = output_tensor(s, {checked, h}),
                 grad_weight_ref = output_tensor(s, {v, h});
    on_reference([&] { run_rows(checked, loss_ref, grad_x_ref, grad_weight_ref); });
    const Tensor loss_rows = output_tensor(s, {checked}),
                 grad_x_rows = output_tensor(s, {checked, h}),
                 grad_weight_rows = output_tensor(s, {v, h});
    run_rows(checked, loss_rows, grad_x_rows, grad_weight_rows);
    return std::vector{
        compare_output("loss", first_rows(loss, checked), loss_ref, loss_tol),
        compare_output("grad_x", first_rows(grad_x, checked), grad_x_ref, grad_x_tol),
        compare_output("grad_weight", grad_weight_rows, grad_weight_ref, grad_weight_tol,
                       weight_rows)};
  };
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> fused_linear_cross_entropy_cases() {
  return {{"fused_linear_cross_entropy",
           "",
           {"fused_linear_cross_entropy", "fused_linear_cross_entropy_backward"},
           fused_linear_cross_entropy_directions}};
}

}  // namespace meshfuse::cli
