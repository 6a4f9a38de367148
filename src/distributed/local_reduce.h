// The reduction kernel of the local backend on CUDA tensors (internal; local_reduce.cu, CUDA
// builds only).
#pragma once

#include <cstdint>
#include <vector>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::detail {

// The most buffers one reduction reads: their pointers travel in the kernel's parameters.
constexpr int kMaxLocalReduceSources = 64;

// Queues dst[i] = op(srcs[0][i], srcs[1][i], ...) on `stream` (its device current), combined in
// the order given, as reduce_buffers does on the CPU: 16-bit floats in fp32 rounded once, f64 in
// f64, integers in their own type; Avg divides the sum by srcs.size(). The sources may be on other
// devices that this one can read (peer access). 1 to kMaxLocalReduceSources sources (unchecked).
void cuda_reduce_buffers(DType dtype, ReduceOp op, const std::vector<const void*>& srcs, void* dst,
                         std::int64_t n, const Stream& stream);

}  // namespace meshfuse::detail
