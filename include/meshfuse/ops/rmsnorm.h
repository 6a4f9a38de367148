// RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", arXiv:1910.07467) and
// its fused residual-add form, as used before every attention and MLP block of LLaMA / Mistral /
// Qwen. Over the last dimension H of x (any rank >= 1; "rows" are all the leading dims):
//
//   r    = x * multiplier + residual                      (residual optional: r = x * multiplier)
//   rstd = 1 / sqrt(mean(r^2) + eps)                      per row
//   y    = r * rstd * weight                              (weight optional: 1)
//
// rmsnorm(x, weight, eps) equals torch.nn.functional.rms_norm(x, (H,), weight, eps) (torch's
// default eps, None = the machine epsilon of its computation type, fp32 for 16-bit x, has no
// counterpart here: eps is always explicit). weight has x's dtype (torch also takes a float32
// weight for 16-bit x, off its fused kernel).
//
// Backward, with n = r * rstd, dy the gradient of y and grad_r the gradient of the r output when r
// itself is used downstream (the residual stream of a transformer):
//   dn        = dy * weight
//   dr        = rstd * (dn - n * mean(dn * n)) + grad_r
//   dx        = dr * multiplier,   dresidual = dr
//   dweight   = sum over rows of dy * n
//
// Dtypes: x, residual, weight, y, r and the gradients share one dtype: f32, f64, bf16 or f16.
// 16-bit types are computed in fp32 and rounded once; rstd, of shape (rows,), is f64 for f64
// inputs and f32 otherwise (rmsnorm_rstd_dtype), so that f64 gradients keep f64's accuracy. y is
// computed from the unrounded r; the backward reads the stored (rounded) r. dweight is summed in
// double over fixed row blocks combined in a fixed order (cpu: exact terms, one rounding; cuda:
// each block's sum rounded once to fp32, f64 for f64, then the blocks in double), so it is within
// about one rounding of the exact sum and bitwise the same run to run whatever the thread count.
// Outputs are caller-allocated and contiguous; optional arguments are undefined TensorViews. In
// place: y may be x (or residual) itself, and dresidual may be dx at multiplier 1; no other output
// may share an operand's memory (r over residual would be read again after it is written).
// Errors: DTypeMismatch (dtypes differ or not floating; rstd not rmsnorm_rstd_dtype), ShapeMismatch
// (weight not (H,), residual / r / gradients not x's shape, rstd not (rows,)), InvalidArgument (0-d
// x, eps < 0 or NaN, an output not contiguous or overlapping an operand other than in place, an
// optional output given without the input it belongs to), DeviceMismatch (tensors on different
// devices, or a stream of another device), Unsupported / BackendUnavailable (see kernel_backend.h).
#pragma once

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// The dtype of rstd for inputs of `dtype`: F64 for F64, else F32.
constexpr DType rmsnorm_rstd_dtype(DType dtype) {
  return dtype == DType::F64 ? DType::F64 : DType::F32;
}

// x: (..., H); weight: (H,) or undefined; y: like x; rstd: rmsnorm_rstd_dtype (rows,), or
// undefined when no backward follows.
void rmsnorm(const TensorView& x, const TensorView& weight, const TensorView& y,
             const TensorView& rstd, double eps, const Stream& stream = {});

// grad_y, x: (..., H); weight as in the forward; rstd: the forward's. Writes dx (like x) and, when
// defined (needs weight), dweight (H,).
void rmsnorm_backward(const TensorView& grad_y, const TensorView& x, const TensorView& weight,
                      const TensorView& rstd, const TensorView& dx, const TensorView& dweight,
                      const Stream& stream = {});

// x, residual: (..., H), residual optional; weight: (H,) or undefined. Writes y (like x), r (like
// x: required with a residual, undefined without one) and rstd (rmsnorm_rstd_dtype (rows,), or
// undefined).
void fused_residual_add_rmsnorm(const TensorView& x, const TensorView& residual,
                                const TensorView& weight, const TensorView& y, const TensorView& r,
                                const TensorView& rstd, double eps, double multiplier = 1.0,
                                const Stream& stream = {});

// grad_y: (..., H); grad_r: like grad_y or undefined (only with a residual); r: the forward's r
// output, or x when the forward had no residual; weight, rstd, multiplier: as in the forward.
// Writes dx (like x), dresidual (like x; defined exactly when the forward had a residual) and,
// when defined (needs weight), dweight (H,). With multiplier = 1, dresidual equals dx (as
// torch.autograd gives both inputs of x + residual one gradient): dresidual may then be dx itself
// (the same data), written once, one N·H write less; sharing dx's data with another multiplier is
// InvalidArgument.
void fused_residual_add_rmsnorm_backward(const TensorView& grad_y, const TensorView& grad_r,
                                         const TensorView& r, const TensorView& weight,
                                         const TensorView& rstd, const TensorView& dx,
                                         const TensorView& dresidual, const TensorView& dweight,
                                         double multiplier = 1.0, const Stream& stream = {});

}  // namespace meshfuse
