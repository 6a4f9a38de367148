// pack_sequence / unpack_sequence kernel interface shared by the front-end and the backends
// (internal). The ops copy whole token rows, so the kernels move bytes and know no dtype.
#pragma once

#include <cstdint>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/ops/pack_sequence.h"

namespace meshfuse::detail {

struct PackShape {
  std::int64_t batch;      // B
  std::int64_t seq_len;    // S
  std::int64_t tokens;     // T
  std::int64_t row_bytes;  // one token: the product of the trailing dims times the element size
  PaddingSide side;
  // (B+1,) offsets of index_dtype (i32, u32 or i64), contiguous, on the kernel's device; checked by
  // the front-end (start at 0, non-decreasing, end at T, every length <= S).
  const void* cu_seqlens;
  DType index_dtype;
};

// The padded row (of B x S) holding token i of sequence b, of length len. Every backend addresses
// rows through it (or its inverse), in 64 bits: b * S passes 2^31 for large batches.
constexpr std::int64_t padded_row(std::int64_t b, std::int64_t i, std::int64_t len,
                                  std::int64_t seq_len, PaddingSide side) {
  return b * seq_len + (side == PaddingSide::Left ? seq_len - len : 0) + i;
}

// pack: x padded (B, S, row) -> out packed (T, row). unpack: x packed -> out padded, the padding
// zero-filled. Both contiguous.
using PackFn = void(const PackShape&, const void* x, void* out, const Stream&);

namespace reference {
PackFn pack_sequence;
PackFn unpack_sequence;
}  // namespace reference

namespace cpu {
PackFn pack_sequence;
PackFn unpack_sequence;
}  // namespace cpu

namespace cuda {
PackFn pack_sequence;
PackFn unpack_sequence;
}  // namespace cuda

}  // namespace meshfuse::detail
