// CPU continuous_count: x is cut into parts counted in parallel, each into its own histogram;
// the histograms are then summed bin by bin. Integer sums are exact: the counts do not depend on
// the parts or the thread count.
#include <algorithm>
#include <vector>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/continuous_count/continuous_count_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

// A part holds at least 16k values and 4 per bin (so that summing the histograms costs less than
// filling them), and there are at most 1024 parts (bounding their memory).
constexpr std::int64_t kMinPart = 16384, kMaxParts = 1024;

}  // namespace

void continuous_count(const CountShape& s, const void* x, std::int64_t* out, const Stream&) {
  const std::int64_t part = std::max({kMinPart, 4 * s.bins, (s.n + kMaxParts - 1) / kMaxParts});
  const std::int64_t parts = (s.n + part - 1) / part;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(parts * s.bins), 0);
  dispatch_index(s.dtype, "continuous_count", [&](auto tag) {
    const auto* v = static_cast<const decltype(tag)*>(x);
    const auto bins = static_cast<std::uint64_t>(s.bins);
    parallel_if(parts > 1, [&] {
#pragma omp for schedule(static)
      for (std::int64_t p = 0; p < parts; ++p) {
        std::int64_t* c = counts.data() + p * s.bins;
        for (std::int64_t i = p * part, end = std::min(s.n, (p + 1) * part); i < end; ++i) {
          const auto u = static_cast<std::uint64_t>(v[i]);  // negative values wrap past bins
          if (u < bins) ++c[u];
        }
      }
    });
  });
  parallel_if(parts * s.bins > (1 << 16), [&] {
#pragma omp for schedule(static)
    for (std::int64_t b = 0; b < s.bins; ++b) {
      std::int64_t sum = 0;
      for (std::int64_t p = 0; p < parts; ++p) sum += counts[p * s.bins + b];
      out[b] = sum;
    }
  });
}

}  // namespace meshfuse::detail::cpu
