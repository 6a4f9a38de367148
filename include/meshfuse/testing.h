// Random inputs, result comparison and sample statistics, shared by the tests, the CLI's bench
// and bench/.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse::testing {

// Fills a CPU tensor of a floating dtype with normal(mean, std) values; deterministic per seed.
void fill_normal(const TensorView& t, std::uint64_t seed, double mean = 0.0, double std = 1.0);
// Fills a CPU i32/i64 tensor with integers uniform in [low, high).
void fill_uniform_int(const TensorView& t, std::uint64_t seed, std::int64_t low, std::int64_t high);

struct Diff {
  double max_abs_err = 0;  // max |actual - expected| over elements where both are finite
  double max_rel_err = 0;  // max |actual - expected| / max(|expected|, 1e-6) over the same
  std::int64_t mismatched_nonfinite = 0;  // elements where NaN / +-inf do not match exactly
  std::int64_t violations = 0;  // elements outside |a - e| <= atol + rtol*|e| (set by compare)
};

// Compares two CPU tensors of the same shape (any dtypes, any strides) in double. Elements count
// as violations when |a - e| > atol + rtol * |e| or their NaN/inf-ness differs.
Diff compare(const TensorView& actual, const TensorView& expected, double atol, double rtol);

// Default tolerances of a result computed in `dtype` against the double reference: about 4 ulps
// of the dtype, with atol = rtol for values near zero.
double default_tolerance(DType dtype);

// True when both tensors hold the same bytes element by element (any strides).
bool bitwise_equal(const TensorView& a, const TensorView& b);

// The p-th quantile (p in [0, 1]) of `samples`, linearly interpolated between order statistics
// (numpy.quantile's default); 0 for no samples.
double quantile(std::vector<double> samples, double p);

// Host time per call, in microseconds, of `calls` calls of `call` back to back on `stream`,
// synchronised before the first and after the last (steady clock): on a GPU that keeps up, the
// host's time to queue a call; a kernel slower than the host shows its own time.
double host_us_per_call(const std::function<void()>& call, int calls, const Stream& stream);

}  // namespace meshfuse::testing
