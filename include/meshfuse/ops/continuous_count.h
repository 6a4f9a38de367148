// continuous_count: a histogram of small non-negative integers, e.g. the number of tokens routed
// to each expert of a mixture-of-experts layer (the seed library's continuous_count).
//
//   out[v] = #{ i : x[i] == v }   for v in [0, bins),  bins = out.size(0)
//
// Values outside [0, bins) are ignored (not counted, no error) on every backend; this differs
// from torch.bincount, which rejects negative values and grows its output to max(x) + 1. With
// every value in range it equals torch.bincount(x, minlength=bins).
//
// x: 1-D, int32 or int64, any stride (empty is fine: all counts 0). out: (bins,) int64 (the dtype
// of torch.bincount's counts), contiguous, preallocated by the caller; bins may be 0. The counts
// are exact integers, so every backend gives the same result bitwise, run to run. No backward.
//
// Errors: DTypeMismatch (x not i32/i64, out not i64), InvalidArgument (x not 1-D, out not 1-D or
// not contiguous or overlapping the input), DeviceMismatch, Unsupported / BackendUnavailable (see
// kernel_backend.h).
#pragma once

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

void continuous_count(const TensorView& x, const TensorView& out, const Stream& stream = {});

}  // namespace meshfuse
