// Sequence packing: between a padded batch (B, S, ...) of variable-length sequences and the packed
// form (T, ...) that holds only their tokens, back to back (the varlen layout of FlashAttention
// and of the seed library's recurrent ops).
//
// cu_seqlens (B+1,) int32, uint32 (the seed library's) or int64 gives the offsets: sequence b is
// packed rows [cu_seqlens[b], cu_seqlens[b+1]), of length L_b = cu_seqlens[b+1] - cu_seqlens[b].
// It must start at 0, be non-decreasing (empty sequences, repeated offsets, are allowed), end at
// T, and every L_b must be <= S. Token i of sequence b (0 <= i < L_b) sits in padded row b at
//   Right padding: position i             (valid tokens first, padding after)
//   Left padding:  position S - L_b + i   (padding first, the valid tokens at the end of the row)
//
//   pack_sequence:   out[cu_seqlens[b] + i, ...] = x[b, position(b, i), ...]
//   unpack_sequence: out[b, position(b, i), ...] = x[cu_seqlens[b] + i, ...], and 0 elsewhere
//
// Each is the other's backward: the gradient of pack_sequence is unpack_sequence of the upstream
// gradient (zero at the padding, which pack never reads), and the gradient of unpack_sequence is
// pack_sequence of it. Nothing is saved.
//
// Any trailing dims (...), any dtype (a copy: floating, integer and bool alike); x and out share
// the dtype. x may have any strides; out is contiguous and preallocated by the caller, and its
// shape gives T (pack) or B and S (unpack). cu_seqlens is read on the host to check it: when it
// lives on a GPU that is a small device-to-host copy that waits for the stream.
//
// Errors: DTypeMismatch (out's dtype differs from x's; cu_seqlens not i32/u32/i64), ShapeMismatch
// (shapes that do not follow the above, cu_seqlens not (B+1,)), InvalidArgument (x of too low a
// rank; cu_seqlens that does not start at 0, decreases, does not end at T or holds a sequence
// longer than S; out not contiguous or partly overlapping an input), DeviceMismatch, Unsupported /
// BackendUnavailable (see kernel_backend.h).
#pragma once

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// Where a padded row keeps its valid tokens: Left = at the end (the padding comes first), Right =
// at the start. Left is the default, as in the seed library.
enum class PaddingSide { Left, Right };

// x: (B, S, ...); cu_seqlens: (B+1,); out: (T, ...) with x's trailing dims.
void pack_sequence(const TensorView& x, const TensorView& cu_seqlens, const TensorView& out,
                   PaddingSide padding_side = PaddingSide::Left, const Stream& stream = {});

// x: (T, ...); cu_seqlens: (B+1,); out: (B, S, ...) with x's trailing dims, padding zero-filled.
void unpack_sequence(const TensorView& x, const TensorView& cu_seqlens, const TensorView& out,
                     PaddingSide padding_side = PaddingSide::Left, const Stream& stream = {});

}  // namespace meshfuse
