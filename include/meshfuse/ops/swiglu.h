// SwiGLU: the gated activation of the LLaMA / Mistral / Qwen MLP (Shazeer 2020, "GLU Variants
// Improve Transformer", arXiv:2002.05202):
//
//   out = up * silu(gate),   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))
//
// Backward, with s = sigmoid(g) and dy the upstream gradient:
//   d_up   = dy * silu(g)
//   d_gate = dy * up * s * (1 + g * (1 - s))
//
// All tensors share one dtype: f32, f64, bf16 or f16 (16-bit types are computed in fp32 and
// rounded once). Any rank; outputs are contiguous and preallocated by the caller.
// Errors: DTypeMismatch (dtypes differ or not floating), ShapeMismatch (shapes differ),
// InvalidArgument (output not contiguous, or overlapping an operand other than in place: out may be
// gate or up itself; swiglu_packed's out never shares x's memory),
// DeviceMismatch (tensors on different devices, or a stream of another device), Unsupported /
// BackendUnavailable (see kernel_backend.h).
#pragma once

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// How swiglu_packed finds gate and up in one (..., 2*I) tensor x:
//   Halves:      gate = x[..., 0:I],      up = x[..., I:2I]   (first half gate, second half up)
//   Interleaved: gate = x[..., 0::2],     up = x[..., 1::2]   (even columns gate, odd up)
enum class SwigluLayout { Halves, Interleaved };

// gate, up, out: same shape (..., I).
void swiglu(const TensorView& gate, const TensorView& up, const TensorView& out,
            const Stream& stream = {});

// grad_out, gate, up: (..., I); writes grad_gate and grad_up, both (..., I). In place: an output
// may be one of the inputs, the same view (every element is read before it is written); the MLP
// writes grad_gate over gate and grad_up over up, which it no longer needs (as Liger does). Other
// overlaps are InvalidArgument.
void swiglu_backward(const TensorView& grad_out, const TensorView& gate, const TensorView& up,
                     const TensorView& grad_gate, const TensorView& grad_up,
                     const Stream& stream = {});

// x: (..., 2*I) packed as `layout` says; out: (..., I). InvalidArgument if the last dim is odd.
void swiglu_packed(const TensorView& x, SwigluLayout layout, const TensorView& out,
                   const Stream& stream = {});

// grad_out: (..., I), x: (..., 2*I); writes grad_x (..., 2*I) in the same layout as x.
void swiglu_packed_backward(const TensorView& grad_out, const TensorView& x, SwigluLayout layout,
                            const TensorView& grad_x, const Stream& stream = {});

}  // namespace meshfuse
