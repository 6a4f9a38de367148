// Cross-entropy loss over a vocabulary, with the options of torch.nn.functional.cross_entropy
// plus a logits multiplier and the z-loss of PaLM (Chowdhery et al. 2022, arXiv:2204.02311).
//
// For row i with label y_i that is not ignore_index, v = m * logits[i, :], V the vocabulary,
// eps = label_smoothing, z = z_loss_scale:
//   lse_i  = log sum_j exp(v_j)
//   loss_i = (1 - eps) * (lse_i - v_{y_i}) + eps * (lse_i - mean_j v_j) + z * lse_i^2
// (the eps term is PyTorch's eps * mean_j(-log p_j); the z term is added only when z != 0).
// Rows whose label is ignore_index have loss 0 and are left out of the reduction:
//   none: loss[i] = loss_i (0 for ignored rows)
//   sum:  sum_i loss_i (0 if all rows are ignored)
//   mean: sum_i loss_i / (number of rows not ignored) (NaN if all rows are ignored, as PyTorch)
// These are PyTorch's values for the shared arguments (reduction, ignore_index,
// label_smoothing; no class weights). The mean and sum are summed in double in a fixed order
// (row order on the cpu, a fixed tree on cuda), so results are bitwise repeatable.
//
// Backward, with g_i the upstream gradient of loss_i (grad_loss[i] for none, grad_loss for sum,
// grad_loss / count for mean), p_j = exp(v_j - lse_i):
//   dlogits[i, j] = g_i * m * (p_j * (1 + 2 z lse_i) - eps / V - (1 - eps) * [j == y_i])
// and 0 for ignored rows; with every row ignored, mean gives an all-zero gradient (not NaN).
//
// Vocabulary shards (the building block of Megatron-LM's vocabulary-parallel cross-entropy):
// with options.vocab_size != 0 the logits hold the columns [vocab_start, vocab_start + V) of a
// vocabulary of vocab_size classes (0 <= vocab_start, vocab_start + V <= vocab_size). Labels are
// then classes of the whole vocabulary, in [0, vocab_size) or ignore_index; label y is *here* when
// vocab_start <= y < vocab_start + V, at column y - vocab_start. Above, V stays the shard's width
// in lse_i and the sums over j, while:
//   - v_{y_i} is 0 when y_i is not here (the term -(1 - eps) * v_{y_i} belongs to one shard);
//   - mean_j v_j becomes (sum_j v_j) / vocab_size (this shard's part of the whole mean);
//   - the backward's eps / V becomes eps / vocab_size, and rows whose label is not here get no
//     (1 - eps) * [j == y_i] term.
// The per-shard lse_i and loss_i combine, per row, into the whole vocabulary's:
//   lse_i  = log sum_s exp(lse_{s,i})                     (logsumexp over the shards)
//   loss_i = lse_i + z * lse_i^2 - sum_s (lse_{s,i} + z * lse_{s,i}^2 - loss_{s,i})
// (each shard's lse + z lse^2 - loss is its (1 - eps) v_{y_i} + eps sum_j v_j / vocab_size, which
// add up over the shards), i.e. loss_i = lse_i - sum_s (lse_{s,i} - loss_{s,i}) when z = 0; run the
// shards with reduction none to combine. Where a shard has no mass in a row (no columns, or all
// of them -inf, as a padded vocabulary's masked columns) its lse is -inf and its loss -inf or NaN,
// so its term lse + z lse^2 - loss is NaN as computed: take it from its definition instead, 0
// unless the label is here or label smoothing is on (with no columns always 0), -inf (the row's
// loss +inf, as the whole vocabulary gives) otherwise. The backward of a
// shard takes the whole vocabulary's lse_i (not the shard's): its gradient is then the shard's
// columns of the whole problem's. Its mean divides by the rows of this call not ignored, as above;
// for a mean over rows that the caller splits otherwise, pass reduction sum and grad_loss scaled by
// 1 / (global count). fused_linear_cross_entropy takes no shard (InvalidArgument).
//
// Non-finite logits: a row entirely -inf, or with a NaN or +inf, has a NaN loss (as PyTorch);
// a -inf logit among finite ones has p = 0 (with label smoothing the loss is +inf, as PyTorch).
// An infinite upstream gradient gives dlogits of +-inf by the sign of the bracket above (NaN where
// it is exactly 0), as the formula evaluated as written.
// Ignored rows never read their logits.
//
// Dtypes: logits and grad_logits share one dtype, f32, f64, bf16 or f16 (16-bit computed in fp32,
// rounded once); loss and grad_loss have it too or, for bf16 / f16 logits, f32 (an fp32 loss as
// Megatron-LM returns it, for training loops that log and sum losses in fp32; each output is
// rounded once from the double per-row losses); labels are i32 or i64; lse is f32 for 16-bit
// logits and f64 for f32 and f64 ones (the backward's p = exp(v - lse) would take an f32 lse's
// rounding whole: up to 2^-21 relative for an lse of 10 to 20; cross_entropy_lse_dtype). Inputs
// may be strided; outputs are contiguous and preallocated by the caller.
// Errors: InvalidArgument for a label outside [0, V) (for a shard [0, vocab_size)) that is not
// ignore_index (the message names the first such row and its value; nothing is computed; on
// CUDA with LabelCheck::DeviceAssert a device-side assert instead),
// label_smoothing outside [0, 1], a shard outside its vocabulary, a wrong rank, a
// non-contiguous output or one sharing an operand's memory (but grad_logits may be logits
// itself, in place); ShapeMismatch, DTypeMismatch, DeviceMismatch,
// Unsupported / BackendUnavailable (see kernel_backend.h).
#pragma once

#include <cstdint>
#include <string_view>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// How per-row losses are reduced (torch's `reduction`).
enum class Reduction { None, Mean, Sum };

// "none", "mean", "sum".
std::string_view to_string(Reduction reduction);
// Inverse of to_string (case-insensitive); Error(InvalidArgument) listing the names otherwise.
Reduction parse_reduction(std::string_view name);

// How a label outside [0, V) that is not ignore_index fails on CUDA, where the labels live on the
// device. The reference and cpu backends read them on the host, at no cost, and always raise.
enum class LabelCheck {
  // The call raises InvalidArgument naming the first such row and its value, with nothing
  // written: the host waits for the device's check of the labels (queued behind the work before
  // the call), a launch-to-completion round trip per call.
  Raise,
  // No host wait (PyTorch's behaviour, and what CUDA graph capture always gets): the kernel
  // prints the message for a bad row (not necessarily the first) and traps, a device-side assert
  // after which the process's CUDA context is unusable.
  DeviceAssert,
};

// "raise", "device_assert".
std::string_view to_string(LabelCheck check);
// Inverse of to_string (case-insensitive); Error(InvalidArgument) listing the names otherwise.
LabelCheck parse_label_check(std::string_view name);

// Options of cross_entropy (and of the ops built on it, such as fused linear cross-entropy).
struct CrossEntropyOptions {
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double label_smoothing = 0.0;    // eps in [0, 1]
  double logits_multiplier = 1.0;  // m (finite): the loss is computed on m * logits
  double z_loss_scale = 0.0;       // z >= 0: adds z * lse^2 per row not ignored
  // A vocabulary shard (see above): the logits hold columns [vocab_start, vocab_start + V) of a
  // vocabulary of vocab_size classes; vocab_size 0: V, the logits are the whole vocabulary.
  std::int64_t vocab_start = 0;
  std::int64_t vocab_size = 0;
  LabelCheck label_check = LabelCheck::Raise;  // on CUDA (see LabelCheck)
};

// The dtype of lse for logits of `logits` dtype: F32 for BF16 / F16, F64 for F32 and F64.
constexpr DType cross_entropy_lse_dtype(DType logits) {
  return logits == DType::BF16 || logits == DType::F16 ? DType::F32 : DType::F64;
}

// logits: (N, V); labels: (N,) i32/i64.
// Writes loss: () for mean and sum, (N,) for none, dtype of logits or f32; and lse: (N,), the
// log-sum-exp of each row of m * logits, saved for the backward (0 for ignored rows), or nothing
// when lse is undefined (inference: no backward to save it for).
void cross_entropy(const TensorView& logits, const TensorView& labels, const TensorView& loss,
                   const TensorView& lse, const CrossEntropyOptions& options = {},
                   const Stream& stream = {});

// grad_loss: the shape of the forward's loss, the dtype of the logits or f32 for 16-bit logits;
// logits, labels, lse and options as given to (or written by) the forward. Writes grad_logits:
// (N, V), dtype of logits.
void cross_entropy_backward(const TensorView& grad_loss, const TensorView& logits,
                            const TensorView& labels, const TensorView& lse,
                            const TensorView& grad_logits, const CrossEntropyOptions& options = {},
                            const Stream& stream = {});

}  // namespace meshfuse
