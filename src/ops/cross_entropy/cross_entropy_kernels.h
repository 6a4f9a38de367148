// Cross-entropy kernel interface shared by the front-end, the backends and the ops built on
// cross-entropy (fused linear cross-entropy) (internal).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>
#include <vector>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/ops/cross_entropy.h"

namespace meshfuse::detail {

// logits (rows, vocab) contiguous, labels (rows,) contiguous.
struct CrossEntropyShape {
  DType dtype;        // logits, grad_logits
  DType loss_dtype;   // loss (forward), grad_loss (backward): dtype, or F32 for 16-bit logits
  DType label_dtype;  // I32 or I64
  std::int64_t rows;
  std::int64_t vocab;  // the logits' columns: a shard's width when the options name one
};

// lse's element type for logits of element type T (either backend's 16-bit types are 2 bytes), as
// cross_entropy_lse_dtype: the backwards take p = e^(v - lse) from it, and an f32 lse of 10 to 20
// is off by up to 2^-21, an error that every p of the row takes whole (above PyTorch's own for f32
// logits; far below a 16-bit gradient's rounding).
template <typename T>
using lse_t = std::conditional_t<sizeof(T) == 2, float, double>;

// The classes of the whole vocabulary, which labels range over and label smoothing divides by:
// options.vocab_size for a shard, else the logits' vocab.
inline std::int64_t vocab_classes(const CrossEntropyOptions& o, std::int64_t vocab) {
  return o.vocab_size != 0 ? o.vocab_size : vocab;
}

// The whole op, as registered in the KernelTables. loss: () or (rows,) per options.reduction.
using CrossEntropyForwardFn = void(const CrossEntropyShape&, const void* logits, const void* labels,
                                   void* loss, void* lse, const CrossEntropyOptions&,
                                   const Stream&);
using CrossEntropyBackwardFn = void(const CrossEntropyShape&, const void* grad_loss,
                                    const void* logits, const void* labels, const void* lse,
                                    void* grad_logits, const CrossEntropyOptions&, const Stream&);

// Host-side helpers of the CPU-memory backends (reference, cpu), in cross_entropy.cpp.
//
// Scans the labels in row order (one thread: the first bad row is the one reported) and throws
// InvalidArgument naming `op`, the row and the value of the first label outside
// [0, vocab_classes) that is not options.ignore_index. Returns the number of rows not ignored.
// Call it before any other work.
std::int64_t check_labels(std::string_view op, const CrossEntropyShape& s, const void* labels,
                          const CrossEntropyOptions& options);
// Throws the InvalidArgument of check_labels for labels[row] = label (every backend's message).
[[noreturn]] void fail_label(std::string_view op, std::int64_t classes, std::int64_t row,
                             std::int64_t label, std::int64_t ignore_index);
// Writes the loss output from per-row losses (0 at ignored rows): row_loss itself for none,
// its sum in row order for sum, that sum / count for mean (NaN when count is 0).
void store_loss(const CrossEntropyShape& s, const std::vector<double>& row_loss, std::int64_t count,
                Reduction reduction, void* loss);

// The upstream gradient of row i's loss: scale * row_grad[i], or scale when row_grad is null.
struct CrossEntropyUpstream {
  double scale;
  const double* row_grad;  // indexed by the global row; null for mean and sum
};
// Reads grad_loss as an upstream: for none, row_grad_storage receives grad_loss in double; for
// sum the scale is grad_loss; for mean grad_loss / count (0 when count is 0, so that every
// gradient is zero rather than NaN).
CrossEntropyUpstream read_upstream(const CrossEntropyShape& s, const void* grad_loss,
                                   std::int64_t count, Reduction reduction,
                                   std::vector<double>& row_grad_storage);

// A block of rows [row_begin, row_begin + rows) of an (N, vocab) cross-entropy problem.
// Block-local: logits and grad_logits point at the block's first row (rows x vocab,
// contiguous). Global (indexed by row_begin + i): labels, lse, row_loss and the upstream's
// row_grad, all of length N. This lets an op that computes logits a chunk of rows at a time
// (fused linear cross-entropy) run the loss and its gradient on each chunk it holds.
struct CrossEntropyRows {
  DType dtype;  // of the block's logits and grad_logits (lse is cross_entropy_lse_dtype(dtype))
  DType label_dtype;
  std::int64_t row_begin;
  std::int64_t rows;
  std::int64_t vocab;  // the logits' columns: a shard's width when the options name one
};

namespace reference {
CrossEntropyForwardFn cross_entropy_forward;
CrossEntropyBackwardFn cross_entropy_backward;
}  // namespace reference

namespace cpu {
CrossEntropyForwardFn cross_entropy_forward;
CrossEntropyBackwardFn cross_entropy_backward;

// The cpu row-block kernels behind the two above (OpenMP over the block's rows, vectorised over
// the vocabulary). Labels must have passed check_labels. Neither reads an ignored row's logits.
//
// Forward: writes lse[g] (unless lse is null) and row_loss[g] (the unreduced loss_i of
// cross_entropy.h in double; 0 and lse 0 for ignored rows) for every global row g of the block.
void cross_entropy_forward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                void* lse, double* row_loss, const CrossEntropyOptions& options);
// Backward: writes the block's grad_logits from its logits, labels and saved lse (zero rows for
// ignored labels). grad_logits may be the logits buffer itself (each element is read before it
// is overwritten), so a chunk of logits can be turned into its gradient in place.
void cross_entropy_backward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                 const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                                 const CrossEntropyOptions& options);
}  // namespace cpu

namespace cuda {
CrossEntropyForwardFn cross_entropy_forward;
CrossEntropyBackwardFn cross_entropy_backward;

// The cuda versions of the helpers and row-block kernels above, on device memory and queued on
// `stream` (labels, lse, row_loss, row_grad, logits and grad_logits are device pointers).
//
// check_labels: the same checks and message; one block scans the labels on the device and writes
// its verdict (first bad row and its label, the count of rows not ignored) into the returned
// device tensor, which store_loss and read_upstream read for mean. Then the op's only host round
// trip: a wait for that block alone, so that the error is raised by the op call itself. With
// LabelCheck::DeviceAssert, under CUDA graph capture and for no rows there is no wait: a bad label
// prints the error and traps the kernel there (the context is lost, as after PyTorch's device-side
// assert).
Tensor check_labels(std::string_view op, const CrossEntropyShape& s, const void* labels,
                    const CrossEntropyOptions& options, const Stream& stream);
// store_loss: row_loss (rows doubles) converted for none; for mean and sum one block sums it in
// a fixed order, in double (mean: over the verdict's count).
void store_loss(const CrossEntropyShape& s, const double* row_loss, const Tensor& verdict,
                Reduction reduction, void* loss, const Stream& stream);
// read_upstream: grad_loss (device, the loss's shape) as a CrossEntropyUpstream of scale 1 whose
// row_grad (never null here) is row_grad_storage, a device buffer of rows doubles it allocates:
// grad_loss per row for none, grad_loss broadcast for mean and sum, times 1 / the verdict's count
// for mean (0 when the count is 0).
CrossEntropyUpstream read_upstream(const CrossEntropyShape& s, const void* grad_loss,
                                   const Tensor& verdict, Reduction reduction,
                                   Tensor& row_grad_storage, const Stream& stream);
// The row-block kernels: the cpu ones' contract, plus the stream. One block per row; the forward
// reads a row's logits once, the backward reads them once and writes the gradient (in place
// when grad_logits == logits).
void cross_entropy_forward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                void* lse, double* row_loss, const CrossEntropyOptions& options,
                                const Stream& stream);
void cross_entropy_backward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                 const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                                 const CrossEntropyOptions& options, const Stream& stream);
}  // namespace cuda

}  // namespace meshfuse::detail
