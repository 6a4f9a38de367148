// Element-wise reductions of CPU buffers for the CPU communicator backends (internal).
#pragma once

#include <cstdint>
#include <vector>

#include "meshfuse/core/dtype.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::detail {

// Throws Error(InvalidArgument) when `op` cannot reduce `dtype`: bool is never reduced, Avg
// needs a floating dtype. `what` names the operation.
void check_reducible(DType dtype, ReduceOp op, std::string_view what);

// dst[i] = op(srcs[0][i], srcs[1][i], ...), combined in the order given (deterministic); Avg
// divides the sum by srcs.size(). 16-bit floats are combined in fp32 and rounded once. dst may
// be one of the sources.
void reduce_buffers(DType dtype, ReduceOp op, const std::vector<const void*>& srcs, void* dst,
                    std::int64_t n);

// data[i] /= divisor (floating dtypes): what makes Avg of a backend that can only sum.
void divide_buffer(DType dtype, void* data, std::int64_t n, int divisor);

}  // namespace meshfuse::detail
