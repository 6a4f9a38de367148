// Reference GEMM: the textbook triple loop in double, one output row per OpenMP iteration.
#include <algorithm>
#include <vector>

#include "ops/common.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse::detail::reference {
namespace {

template <typename T>
double load(const GemmMatrix& x, std::int64_t l, std::int64_t r, std::int64_t c) {
  return to_float(static_cast<const T*>(x.data)[offset(x, l, r, c)]);
}

// Operands of dtype T, C and D of dtype O.
template <typename T, typename O>
void gemm_as(const GemmProblem& p, const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& c,
             const GemmMatrix& d) {
  const bool product = p.alpha != 0 && p.k > 0;  // BLAS: alpha = 0 reads neither A nor B
  const bool add_c = c.data != nullptr && p.beta != 0;
  const std::int64_t work = p.batch * p.m * p.n * std::max<std::int64_t>(p.k, 1);
#pragma omp parallel for schedule(static) if (work >= (std::int64_t{1} << 16))
  for (std::int64_t row = 0; row < p.batch * p.m; ++row) {
    const std::int64_t l = row / p.m, i = row % p.m;
    // acc[j] sums q = 0, 1, ... in order either way; the loop order follows B's storage so
    // that B is read with unit stride.
    std::vector<double> acc(p.n, 0.0);
    if (product && b.transposed) {
      for (std::int64_t j = 0; j < p.n; ++j)
        for (std::int64_t q = 0; q < p.k; ++q) acc[j] += load<T>(a, l, i, q) * load<T>(b, l, q, j);
    } else {
      for (std::int64_t q = 0; product && q < p.k; ++q) {
        const double av = load<T>(a, l, i, q);
        for (std::int64_t j = 0; j < p.n; ++j) acc[j] += av * load<T>(b, l, q, j);
      }
    }
    O* out = static_cast<O*>(d.data) + l * d.batch_stride + i * d.ld;
    for (std::int64_t j = 0; j < p.n; ++j) {
      double v = product ? p.alpha * acc[j] : 0.0;
      if (add_c) v += p.beta * load<O>(c, l, i, j);
      out[j] = from_double<O>(v);
    }
  }
}

}  // namespace

void gemm(const GemmProblem& p, GemmMatrix a, GemmMatrix b, GemmMatrix c, GemmMatrix d,
          const Stream&) {
  if (p.n == 0) return;  // no output; D may have no storage to offset into
  dispatch_gemm(p, [&](auto t, auto o) { gemm_as<decltype(t), decltype(o)>(p, a, b, c, d); });
}

void column_sum(DType dtype, std::int64_t rows, std::int64_t cols, GemmMatrix x, void* out,
                const Stream&) {
  dispatch_float(dtype, "linear_backward", [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (std::int64_t j = 0; j < cols; ++j) {
      double sum = 0.0;
      for (std::int64_t i = 0; i < rows; ++i) sum += load<T>(x, 0, i, j);
      static_cast<T*>(out)[j] = from_double<T>(sum);
    }
  });
}

}  // namespace meshfuse::detail::reference
