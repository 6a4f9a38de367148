// Softmax over the last dimension, with a logits multiplier (muP-style output scaling):
//
//   y = softmax(m * x),   y_j = exp(m*x_j - max_k m*x_k) / sum_k exp(m*x_k - max_k m*x_k)
//
// Backward (dy the upstream gradient, the sum over the same row):
//   dx_j = m * y_j * (dy_j - sum_k dy_k * y_k)
//
// Same as torch.softmax(x * m, dim=-1) and its autograd, including the non-finite cases: a row
// that is entirely -inf gives NaN, and a NaN or +inf anywhere in a row makes the whole row NaN.
// All tensors share one dtype: f32, f64, bf16 or f16 (16-bit types are computed in fp32 and
// rounded once). Any rank >= 1; outputs are contiguous and preallocated by the caller.
// Errors: DTypeMismatch (dtypes differ or not floating), ShapeMismatch (shapes differ),
// InvalidArgument (0-d input, a non-finite logits_multiplier, output not contiguous or overlapping
// an operand other than in place: y may be x itself, grad_x may be grad_y or y itself),
// DeviceMismatch (tensors on different devices, or a stream of another device), Unsupported /
// BackendUnavailable (see kernel_backend.h).
#pragma once

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// x, y: same shape (..., V).
void softmax(const TensorView& x, const TensorView& y, double logits_multiplier = 1.0,
             const Stream& stream = {});

// grad_y, y (the forward's output), grad_x: same shape (..., V).
void softmax_backward(const TensorView& grad_y, const TensorView& y, const TensorView& grad_x,
                      double logits_multiplier = 1.0, const Stream& stream = {});

}  // namespace meshfuse
