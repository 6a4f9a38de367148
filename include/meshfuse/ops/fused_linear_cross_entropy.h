// Fused linear cross-entropy: the loss of a language-model head and its gradients, computed a
// chunk of rows at a time so that the (N, V) logits are never held whole.
//
// With m = logits_multiplier and the options of cross_entropy.h:
//   logits = x @ weight^T + bias                        (N, V); bias optional
//   loss   = cross_entropy(logits, labels, options)     (cross_entropy.h: m, ignore_index,
//                                                        reduction, label_smoothing, z-loss)
// i.e. PyTorch's F.cross_entropy(F.linear(x, weight, bias) * m, labels, ignore_index=...,
// reduction=..., label_smoothing=...) plus the z-loss term when z_loss_scale != 0.
// The gradients of `loss` for the upstream gradient grad_loss, with dlogits the gradient of
// cross_entropy.h (zero rows where the label is ignored; mean divides by the number of rows not
// ignored among all N):
//   grad_x      = dlogits @ weight               (N, H)
//   grad_weight = dlogits^T @ x                  (V, H)
//   grad_bias   = sum over rows of dlogits       (V)
//
// Forward and backward in one call (the design of Liger Kernel's fused linear cross-entropy,
// Hsu et al. 2024, arXiv:2410.10989): a separate backward would have to recompute every chunk's
// logits (a second (N, V, H) GEMM) or keep them (the (N, V) memory the op exists to avoid), so
// the gradients are computed while each chunk's logits are at hand. This needs grad_loss at
// forward time, which a training framework has: the loss is usually the graph's output (upstream
// 1). Otherwise, for mean and sum the gradients are linear in the scalar grad_loss: pass 1 and
// scale the saved gradients by the real upstream in the autograd backward (what Liger does).
// For reduction none, grad_loss is per row and is used as such (a framework that only learns it
// later calls again with it). Without any gradient output only the loss is computed (no
// backward work; grad_loss may then be undefined).
//
// Chunks and memory. The cpu backend runs chunks of chunk_rows rows: the chunk's logits in fp32
// (f64 for f64) from the cpu GEMM, the loss rows (lse, per-row loss), the logits' gradient in
// place, then grad_x of the chunk, grad_weight += and grad_bias += (summed over chunks in fp32,
// f64 for f64, and rounded once). Its scratch memory (fused_linear_cross_entropy_workspace gives
// it exactly) does not grow with N beyond small per-row statistics:
//   - min(chunk_rows, N) x V x 4 bytes (8 for f64): one chunk of logits, then their gradient;
//   - N x 12 bytes (f64: 16; + 8 for reduction none with gradients): per-row loss, lse, upstream;
//   - bf16 / f16 only, fp32 staging for the fp32 GEMM: the chunk's x and grad_x rows
//     (chunk x H x 4 each), a block of weight rows (at most 32 MiB) and the bias (V x 4);
//   - bf16 / f16 with grad_weight and more than one chunk (N > chunk_rows): grad_weight's fp32
//     accumulator, V x H x 4 bytes (with one chunk each block is rounded straight into
//     grad_weight);
//   - with grad_bias: its accumulator, V x 4 bytes (8 for f64);
// plus the GEMM library's own scratch. The weight (in fp32 blocks for 16-bit types) is read twice
// per chunk (logits, then grad_x): fewer, larger chunks are faster; smaller chunks use less memory.
// The cuda backend runs the same chunks with cuBLASLt GEMMs that multiply the input dtype with
// fp32 accumulation: the chunk's logits in fp32 (f64 for f64), the loss rows and grad_bias from
// them, and for bf16 / f16 the logits' gradient rounded once to the input dtype (in place) for the
// grad_x and grad_weight GEMMs, as the unfused linear + cross_entropy uses it (cuBLASLt has no
// fp32 x bf16 product). Its scratch memory, all allocated on the call's stream: the same chunk of
// logits (min(chunk_rows, N) x V x 4 bytes, 8 for f64) and, for bf16 / f16 with grad_weight and
// more than one chunk, the same V x H x 4 fp32 grad_weight accumulator; besides those only
// N x 20 bytes per-row statistics (f64: 24), V x 4 bytes each for a 16-bit bias in fp32 and
// grad_bias's 16-bit accumulator, and cuBLASLt's workspace (at most 32 MiB); no staging of x or
// the weight. fused_linear_cross_entropy_workspace describes the cpu backend.
// The reference backend ignores chunk_rows and computes the unfused composition in double (the
// whole (N, V) logits and their gradient): it is the ground truth, not a memory-bounded kernel.
//
// Numerics and determinism: results are bitwise the same run to run for a fixed chunk_rows and
// thread count. A different chunk_rows changes the GEMM shapes and the order of the sums over
// rows, so results agree within rounding (chunk_rows >= N all give the same bits).
//
// Dtypes: x, weight, bias, loss, grad_loss and the gradients share one dtype: f32, f64, bf16 or
// f16; labels are i32 or i64. Inputs may be strided (copied once when not contiguous); outputs
// are contiguous and preallocated by the caller; optional tensors are undefined TensorViews.
// Errors: InvalidArgument (wrong rank, chunk_rows <= 0, label_smoothing outside [0, 1], a label
// outside [0, V) that is not ignore_index (naming the first such row and value; nothing is
// computed), a gradient output without grad_loss, grad_bias without bias, an output not
// contiguous), ShapeMismatch, DTypeMismatch, DeviceMismatch, Unsupported / BackendUnavailable
// (see kernel_backend.h).
#pragma once

#include <cstdint>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/ops/cross_entropy.h"

namespace meshfuse {

// Rows per chunk by default: 512 x 32000 x 4 B = 66 MB of fp32 logits for a 32k vocabulary,
// 262 MB for 128k.
inline constexpr std::int64_t kFusedLinearCrossEntropyChunkRows = 512;

// x: (N, H); weight: (V, H); bias: (V) or undefined; labels: (N,) i32/i64; grad_loss: the loss's
// shape and dtype, required when any gradient output is given.
// Writes loss: () for mean and sum, (N,) for none; and, each when defined: grad_x (N, H),
// grad_weight (V, H), grad_bias (V, needs bias).
void fused_linear_cross_entropy(const TensorView& x, const TensorView& weight,
                                const TensorView& bias, const TensorView& labels,
                                const TensorView& grad_loss, const TensorView& loss,
                                const TensorView& grad_x, const TensorView& grad_weight,
                                const TensorView& grad_bias,
                                const CrossEntropyOptions& options = {},
                                std::int64_t chunk_rows = kFusedLinearCrossEntropyChunkRows,
                                const Stream& stream = {});

// What a call's scratch memory depends on.
struct FusedLinearCrossEntropyShape {
  DType dtype = DType::BF16;
  std::int64_t rows = 0;    // N
  std::int64_t hidden = 0;  // H
  std::int64_t vocab = 0;   // V
  std::int64_t chunk_rows = kFusedLinearCrossEntropyChunkRows;
  Reduction reduction = Reduction::Mean;
  bool bias = false;                                            // a bias is given
  bool grad_x = false, grad_weight = false, grad_bias = false;  // these outputs are wanted
};

// The scratch memory of one call on the cpu backend, in bytes, by part (see above).
struct FusedLinearCrossEntropyWorkspace {
  std::int64_t logits = 0;       // one chunk of logits / their gradient
  std::int64_t per_row = 0;      // per-row loss, lse and upstream gradient
  std::int64_t staging = 0;      // bf16 / f16: fp32 x and grad_x rows, weight block, bias
  std::int64_t grad_weight = 0;  // bf16 / f16, several chunks: grad_weight's fp32 accumulator
  std::int64_t grad_bias = 0;    // grad_bias's accumulator
  std::int64_t total() const { return logits + per_row + staging + grad_weight + grad_bias; }
};

// Throws InvalidArgument for a negative size or chunk_rows <= 0, DTypeMismatch for a dtype that
// is not floating.
FusedLinearCrossEntropyWorkspace fused_linear_cross_entropy_workspace(
    const FusedLinearCrossEntropyShape& shape);

}  // namespace meshfuse
