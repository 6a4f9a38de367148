#include "bench_cases/case.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "meshfuse/core/error.h"

namespace meshfuse::cli {
namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Std-normal values by Box-Muller from a counter-based hash of (seed, index): deterministic per
// seed whatever the thread count, and parallel. testing::fill_normal draws from one sequential
// mt19937 stream, which takes seconds for the 10^8-element tensors of the vocabulary ops.
template <typename T>
void fill_normal_parallel(T* p, std::int64_t n, std::uint64_t seed, double std) {
  const std::uint64_t key = splitmix64(seed);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; i += 2) {
    const std::uint64_t a = splitmix64(key ^ static_cast<std::uint64_t>(i)), b = splitmix64(a);
    const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1p-53;  // (0, 1]
    const double u2 = static_cast<double>(b >> 11) * 0x1p-53;
    const double r = std * std::sqrt(-2.0 * std::log(u1)), theta = 2.0 * std::numbers::pi * u2;
    p[i] = from_double<T>(r * std::cos(theta));
    if (i + 1 < n) p[i + 1] = from_double<T>(r * std::sin(theta));
  }
}

}  // namespace

// The spacing of the dtype's subnormals: below the normal range a value keeps only this absolute
// precision (f16 probabilities of a 128k vocabulary are subnormal).
double subnormal_step(DType dtype) {
  switch (dtype) {
    case DType::F16:
      return 0x1p-24;
    case DType::BF16:
      return 0x1p-133;
    case DType::F32:
      return 0x1p-149;
    default:
      return 0.0;
  }
}

Tolerance tolerance(DType dtype, double magnitude, std::int64_t terms) {
  const double tol = testing::default_tolerance(dtype);
  const double accumulation = 4 * 0x1p-24 * sqrt_of(terms);
  return {std::max(magnitude * std::max(tol, accumulation), 4 * subnormal_step(dtype)), tol};
}

double sqrt_of(std::int64_t k) {
  return std::sqrt(static_cast<double>(std::max<std::int64_t>(k, 1)));
}

namespace {

// A copy of t in CPU memory (testing::compare reads CPU memory).
Tensor on_host(const TensorView& t) {
  Tensor host(t.shape(), t.dtype());
  copy(t, host);
  return host;
}

}  // namespace

Comparison compare_output(std::string name, const TensorView& actual, const TensorView& expected,
                          Tolerance tol) {
  if (actual.device().type != DeviceType::CPU || expected.device().type != DeviceType::CPU)
    return compare_output(std::move(name), on_host(actual), on_host(expected), tol);
  return {std::move(name), testing::compare(actual, expected, tol.atol, tol.rtol), tol};
}

Tensor random_tensor(const BenchSetup& setup, Shape shape, std::uint64_t seed,
                     std::optional<DType> dtype, double std) {
  Tensor host(std::move(shape), dtype.value_or(setup.dtype));
  switch (host.dtype()) {
    case DType::F32:
      fill_normal_parallel(host.data_ptr<float>(), host.numel(), seed, std);
      break;
    case DType::F64:
      fill_normal_parallel(host.data_ptr<double>(), host.numel(), seed, std);
      break;
    case DType::BF16:
      fill_normal_parallel(host.data_ptr<bfloat16>(), host.numel(), seed, std);
      break;
    case DType::F16:
      fill_normal_parallel(host.data_ptr<float16>(), host.numel(), seed, std);
      break;
    default:
      testing::fill_normal(host, seed, 0.0, std);  // raises the error for a non-float dtype
  }
  if (setup.device.type == DeviceType::CPU) return host;
  Tensor on_device(host.shape(), host.dtype(), setup.device);
  copy(host, on_device);
  return on_device;
}

Tensor widened_to_f32(const Tensor& t) {
  MESHFUSE_CHECK(t.device().type == DeviceType::CPU, ErrorCode::Unsupported,
                 "bench: the vendor GEMM's operands are widened on the CPU, got {}",
                 t.view().str());
  Tensor out(t.shape(), DType::F32);
  float* dst = out.data_ptr<float>();
  const std::int64_t n = t.numel();
  const auto widen = [&](const auto* src) {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  };
  switch (t.dtype()) {
    case DType::F32:
      widen(t.data_ptr<float>());
      break;
    case DType::BF16:
      widen(t.data_ptr<bfloat16>());
      break;
    case DType::F16:
      widen(t.data_ptr<float16>());
      break;
    default:
      copy(t, out);
  }
  return out;
}

Tensor output_tensor(const BenchSetup& setup, Shape shape, std::optional<DType> dtype) {
  return Tensor(std::move(shape), dtype.value_or(setup.dtype), setup.device);
}

Comparison compare_output(std::string name, const TensorView& actual, const TensorView& expected,
                          Tolerance tol, const std::vector<std::int64_t>& rows) {
  Comparison all{name, {}, tol};
  for (const std::int64_t row : rows) {
    const testing::Diff d =
        compare_output(name, actual.narrow(0, row, 1), expected.narrow(0, row, 1), tol).diff;
    all.diff.max_abs_err = std::max(all.diff.max_abs_err, d.max_abs_err);
    all.diff.max_rel_err = std::max(all.diff.max_rel_err, d.max_rel_err);
    all.diff.mismatched_nonfinite += d.mismatched_nonfinite;
    all.diff.violations += d.violations;
  }
  return all;
}

TensorView first_rows(const TensorView& t, std::int64_t rows) { return t.narrow(0, 0, rows); }

void on_reference(const std::function<void()>& f) {
  const ForceKernelBackend reference(KernelBackend::Reference);
  f();
}

std::string shape_text(const std::vector<std::pair<std::string, Shape>>& parts) {
  std::string out;
  for (const auto& [name, shape] : parts)
    out += fmt::format("{}{}: {}", out.empty() ? "" : ", ", name, shape_str(shape));
  return out;
}

void note_rows_checked(std::vector<std::string>& notes, std::int64_t checked, std::int64_t rows,
                       std::string_view why) {
  if (checked < rows)
    notes.push_back(
        fmt::format("reference checked on the first {} of {} rows ({})", checked, rows, why));
}

std::int64_t vocab_rows(const BenchSetup& setup, std::vector<std::string>& notes) {
  if (setup.tokens <= kMaxVocabRows || setup.device.type == DeviceType::CUDA) return setup.tokens;
  notes.push_back(fmt::format("vocabulary ops run on {} of the {} tokens (memory and time)",
                              kMaxVocabRows, setup.tokens));
  return kMaxVocabRows;
}

}  // namespace meshfuse::cli
