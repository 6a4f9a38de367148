// Elementwise arithmetic on tensors of one shape (no broadcasting), as the executor needs it: the
// value sum of a Program's `add`, gradient accumulation in reverse mode, a loss or its gradient
// scaled by 1/count.
//
//   add: out = a + alpha * b     (torch.add(a, b, alpha=alpha))
//   mul: out = a * scalar        (torch.mul(a, scalar))
//
// How it is computed, with C the compute type (fp32 for f32, bf16 and f16; double for f64) and
// round_T the single rounding to the tensors' dtype (round to nearest even; a no-op for f32, f64):
//   add: out = round_T(fma(C(alpha), C(b), C(a)))   one fused multiply-add: a + alpha*b is
//                                                   rounded once in C (exact for alpha = 1)
//   mul: out = round_T(C(a) * C(scalar))
// alpha and scalar are rounded to C first (0.1 becomes 0.1f outside f64). Every backend computes
// exactly this, so backends agree bitwise, whatever the strides.
//
// Against PyTorch on the CPU (torch 2.15, AVX-512 kernels, measured; docs/kernels/elementwise.md):
// f32 and f64 add (alpha = 0.1 too; contiguous, strided, in place, vector tails) and mul of every
// dtype are bitwise equal: torch's add is fma(alpha, b, a) as well. 16-bit add is bitwise equal
// when alpha * b is exact in the dtype (alpha = +-1, +-2^k: the executor's sums and gradient
// accumulation). Otherwise torch differs: it rounds alpha to the 16-bit dtype, and its strided
// and tail loops round alpha * b before the sum; meshfuse keeps alpha in fp32 and rounds once,
// as torch.mul treats its scalar and as torch's CUDA add computes (in fp32 "opmath").
// NaN and inf follow IEEE (0 * inf is NaN: alpha = 0 with an infinite b gives NaN, as in torch).
//
// a, b, out: one shape, any rank (0-d included), one dtype: f32, f64, bf16 or f16. The inputs may
// be strided (any strides: 0 and negative too); out is contiguous and allocated by the caller.
// out may be the very same view as an input (the same data, contiguous: in place, out = a + b
// into a); out overlapping an input's memory in any other way is InvalidArgument (the span from
// an input's lowest to its highest element is compared with out's, conservatively). Empty tensors
// launch nothing.
// Errors: InvalidArgument (an argument undefined, out not contiguous, out partly overlapping an
// input), DTypeMismatch (a not floating, b or out of another dtype), ShapeMismatch (b or out of
// another shape than a), DeviceMismatch (tensors on different devices, or a stream of another
// device), Unsupported / BackendUnavailable (see kernel_backend.h). Messages name the op, the
// argument, what was expected and what came.
#pragma once

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// out = a + alpha * b; a, b, out: same shape.
void add(const TensorView& a, const TensorView& b, const TensorView& out, double alpha = 1.0,
         const Stream& stream = {});

// out = a * scalar; a, out: same shape.
void mul(const TensorView& a, double scalar, const TensorView& out, const Stream& stream = {});

}  // namespace meshfuse
