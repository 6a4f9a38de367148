// Where a sequence's rows and a head's operands are, for the host backends (internal).
#pragma once

#include <cstdint>

#include "ops/recurrent/recurrent_kernels.h"

namespace meshfuse::detail {

// Sequence b: its first token row and its length.
struct SequenceRows {
  std::int64_t first;
  std::int64_t length;
};

inline SequenceRows sequence_rows(const RecurrentShape& s, std::int64_t b) {
  if (s.cu_seqlens == nullptr) return {b * s.seq_len, s.seq_len};
  return {s.cu_seqlens[b], s.cu_seqlens[b + 1] - s.cu_seqlens[b]};
}

// The head of a tensor of `count` heads that head n reads (head broadcasting).
inline std::int64_t source_head(const RecurrentShape& s, std::int64_t count, std::int64_t n) {
  return n / (s.heads / count);
}

}  // namespace meshfuse::detail
