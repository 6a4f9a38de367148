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
// Chunks and memory. Every backend but the reference runs chunks of chunk_rows rows (0, the
// default, picks the device's: fused_linear_cross_entropy_chunk_rows below): the chunk's logits in
// fp32 (f64 for f64), the loss rows (lse, per-row loss), the logits' gradient in place, then the
// chunk's grad_x rows and its share of grad_weight and grad_bias.
//
// Gradient accumulation (grad_weight = sum over chunks of dlogits_c^T @ x_c). grad_weight may have
// the weight's dtype or, for bf16 / f16 weights, f32 (like Megatron-LM's fp32 main_grad); its dtype
// decides how the chunks' products add up, with no V x H scratch either way:
//   - f32 (any weight) or f64: fp32 (f64) accumulation in the caller's buffer: each chunk's
//     product is added by its GEMM (beta = 1), so the sum over all rows keeps the GEMM's own
//     precision, as one GEMM over all rows would;
//   - bf16 / f16: each chunk's product (fp32 accumulation inside the GEMM) is added in fp32 to the
//     16-bit running sum and rounded to the dtype (Liger Kernel's in-place addmm): one 16-bit
//     rounding per chunk. With C = ceil(N / chunk_rows) chunks and u the dtype's unit roundoff
//     (2^-8 bf16, 2^-11 f16), an element's error is at most u times the sum of |running sum|
//     over the chunks (~C u |value|) and typically ~sqrt(C) u |value| (independent roundings),
//     against u |value| for one rounding: with the CUDA default at N = 16384 (8 chunks) about 3x
//     the error of the unfused op. Pass an f32 grad_weight when that matters (gradient
//     accumulation over micro-batches, many chunks).
// grad_bias follows the same dtype rule, but its V sums are always accumulated in double over all
// rows and rounded once: the exact column sums of the logits' gradient as computed (V x 8 bytes of
// scratch, nothing to save there).
// The gradients are written, not added to: the caller's previous contents are not read.
//
// Scratch memory of the cpu backend (fused_linear_cross_entropy_workspace gives it exactly); it
// does not grow with N beyond small per-row statistics:
//   - min(chunk_rows, N) x V x 4 bytes (8 for f64): one chunk of logits, then their gradient;
//   - N x 16 bytes (+ 8 for reduction none with gradients): per-row loss, lse, upstream;
//   - bf16 / f16 only, fp32 staging for the fp32 GEMM: the chunk's x and grad_x rows
//     (chunk x H x 4 each), a block of weight rows (at most 32 MiB, also the buffer of a block's
//     grad_weight product for a 16-bit grad_weight) and the bias (V x 4);
//   - with grad_bias: its accumulator, V x 8 bytes;
// plus the GEMM library's own scratch. The weight (in fp32 blocks for 16-bit types) is read twice
// per chunk (logits, then grad_x): fewer, larger chunks are faster; smaller chunks use less memory.
// The cuda backend runs the same chunks with cuBLASLt GEMMs that multiply the input dtype with
// fp32 accumulation: the chunk's logits in fp32 (f64 for f64), the loss rows and grad_bias from
// them, and for bf16 / f16 the logits' gradient rounded once to the input dtype (in place) for the
// grad_x and grad_weight GEMMs, as the unfused linear + cross_entropy uses it (cuBLASLt has no
// fp32 x bf16 product). Its scratch memory, all allocated on the call's stream (the device's
// stream-ordered pool: device_memory_stats in memory.h measures it): the same chunk of logits
// (min(chunk_rows, N) x V x 4 bytes, 8 for f64); besides that only N x 20 bytes of per-row
// statistics (f64: 24), V x 4 bytes for a 16-bit bias in fp32, V x 8 for grad_bias's double
// accumulator, and cuBLASLt's workspace (at most 32 MiB); no staging of x or the weight. At
// N = 16384, V = 128256, H = 4096 in bf16 with the default 2048-row chunks that is ~1.09 GB,
// 13% of the 8.4 GB of the unfused bf16 logits and their gradient. The reference backend ignores
// chunk_rows and computes the unfused composition in double (the whole (N, V) logits and their
// gradient), each output rounded once to its dtype: it is the ground truth (the exact gradients),
// not a memory-bounded kernel.
//
// Numerics and determinism: results are bitwise the same run to run for a fixed chunk_rows and
// thread count. A different chunk_rows changes the GEMM shapes and the order of the sums over
// rows, so results agree within rounding (chunk_rows >= N all give the same bits).
//
// Dtypes: x, weight, bias and grad_x share one dtype: f32, f64, bf16 or f16; loss, grad_weight and
// grad_bias have it too, or f32 when it is bf16 / f16 (an fp32 loss as Megatron-LM returns it; the
// loss rows are summed in double either way, so only the output's rounding differs); grad_loss has
// the loss's dtype; labels are i32 or i64.
// Inputs may be strided (copied once when not contiguous); outputs are contiguous and preallocated
// by the caller; optional tensors are undefined TensorViews. Errors: InvalidArgument (wrong rank,
// chunk_rows < 0, label_smoothing outside [0, 1], a label outside [0, V) that is not ignore_index
// (naming the first such row and value; nothing is computed; on CUDA with
// LabelCheck::DeviceAssert a device-side assert instead), a vocabulary shard (vocab_start or
// vocab_size not 0), a gradient output without grad_loss, grad_bias without bias, an output not
// contiguous or sharing an operand's memory), ShapeMismatch, DTypeMismatch, DeviceMismatch,
// Unsupported / BackendUnavailable (see kernel_backend.h).
#pragma once

#include <cstdint>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/ops/cross_entropy.h"

namespace meshfuse {

// chunk_rows = 0 (the default of every entry point) picks the device's chunk size:
//   cpu:  512 rows (512 x 32000 x 4 B = 66 MB of fp32 logits for a 32k vocabulary, 262 MB for
//         128k); the cpu GEMMs are compute-bound far below that.
//   CUDA: as many rows as keep one chunk's fp32 logits within 1 GiB, a multiple of 256, at least
//         256: 2048 rows for V = 128256, 8192 for 32000. Below ~1024 rows the grad_weight GEMM
//         (K = chunk rows) reads and writes all of grad_weight per chunk for few flops and turns
//         memory-bound on an H100 / H200; 1 GiB stays a small part of the unfused (N, V) logits
//         for training-size N.
// chunk_rows > 0 is used as given.
inline constexpr std::int64_t kFusedLinearCrossEntropyChunkRows = 0;
inline constexpr std::int64_t kFusedLinearCrossEntropyCpuChunkRows = 512;
inline constexpr std::int64_t kFusedLinearCrossEntropyCudaChunkBytes = std::int64_t{1} << 30;

// The rows per chunk that chunk_rows = 0 means on a device of `type` for a vocabulary of `vocab`.
std::int64_t fused_linear_cross_entropy_chunk_rows(DeviceType type, std::int64_t vocab);

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
  std::int64_t rows = 0;                                        // N
  std::int64_t hidden = 0;                                      // H
  std::int64_t vocab = 0;                                       // V
  std::int64_t chunk_rows = kFusedLinearCrossEntropyChunkRows;  // 0: the cpu's default
  Reduction reduction = Reduction::Mean;
  bool bias = false;                                            // a bias is given
  bool grad_x = false, grad_weight = false, grad_bias = false;  // these outputs are wanted
};

// The scratch memory of one call on the cpu backend, in bytes, by part (see above).
struct FusedLinearCrossEntropyWorkspace {
  std::int64_t logits = 0;     // one chunk of logits / their gradient
  std::int64_t per_row = 0;    // per-row loss, lse and upstream gradient
  std::int64_t staging = 0;    // bf16 / f16: fp32 x and grad_x rows, weight block, bias
  std::int64_t grad_bias = 0;  // grad_bias's accumulator
  std::int64_t total() const { return logits + per_row + staging + grad_bias; }
};

// Throws InvalidArgument for a negative size or chunk_rows < 0, DTypeMismatch for a dtype that
// is not floating.
FusedLinearCrossEntropyWorkspace fused_linear_cross_entropy_workspace(
    const FusedLinearCrossEntropyShape& shape);

}  // namespace meshfuse
