// Reference continuous_count: one pass, one counter per bin.
#include <algorithm>

#include "ops/common.h"
#include "ops/continuous_count/continuous_count_kernels.h"

namespace meshfuse::detail::reference {

void continuous_count(const CountShape& s, const void* x, std::int64_t* out, const Stream&) {
  std::fill(out, out + s.bins, 0);
  dispatch_index(s.dtype, "continuous_count", [&](auto tag) {
    const auto* v = static_cast<const decltype(tag)*>(x);
    for (std::int64_t i = 0; i < s.n; ++i)
      if (v[i] >= 0 && v[i] < s.bins) ++out[v[i]];
  });
}

}  // namespace meshfuse::detail::reference
