// The cpu backend's row log-sum-exp, shared by softmax and cross_entropy (internal).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "ops/common.h"
#include "ops/cpu_math.h"

namespace meshfuse::detail::cpu {

// Statistics of one row v_j = m * x_j (in A = acc_t<T>):
//   max = max_j v_j, sum = sum_j exp(v_j - max), so logsumexp = max + log(sum);
//   sum_v = sum_j v_j (for label smoothing).
// A row entirely -inf gives max = -inf, sum = 0; a NaN gives sum = NaN, and so does +inf
// (exp(inf - inf)), which makes every result derived from the row NaN, as in PyTorch.
template <typename A>
struct RowStats {
  A max;
  A sum;
  A sum_v;
};

// One pass over memory: the row is read in L1-sized blocks; each block is read twice (its max,
// then its exp-sum against the running max), and the running sum is rescaled when the max grows
// ("online softmax", Milakov & Gimelshein 2018, at block rather than element granularity so that
// there is one exp per element).
template <typename T>
RowStats<acc_t<T>> row_stats(const T* x, std::int64_t n, acc_t<T> m) {
  using A = acc_t<T>;
  constexpr std::int64_t kBlock = 1024;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  RowStats<A> st{kNegInf, A(0), A(0)};
  for (std::int64_t b = 0; b < n; b += kBlock) {
    const T* xb = x + b;
    const std::int64_t len = std::min(kBlock, n - b);
    A bmax = kNegInf, bsum_v = 0;
#pragma omp simd reduction(max : bmax) reduction(+ : bsum_v)
    for (std::int64_t i = 0; i < len; ++i) {
      const A v = A(to_float(xb[i])) * m;
      bmax = v > bmax ? v : bmax;
      bsum_v += v;
    }
    st.sum_v += bsum_v;
    if (bmax > st.max) {
      st.sum *= vexp(st.max - bmax);
      st.max = bmax;
    }
    // While the max is -inf every v seen is -inf or NaN: shifting by 0 keeps exp(v) = 0 and NaN
    // instead of exp(-inf - -inf) = NaN for all.
    const A shift = st.max == kNegInf ? A(0) : st.max;
    A bsum = 0;
#pragma omp simd reduction(+ : bsum)
    for (std::int64_t i = 0; i < len; ++i) bsum += vexp(A(to_float(xb[i])) * m - shift);
    st.sum += bsum;
  }
  return st;
}

}  // namespace meshfuse::detail::cpu
