// rmsnorm and fused_residual_add_rmsnorm at the model's hidden size: x (tokens x hidden_size),
// with the model's weight vector and rms_norm_eps. The reference is cheap (linear in the input),
// so it checks every row.
#include "meshfuse/ops/rmsnorm.h"

#include "bench_cases/case.h"

namespace meshfuse::cli {
namespace {

std::vector<Direction> rmsnorm_directions(const BenchSetup& s) {
  const std::int64_t n = s.tokens, h = s.model.hidden_size;
  const double eps = s.model.rms_norm_eps, e = static_cast<double>(element_size(s.dtype));
  const Tensor x = random_tensor(s, {n, h}, 11), weight = random_tensor(s, {h}, 12);
  const Tensor grad_y = random_tensor(s, {n, h}, 13);
  const Tensor y = output_tensor(s, {n, h}), rstd = output_tensor(s, {n}, DType::F32);
  const Tensor dx = output_tensor(s, {n, h}), dweight = output_tensor(s, {h});
  const std::string shape = shape_text({{"x", {n, h}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  const Tolerance tol = tolerance(s.dtype, 1.0, h);  // rstd sums H squares
  rmsnorm(x, weight, y, rstd, eps, stream);          // the backward's rstd

  Direction forward{.kernel = "rmsnorm",
                    .direction = "forward",
                    .shape = shape,
                    .bytes = 2 * n * h * e + h * e,
                    .formula = "2·N·H·e + H·e (read x, weight; write y; rstd left out)"};
  forward.run = [=] { rmsnorm(x, weight, y, rstd, eps, stream); };
  forward.check = [=] {
    const Tensor y_ref = output_tensor(s, {n, h}), rstd_ref = output_tensor(s, {n}, DType::F32);
    on_reference([&] { rmsnorm(x, weight, y_ref, rstd_ref, eps, stream); });
    return std::vector{compare_output("y", y, y_ref, tol),
                       compare_output("rstd", rstd, rstd_ref, tolerance(DType::F32, 1.0, h))};
  };

  Direction backward{.kernel = "rmsnorm_backward",
                     .direction = "backward",
                     .shape = shape,
                     .bytes = 3 * n * h * e + 2 * h * e,
                     .formula = "3·N·H·e + 2·H·e (read grad_y, x, weight; write dx, dweight)"};
  backward.run = [=] { rmsnorm_backward(grad_y, x, weight, rstd, dx, dweight, stream); };
  backward.check = [=] {
    const Tensor dx_ref = output_tensor(s, {n, h}), dweight_ref = output_tensor(s, {h});
    on_reference([&] { rmsnorm_backward(grad_y, x, weight, rstd, dx_ref, dweight_ref, stream); });
    return std::vector{
        compare_output("dx", dx, dx_ref, tol),
        compare_output("dweight", dweight, dweight_ref, tolerance(s.dtype, sqrt_of(n), n))};
  };
  return {forward, backward};
}

// The pre-norm block of a transformer: r = x + residual, y = rmsnorm(r); the backward gets the
// gradient of y and of the residual stream r.
std::vector<Direction> fused_directions(const BenchSetup& s) {
  const std::int64_t n = s.tokens, h = s.model.hidden_size;
  const double eps = s.model.rms_norm_eps, e = static_cast<double>(element_size(s.dtype));
  const Tensor x = random_tensor(s, {n, h}, 21), residual = random_tensor(s, {n, h}, 22);
  const Tensor weight = random_tensor(s, {h}, 23), grad_y = random_tensor(s, {n, h}, 24),
               grad_r = random_tensor(s, {n, h}, 25);
  const Tensor y = output_tensor(s, {n, h}), r = output_tensor(s, {n, h}),
               rstd = output_tensor(s, {n}, DType::F32);
  const Tensor dx = output_tensor(s, {n, h}), dweight = output_tensor(s, {h});
  const std::string shape = shape_text({{"x, residual", {n, h}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  const Tolerance tol = tolerance(s.dtype, 1.0, h);  // rstd sums H squares
  fused_residual_add_rmsnorm(x, residual, weight, y, r, rstd, eps, 1.0,
                             stream);  // the backward's r, rstd

  Direction forward{
      .kernel = "fused_residual_add_rmsnorm",
      .direction = "forward",
      .shape = shape,
      .bytes = 4 * n * h * e + h * e,
      .formula = "4·N·H·e + H·e (read x, residual, weight; write y, r; rstd left out)"};
  forward.run = [=] {
    fused_residual_add_rmsnorm(x, residual, weight, y, r, rstd, eps, 1.0, stream);
  };
  forward.check = [=] {
    const Tensor y_ref = output_tensor(s, {n, h}), r_ref = output_tensor(s, {n, h}),
                 rstd_ref = output_tensor(s, {n}, DType::F32);
    on_reference([&] {
      fused_residual_add_rmsnorm(x, residual, weight, y_ref, r_ref, rstd_ref, eps, 1.0, stream);
    });
    return std::vector{compare_output("y", y, y_ref, tol), compare_output("r", r, r_ref, tol),
                       compare_output("rstd", rstd, rstd_ref, tolerance(DType::F32, 1.0, h))};
  };

  // The residual's gradient is dx (multiplier 1): dresidual is given as dx itself, as a training
  // step would, so the backward writes it once and moves 4·N·H·e (docs/BENCHMARKING.md).
  Direction backward{.kernel = "fused_residual_add_rmsnorm_backward",
                     .direction = "backward",
                     .shape = shape,
                     .bytes = 4 * n * h * e + 2 * h * e,
                     .formula =
                         "4·N·H·e + 2·H·e (read grad_y, grad_r, r, weight; write dx = dresidual, "
                         "dweight)"};
  backward.run = [=] {
    fused_residual_add_rmsnorm_backward(grad_y, grad_r, r, weight, rstd, dx, dx, dweight, 1.0,
                                        stream);
  };
  backward.check = [=] {
    const Tensor dx_ref = output_tensor(s, {n, h}), dweight_ref = output_tensor(s, {h});
    on_reference([&] {
      fused_residual_add_rmsnorm_backward(grad_y, grad_r, r, weight, rstd, dx_ref, dx_ref,
                                          dweight_ref, 1.0, stream);
    });
    return std::vector{
        compare_output("dx", dx, dx_ref, tol),
        compare_output("dweight", dweight, dweight_ref, tolerance(s.dtype, sqrt_of(n), n))};
  };
  return {forward, backward};
}

}  // namespace

std::vector<BenchCase> rmsnorm_cases() {
  return {{"rmsnorm", "", {"rmsnorm", "rmsnorm_backward"}, rmsnorm_directions},
          {"fused_residual_add_rmsnorm",
           "",
           {"fused_residual_add_rmsnorm", "fused_residual_add_rmsnorm_backward"},
           fused_directions}};
}

}  // namespace meshfuse::cli
