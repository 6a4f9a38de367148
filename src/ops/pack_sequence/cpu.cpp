// CPU packing: the output rows are split into parts of about 1 MiB spread over OpenMP threads;
// within a part, the rows of one sequence are contiguous on both sides, so each sequence is one
// memcpy (and, unpacking, its padding one memset).
#include <algorithm>
#include <cstring>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/pack_sequence/pack_sequence_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

constexpr std::int64_t kPartBytes = std::int64_t{1} << 20;

// Calls f(begin, end) on consecutive ranges of about kPartBytes covering rows [0, rows), in
// parallel: every output row costs the same (a copy or a zero fill), so the parts are balanced
// whatever the sequence lengths.
template <typename F>
void for_row_ranges(std::int64_t rows, std::int64_t row_bytes, F&& f) {
  const std::int64_t per_part = std::max<std::int64_t>(1, kPartBytes / row_bytes);
  const std::int64_t parts = (rows + per_part - 1) / per_part;
  parallel_if(parts > 1, [&] {
#pragma omp for schedule(static)
    for (std::int64_t p = 0; p < parts; ++p) f(p * per_part, std::min(rows, (p + 1) * per_part));
  });
}

}  // namespace

void pack_sequence(const PackShape& s, const void* x, void* out, const Stream&) {
  if (s.row_bytes == 0 || s.tokens == 0) return;
  const auto* src = static_cast<const char*>(x);
  auto* dst = static_cast<char*>(out);
  const std::int64_t rb = s.row_bytes;
  dispatch_offsets(s.index_dtype, "pack_sequence", [&](auto tag) {
    const auto* cu = static_cast<const decltype(tag)*>(s.cu_seqlens);
    for_row_ranges(s.tokens, rb, [&](std::int64_t begin, std::int64_t end) {
      // The sequence holding packed row `begin` (empty sequences before it are skipped), then
      // each sequence overlapping [begin, end) in one copy.
      std::int64_t b = std::upper_bound(cu, cu + s.batch + 1, begin) - cu - 1;
      for (std::int64_t t = begin; t < end; ++b) {
        const std::int64_t stop = std::min<std::int64_t>(end, cu[b + 1]);
        const std::int64_t row = padded_row(b, t - cu[b], cu[b + 1] - cu[b], s.seq_len, s.side);
        std::memcpy(dst + t * rb, src + row * rb, (stop - t) * rb);
        t = stop;
      }
    });
  });
}

void unpack_sequence(const PackShape& s, const void* x, void* out, const Stream&) {
  if (s.row_bytes == 0 || s.batch * s.seq_len == 0) return;
  const auto* src = static_cast<const char*>(x);
  auto* dst = static_cast<char*>(out);
  const std::int64_t rb = s.row_bytes;
  dispatch_offsets(s.index_dtype, "unpack_sequence", [&](auto tag) {
    const auto* cu = static_cast<const decltype(tag)*>(s.cu_seqlens);
    for_row_ranges(s.batch * s.seq_len, rb, [&](std::int64_t begin, std::int64_t end) {
      // Each padded row b within [begin, end): padding, its tokens [first, first + len), padding.
      for (std::int64_t r = begin; r < end;) {
        const std::int64_t b = r / s.seq_len, stop = std::min(end, (b + 1) * s.seq_len);
        const std::int64_t len = cu[b + 1] - cu[b];
        const std::int64_t first = padded_row(b, 0, len, s.seq_len, s.side);
        const std::int64_t v0 = std::clamp(first, r, stop), v1 = std::clamp(first + len, r, stop);
        std::memset(dst + r * rb, 0, (v0 - r) * rb);
        if (v1 > v0)  // x may be empty (and null) when every sequence is
          std::memcpy(dst + v0 * rb, src + (cu[b] + v0 - first) * rb, (v1 - v0) * rb);
        std::memset(dst + v1 * rb, 0, (stop - v1) * rb);
        r = stop;
      }
    });
  });
}

}  // namespace meshfuse::detail::cpu
