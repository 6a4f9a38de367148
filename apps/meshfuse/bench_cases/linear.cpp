// The linears of one transformer layer (no bias, as in LLaMA / Mistral), x (tokens x in) @
// weight^T (out x in):
//   attention: q (heads·head_dim x hidden), k and v (kv_heads·head_dim x hidden),
//              o (hidden x heads·head_dim);
//   MLP:       gate and up (intermediate x hidden), down (hidden x intermediate).
// Rated in TFLOP/s against the vendor GEMM at the same shape (blas.h), timed interleaved with it.
// The reference (double loops) checks the first rows of out and grad_x, and the first rows
// (output features) of grad_weight, which still sum over every token.
#include <cmath>

#include "bench_cases/blas.h"
#include "bench_cases/case.h"
#include "meshfuse/ops/gemm.h"

namespace meshfuse::cli {
namespace {

// Rows of out / grad_x and of grad_weight that the reference recomputes: about 3·16·N·K
// multiply-adds in double per linear.
constexpr std::int64_t kCheckRows = 16;

constexpr const char* kLinears[] = {"q", "k", "v", "o", "gate", "up", "down"};

// (out_features, in_features) of one of kLinears.
std::pair<std::int64_t, std::int64_t> linear_shape(std::string_view name, const ModelConfig& m) {
  const std::int64_t h = m.hidden_size, q = m.num_attention_heads * m.head_dim,
                     kv = m.num_key_value_heads * m.head_dim;
  if (name == "q") return {q, h};
  if (name == "k" || name == "v") return {kv, h};
  if (name == "o") return {h, q};
  if (name == "down") return {h, m.intermediate_size};
  return {m.intermediate_size, h};  // gate, up
}

std::vector<Direction> linear_directions(const BenchSetup& s, std::string_view name) {
  // Not a structured binding: the lambdas below capture n and k, which clang before 16 refuses.
  const std::pair<std::int64_t, std::int64_t> shape = linear_shape(name, s.model);
  const std::int64_t n = shape.first, k = shape.second;
  const std::int64_t t = s.tokens;
  const std::int64_t rows = std::min(t, kCheckRows), features = std::min(n, kCheckRows);
  std::vector<std::string> notes;
  note_rows_checked(notes, rows, t, "the reference is a triple loop in double");
  const Tensor x = random_tensor(s, {t, k}, 51), weight = random_tensor(s, {n, k}, 52);
  const Tensor grad_out = random_tensor(s, {t, n}, 53);
  const Tensor out = output_tensor(s, {t, n}), grad_x = output_tensor(s, {t, k}),
               grad_weight = output_tensor(s, {n, k});
  const std::string text = shape_text({{"x", {t, k}}, {"weight", {n, k}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  const double flops =
      2.0 * static_cast<double>(t) * static_cast<double>(n) * static_cast<double>(k);
  const double e = static_cast<double>(element_size(s.dtype));
  // The vendor GEMM's f32 operands (CPU only: on a GPU the yardstick would be cuBLAS).
  const bool on_cpu = s.device.type == DeviceType::CPU;
  const Tensor x32 = on_cpu ? widened_to_f32(x) : Tensor(),
               w32 = on_cpu ? widened_to_f32(weight) : Tensor();

  Direction forward{.kernel = "linear",
                    .direction = "forward",
                    .shape = text,
                    .flops = flops,
                    .formula = "2·T·N·K",
                    .working_set = (t * k + n * k + t * n) * e,
                    .notes = notes};
  forward.run = [=] { linear(x, weight, TensorView{}, out, stream); };
  if (on_cpu) {
    const Tensor out32({t, n}, DType::F32);
    forward.blas = [=] {
      vendor_sgemm(false, true, t, n, k, x32.data_ptr<float>(), w32.data_ptr<float>(),
                   out32.data_ptr<float>());
    };
  }
  forward.check = [=] {
    const Tensor out_ref = output_tensor(s, {rows, n});
    on_reference([&] { linear(first_rows(x, rows), weight, TensorView{}, out_ref, stream); });
    return std::vector{
        compare_output("out", first_rows(out, rows), out_ref, tolerance(s.dtype, sqrt_of(k), k))};
  };

  Direction backward{
      .kernel = "linear_backward",
      .direction = "backward",
      .shape = text,
      .flops = 2 * flops,
      .formula = "2 x 2·T·N·K (grad_x = grad_out @ weight, grad_weight = grad_out^T @ x)",
      .working_set = (2 * t * k + 2 * n * k + t * n) * e,
      .notes = notes};
  backward.run = [=] {
    linear_backward(grad_out, x, weight, grad_x, grad_weight, TensorView{}, stream);
  };
  if (on_cpu) {
    const Tensor dy32 = widened_to_f32(grad_out), dx32({t, k}, DType::F32),
                 dw32({n, k}, DType::F32);
    backward.blas = [=] {
      vendor_sgemm(false, false, t, k, n, dy32.data_ptr<float>(), w32.data_ptr<float>(),
                   dx32.data_ptr<float>());
      vendor_sgemm(true, false, n, k, t, dy32.data_ptr<float>(), x32.data_ptr<float>(),
                   dw32.data_ptr<float>());
    };
  }
  backward.check = [=] {
    const Tensor grad_x_ref = output_tensor(s, {rows, k}),
                 grad_weight_ref = output_tensor(s, {features, k});
    on_reference([&] {
      linear_backward(first_rows(grad_out, rows), first_rows(x, rows), weight, grad_x_ref,
                      TensorView{}, TensorView{}, stream);
      // grad_weight[0:features] = grad_out[:, 0:features]^T @ x, over every token.
      gemm(grad_out.view().narrow(1, 0, features), x, TensorView{}, grad_weight_ref,
           {.transpose_a = true}, stream);
    });
    return std::vector{compare_output("grad_x", first_rows(grad_x, rows), grad_x_ref,
                                      tolerance(s.dtype, sqrt_of(n), n)),
                       compare_output("grad_weight", first_rows(grad_weight, features),
                                      grad_weight_ref, tolerance(s.dtype, sqrt_of(t), t))};
  };
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> linear_cases() {
  std::vector<BenchCase> cases;
  for (const char* name : kLinears)
    cases.push_back({std::string("linear_") + name,
                     "linear",
                     {"linear", "linear_backward"},
                     [name](const BenchSetup& s) { return linear_directions(s, name); }});
  return cases;
}

}  // namespace meshfuse::cli
