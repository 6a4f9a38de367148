// Softmax kernel interface shared by the front-end and the backends (internal).
#pragma once

#include <cstdint>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"

namespace meshfuse::detail {

// `rows` contiguous rows of `cols` elements.
struct SoftmaxShape {
  DType dtype;
  std::int64_t rows;
  std::int64_t cols;
};

// Element offset of row `row` in a contiguous (rows, cols) buffer. In int64: row * cols passes
// 2^31 at LLaMA-3 vocabulary sizes (128256) from row 16744 on.
constexpr std::int64_t row_offset(std::int64_t row, std::int64_t cols) { return row * cols; }

using SoftmaxForwardFn = void(const SoftmaxShape&, const void* x, void* y, double multiplier,
                              const Stream&);
using SoftmaxBackwardFn = void(const SoftmaxShape&, const void* grad_y, const void* y, void* grad_x,
                               double multiplier, const Stream&);

namespace reference {
SoftmaxForwardFn softmax_forward;
SoftmaxBackwardFn softmax_backward;
}  // namespace reference

namespace cpu {
SoftmaxForwardFn softmax_forward;
SoftmaxBackwardFn softmax_backward;
}  // namespace cpu

namespace cuda {
SoftmaxForwardFn softmax_forward;
SoftmaxBackwardFn softmax_backward;
}  // namespace cuda

}  // namespace meshfuse::detail
