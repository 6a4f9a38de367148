// Fused linear cross-entropy kernel interface shared by the front-end and the backends
// (internal).
#pragma once

#include <cstdint>
#include <string_view>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/ops/fused_linear_cross_entropy.h"

namespace meshfuse::detail {

inline constexpr std::string_view kFusedLinearCrossEntropy = "fused_linear_cross_entropy";

// Contiguous operands of one call, in the memory of the backend's device. bias, grad_loss and the
// gradients may be null (not given / not wanted); loss is always written.
struct FusedLinearCrossEntropyArgs {
  const void* x;            // (N, H)
  const void* weight;       // (V, H)
  const void* bias;         // (V)
  const void* labels;       // (N,), of label_dtype
  const void* grad_loss;    // () or (N,)
  void* loss;               // () or (N,)
  void* grad_x;             // (N, H)
  void* grad_weight;        // (V, H)
  void* grad_bias;          // (V)
  DType loss_dtype;         // loss and grad_loss: the input dtype, or f32 for 16-bit inputs
  DType grad_weight_dtype;  // likewise
  DType grad_bias_dtype;    // likewise
};

// One kernel for both directions: registered as "fused_linear_cross_entropy" (loss only) and
// "fused_linear_cross_entropy_backward" (with gradients).
using FusedLinearCrossEntropyFn = void(const FusedLinearCrossEntropyShape&, DType label_dtype,
                                       const FusedLinearCrossEntropyArgs&,
                                       const CrossEntropyOptions&, const Stream&);

namespace reference {
FusedLinearCrossEntropyFn fused_linear_cross_entropy;
}  // namespace reference

namespace cpu {

// Floats in an fp32 block of weight rows (32 MiB), for 16-bit weights.
inline constexpr std::int64_t kWeightBlockFloats = std::int64_t{1} << 23;

// The cpu kernel's scratch buffers, in elements (0: not allocated). A is the compute type:
// double for f64, float otherwise.
struct FusedLinearCrossEntropyPlan {
  std::int64_t chunk_rows;         // rows per chunk: min(chunk_rows, N)
  std::int64_t weight_block_rows;  // weight rows per GEMM block (all V rows for f32 / f64)
  std::int64_t logits;             // A: chunk_rows x V
  std::int64_t lse;                // double (lse_t<A>): N
  std::int64_t row_loss;           // double: N
  std::int64_t row_grad;           // double: N, for reduction none with gradients
  std::int64_t x_chunk;            // float, 16-bit: chunk_rows x H
  std::int64_t grad_x_chunk;       // float, 16-bit with grad_x: chunk_rows x H
  std::int64_t weight_block;       // float, 16-bit: weight_block_rows x H
  std::int64_t bias;               // float, 16-bit with bias: V
  std::int64_t grad_bias;          // A, with grad_bias: V
};

FusedLinearCrossEntropyPlan plan(const FusedLinearCrossEntropyShape& s,
                                 std::int64_t weight_block_floats = kWeightBlockFloats);

// The registered kernel: the chunked loop of fused_linear_cross_entropy.h with weight blocks of
// kWeightBlockFloats. Labels are checked first (nothing is computed for a bad label).
FusedLinearCrossEntropyFn fused_linear_cross_entropy;
// The same with weight blocks of at most weight_block_floats floats (tests use small blocks to
// cover several).
void fused_linear_cross_entropy_blocked(std::int64_t weight_block_floats,
                                        const FusedLinearCrossEntropyShape& s, DType label_dtype,
                                        const FusedLinearCrossEntropyArgs& args,
                                        const CrossEntropyOptions& options);

}  // namespace cpu

// The chunked loop on device memory with cuBLASLt GEMMs and the cuda cross-entropy row kernels
// (cuda.cu says how it differs from the cpu loop and what scratch it allocates on the stream).
namespace cuda {
FusedLinearCrossEntropyFn fused_linear_cross_entropy;
}  // namespace cuda

}  // namespace meshfuse::detail
