// Reference packing: one token row at a time.
#include <cstring>

#include "ops/common.h"
#include "ops/pack_sequence/pack_sequence_kernels.h"

namespace meshfuse::detail::reference {
namespace {

// Calls copy(padded row, packed row) for every token of every sequence.
template <typename F>
void for_each_token(const PackShape& s, std::string_view op, F&& copy) {
  dispatch_offsets(s.index_dtype, op, [&](auto tag) {
    const auto* cu = static_cast<const decltype(tag)*>(s.cu_seqlens);
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const std::int64_t len = cu[b + 1] - cu[b];
      for (std::int64_t i = 0; i < len; ++i)
        copy(padded_row(b, i, len, s.seq_len, s.side), std::int64_t{cu[b]} + i);
    }
  });
}

}  // namespace

void pack_sequence(const PackShape& s, const void* x, void* out, const Stream&) {
  if (s.row_bytes == 0) return;  // empty rows: the pointers may be null
  const auto* src = static_cast<const char*>(x);
  auto* dst = static_cast<char*>(out);
  for_each_token(s, "pack_sequence", [&](std::int64_t padded, std::int64_t packed) {
    std::memcpy(dst + packed * s.row_bytes, src + padded * s.row_bytes, s.row_bytes);
  });
}

void unpack_sequence(const PackShape& s, const void* x, void* out, const Stream&) {
  if (s.row_bytes == 0 || s.batch * s.seq_len == 0) return;  // the pointers may be null
  const auto* src = static_cast<const char*>(x);
  auto* dst = static_cast<char*>(out);
  std::memset(dst, 0, s.batch * s.seq_len * s.row_bytes);
  for_each_token(s, "unpack_sequence", [&](std::int64_t padded, std::int64_t packed) {
    std::memcpy(dst + padded * s.row_bytes, src + packed * s.row_bytes, s.row_bytes);
  });
}

}  // namespace meshfuse::detail::reference
