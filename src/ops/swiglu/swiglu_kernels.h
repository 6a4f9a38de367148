// SwiGLU kernel interface shared by the front-end and the backends (internal).
#pragma once

#include <cstdint>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"

namespace meshfuse::detail {

// One (rows x cols) operand: element (r, c) is at data + r*row_stride + c*col_stride elements.
// col_stride is 1 (plain or `halves`) or 2 (`interleaved`).
struct SwigluOperand {
  void* data;
  std::int64_t row_stride;
  std::int64_t col_stride;
};

struct SwigluShape {
  DType dtype;
  std::int64_t rows;
  std::int64_t cols;
};

using SwigluForwardFn = void(const SwigluShape&, SwigluOperand gate, SwigluOperand up,
                             SwigluOperand out, const Stream&);
using SwigluBackwardFn = void(const SwigluShape&, SwigluOperand grad_out, SwigluOperand gate,
                              SwigluOperand up, SwigluOperand grad_gate, SwigluOperand grad_up,
                              const Stream&);

namespace reference {
SwigluForwardFn swiglu_forward;
SwigluBackwardFn swiglu_backward;
}  // namespace reference

namespace cpu {
SwigluForwardFn swiglu_forward;
SwigluBackwardFn swiglu_backward;
}  // namespace cpu

namespace cuda {
SwigluForwardFn swiglu_forward;
SwigluBackwardFn swiglu_backward;
}  // namespace cuda

}  // namespace meshfuse::detail
