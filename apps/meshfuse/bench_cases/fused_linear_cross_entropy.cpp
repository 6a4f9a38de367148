// fused_linear_cross_entropy: the language-model head, x (rows x hidden) @ weight^T (vocab x
// hidden), and its cross-entropy, in chunks of rows. GEMM-bound (2·N·V·H flops per product), so
// rated in TFLOP/s against the vendor GEMM doing the same products (blas.h).
//
// On the CPU it runs on at most kCpuRows rows (its products are N·V·H multiply-adds: 34 G for 64
// rows of llama-3.2-1b), on CUDA on at most kCudaRows, the size (16384 rows of
// llama-3.1-8b: 8.6 T multiply-adds per product). On CUDA the backward's notes also compare one
// call with the unfused linear -> cross_entropy -> cross_entropy_backward -> linear_backward on the
// same inputs: the peak extra memory of each (the high-water mark of meshfuse's CUDA memory pool
// over the call, inputs and outputs allocated before: the fused op's chunk of logits and
// cuBLASLt's workspace; the unfused (N, V) logits and their gradient) and their time (median of
// kCompareCalls calls each, interleaved, when the case is built), against the targets.
// Inputs: x std-normal, weight normal(0, 1/H) as initialised, so that the logits
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

#include <algorithm>
#include <cmath>
#include <functional>

#include "bench_cases/blas.h"
#include "bench_cases/case.h"
#include "meshfuse/core/memory.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/ops/cross_entropy.h"
#include "meshfuse/ops/gemm.h"

namespace meshfuse::cli {
namespace {

constexpr std::int64_t kCpuRows = 64;
constexpr std::int64_t kCudaRows = 16384;
constexpr std::int64_t kCheckRows = 4;
constexpr std::int64_t kWeightCheckRows = 1024;
constexpr int kCompareCalls = 3;
// The targets for the fused op against the unfused one (fwd + bwd).
constexpr double kMemoryTarget = 0.20, kTimeTarget = 1.15;

// The most bytes of meshfuse's pool that f allocates at once on `device`, beyond what was
// allocated before.
std::int64_t peak_extra_bytes(Device device, const std::function<void()>& f) {
  const Stream stream{device};
  synchronize(stream);
  reset_peak_memory_stats(device);
  const std::int64_t before = device_memory_stats(device).allocated;
  f();
  synchronize(stream);
  return device_memory_stats(device).peak_allocated - before;
}

// Median milliseconds of `calls` calls of each of a and b, interleaved, after one of each.
std::pair<double, double> median_ms(Device device, const std::function<void()>& a,
                                    const std::function<void()>& b, int calls) {
  StreamTimer timer(Stream{device});
  const auto time = [&](const std::function<void()>& f) {
    timer.start();
    f();
    return timer.stop();
  };
  time(a);
  time(b);
  std::vector<double> ta, tb;
  for (int i = 0; i < calls; ++i) {
    ta.push_back(time(a));
    tb.push_back(time(b));
  }
  const auto median = [](std::vector<double>& t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  return {median(ta), median(tb)};
}

std::string gib(std::int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30));
}

std::vector<Direction> fused_linear_cross_entropy_directions(const BenchSetup& s) {
  std::vector<std::string> notes;
  const bool on_cpu = s.device.type == DeviceType::CPU;
  const std::int64_t n = std::min(s.tokens, on_cpu ? kCpuRows : kCudaRows), v = s.model.vocab_size,
                     h = s.model.hidden_size, checked = std::min(n, kCheckRows);
  if (n < s.tokens)
    notes.push_back(fmt::format(
        "runs on {} of the {} tokens ({} multiply-adds per row)", n, s.tokens,
        v * h >= 1'000'000 ? fmt::format("{:.0f} M", v * h / 1e6) : std::to_string(v * h)));
  note_rows_checked(notes, checked, n, "the reference holds the whole logits in double");
  notes.push_back(fmt::format(
      "weight ~ N(0, 1/H); reduction none, loss and its upstream per row in {}; grad_weight "
      "checked from a call on those rows, at their labels' rows and the first {} vocabulary rows",
      to_string(loss_dtype(s)), std::min(v, kWeightCheckRows)));
  const DType ldt = loss_dtype(s);
  const double inv_sqrt_h = 1.0 / std::sqrt(static_cast<double>(h));
  const Tensor x = random_tensor(s, {n, h}, 61),
               weight = random_tensor(s, {v, h}, 62, {}, inv_sqrt_h);
  const Tensor grad_loss = random_tensor(s, {n}, 63, ldt);
  Tensor labels_host({n}, DType::I64);
  testing::fill_uniform_int(labels_host, 64, 0, v);
  std::vector<std::int64_t> weight_rows;  // of grad_weight, compared
  for (std::int64_t r = 0; r < std::min(v, kWeightCheckRows); ++r) weight_rows.push_back(r);
  for (std::int64_t i = 0; i < checked; ++i)
    weight_rows.push_back(labels_host.data_ptr<std::int64_t>()[i]);
  const Tensor labels = labels_host.to(s.device);
  const Tensor loss = output_tensor(s, {n}, ldt), grad_x = output_tensor(s, {n, h}),
               grad_weight = output_tensor(s, {v, h});
  const CrossEntropyOptions options{.reduction = Reduction::None};
  const std::string shape = shape_text({{"x", {n, h}}, {"weight", {v, h}}});
  const Stream stream{s.device};  // ops run on the default stream of the tensors' device
  const double e = static_cast<double>(element_size(s.dtype));
  const double product =
      2.0 * static_cast<double>(n) * static_cast<double>(v) * static_cast<double>(h);
  // Loss: ~log V from sums over H (logits) and V (lse). grad_x = dlogits @ weight: a sum over V
  // whose partial sums are weight rows, ~1/√H. grad_weight = dlogits^T @ x over the rows: ~1 at
  // label rows (where rtol applies), else p·x, with p at most ~100/V for N(0, 1) logits.
  const Tolerance loss_tol = tolerance(ldt, 1.0, v),
                  grad_x_tol = tolerance(s.dtype, inv_sqrt_h, v),
                  grad_weight_tol = tolerance(
                      s.dtype, 100.0 * sqrt_of(checked) / static_cast<double>(v), checked);

  // Our op and the reference on the first `rows` rows, for the check.
  const auto run_rows = [=](std::int64_t rows, const Tensor& loss_out, const Tensor& grad_x_out,
                            const Tensor& grad_weight_out) {
    fused_linear_cross_entropy(first_rows(x, rows), weight, TensorView{}, first_rows(labels, rows),
                               first_rows(grad_loss, rows), loss_out, grad_x_out, grad_weight_out,
                               TensorView{}, options, kFusedLinearCrossEntropyChunkRows, stream);
  };

  // The vendor GEMM's f32 operands (CPU only: on a GPU the yardstick would be cuBLAS).
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
                               TensorView{}, TensorView{}, options,
                               kFusedLinearCrossEntropyChunkRows, stream);
  };
  if (on_cpu)
    forward.blas = [=] {
      vendor_sgemm(false, true, n, v, h, x32.data_ptr<float>(), w32.data_ptr<float>(),
                   logits32.data_ptr<float>());
    };
  forward.check = [=] {
    const Tensor loss_ref = output_tensor(s, {checked}, ldt);
    on_reference([&] {
      fused_linear_cross_entropy(first_rows(x, checked), weight, TensorView{},
                                 first_rows(labels, checked), TensorView{}, loss_ref, TensorView{},
                                 TensorView{}, TensorView{}, options,
                                 kFusedLinearCrossEntropyChunkRows, stream);
    });
    return std::vector{compare_output("loss", first_rows(loss, checked), loss_ref, loss_tol)};
  };

  const auto fused = [=] {
    fused_linear_cross_entropy(x, weight, TensorView{}, labels, grad_loss, loss, grad_x,
                               grad_weight, TensorView{}, options,
                               kFusedLinearCrossEntropyChunkRows, stream);
  };
  std::vector<std::string> backward_notes = notes;
  if (!on_cpu) {
    // The unfused step into the same outputs; its (N, V) tensors are allocated in the call, the
    // logits freed once their gradient is written.
    const auto unfused = [=] {
      Tensor logits = output_tensor(s, {n, v});
      const Tensor lse = output_tensor(s, {n}, s.dtype == DType::F64 ? DType::F64 : DType::F32),
                   dlogits = output_tensor(s, {n, v});
      linear(x, weight, TensorView{}, logits, stream);
      cross_entropy(logits, labels, loss, lse, options, stream);
      cross_entropy_backward(grad_loss, logits, labels, lse, dlogits, options, stream);
      logits = Tensor();
      linear_backward(dlogits, x, weight, grad_x, grad_weight, TensorView{}, stream);
    };
    const std::int64_t fused_bytes = peak_extra_bytes(s.device, fused),
                       unfused_bytes = peak_extra_bytes(s.device, unfused);
    const auto [fused_ms, unfused_ms] = median_ms(s.device, fused, unfused, kCompareCalls);
    const double memory = static_cast<double>(fused_bytes) / static_cast<double>(unfused_bytes),
                 time = fused_ms / unfused_ms;
    backward_notes.push_back(fmt::format(
        "vs unfused linear + cross_entropy fwd + bwd: peak extra memory {} vs {} = {:.1f}% "
        "(target <= {:.0f}%: {}), time {:.1f} vs {:.1f} ms = {:.3f}x (target <= {:.2f}x: {}); "
        "memory: meshfuse pool high-water mark over one call, inputs and outputs excluded; time: "
        "median of {} calls each, interleaved",
        gib(fused_bytes), gib(unfused_bytes), 100 * memory, 100 * kMemoryTarget,
        memory <= kMemoryTarget ? "met" : "NOT met", fused_ms, unfused_ms, time, kTimeTarget,
        time <= kTimeTarget ? "met" : "NOT met", kCompareCalls));
  }

  Direction backward{
      .kernel = "fused_linear_cross_entropy_backward",
      .direction = "backward",
      .shape = shape,
      .flops = 3 * product,
      .formula = "3 x 2·N·V·H (logits, grad_x, grad_weight: loss and gradients in one call)",
      .working_set = (2 * n * h + 2 * v * h) * e,
      .notes = backward_notes};
  backward.run = fused;
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
    const Tensor loss_ref = output_tensor(s, {checked}, ldt),
                 grad_x_ref = output_tensor(s, {checked, h}),
                 grad_weight_ref = output_tensor(s, {v, h});
    on_reference([&] { run_rows(checked, loss_ref, grad_x_ref, grad_weight_ref); });
    const Tensor loss_rows = output_tensor(s, {checked}, ldt),
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
