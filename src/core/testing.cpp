#include "meshfuse/testing.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "meshfuse/core/error.h"

namespace meshfuse::testing {
namespace {

// Values of a CPU tensor as doubles, row-major.
std::vector<double> values(const TensorView& t) {
  Tensor f64(t.shape(), DType::F64);
  copy(t, f64);
  const double* p = f64.data_ptr<double>();
  return {p, p + f64.numel()};
}

void check_cpu(std::string_view what, const TensorView& t) {
  MESHFUSE_CHECK(t.device().type == DeviceType::CPU, ErrorCode::Unsupported,
                 "{}: needs a CPU tensor, got {}", what, t.str());
}

}  // namespace

void fill_normal(const TensorView& t, std::uint64_t seed, double mean, double std) {
  check_cpu("fill_normal", t);
  MESHFUSE_CHECK(is_floating_point(t.dtype()), ErrorCode::DTypeMismatch,
                 "fill_normal: needs a floating tensor, got {}", t.str());
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(mean, std);
  Tensor tmp(t.shape(), DType::F64);
  double* p = tmp.data_ptr<double>();
  for (std::int64_t i = 0; i < tmp.numel(); ++i) p[i] = dist(rng);
  copy(tmp, t);
}

void fill_uniform_int(const TensorView& t, std::uint64_t seed, std::int64_t low,
                      std::int64_t high) {
  check_cpu("fill_uniform_int", t);
  MESHFUSE_CHECK(t.dtype() == DType::I32 || t.dtype() == DType::I64, ErrorCode::DTypeMismatch,
                 "fill_uniform_int: needs an i32 or i64 tensor, got {}", t.str());
  MESHFUSE_CHECK(low < high, ErrorCode::InvalidArgument,
                 "fill_uniform_int: needs low < high, got [{}, {})", low, high);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> dist(low, high - 1);
  Tensor tmp(t.shape(), DType::I64);
  std::int64_t* p = tmp.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < tmp.numel(); ++i) p[i] = dist(rng);
  copy(tmp, t);
}

Diff compare(const TensorView& actual, const TensorView& expected, double atol, double rtol) {
  check_cpu("compare", actual);
  check_cpu("compare", expected);
  MESHFUSE_CHECK(actual.shape() == expected.shape(), ErrorCode::ShapeMismatch,
                 "compare: actual {} and expected {} differ in shape", actual.str(),
                 expected.str());
  const std::vector<double> a = values(actual), e = values(expected);
  Diff d;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(e[i])) {
      const bool same = (std::isnan(a[i]) && std::isnan(e[i])) || a[i] == e[i];
      if (!same) {
        ++d.mismatched_nonfinite;
        ++d.violations;
      }
      continue;
    }
    const double err = std::fabs(a[i] - e[i]);
    d.max_abs_err = std::max(d.max_abs_err, err);
    d.max_rel_err = std::max(d.max_rel_err, err / std::max(std::fabs(e[i]), 1e-6));
    if (err > atol + rtol * std::fabs(e[i])) ++d.violations;
  }
  return d;
}

double default_tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64: return 1e-12;
    case DType::F32: return 1e-5;
    case DType::F16: return 2e-3;
    case DType::BF16: return 2e-2;
    default: return 0.0;
  }
}

bool bitwise_equal(const TensorView& a, const TensorView& b) {
  check_cpu("bitwise_equal", a);
  check_cpu("bitwise_equal", b);
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = Tensor::copy_of(a), cb = Tensor::copy_of(b);
  return std::memcmp(ca.view().data(), cb.view().data(), ca.view().nbytes()) == 0;
}

double quantile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double pos = p * static_cast<double>(samples.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, samples.size() - 1);
  return samples[lo] + (pos - static_cast<double>(lo)) * (samples[hi] - samples[lo]);
}

double host_us_per_call(const std::function<void()>& call, int calls, const Stream& stream) {
  synchronize(stream);
  const auto start = std::chrono::steady_clock::now();
  for (int c = 0; c < calls; ++c) call();
  synchronize(stream);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
             .count() /
         calls;
}

}  // namespace meshfuse::testing
