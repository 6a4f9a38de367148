// GEMM kernel interface shared by the front-end and the backends (internal).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "ops/common.h"

namespace meshfuse::detail {

// A batch of matrices as a BLAS sees them. Element (l, r, c) of the logical matrix is at
//   data + l*batch_stride + r*ld + c   (transposed = false: row-major storage)
//   data + l*batch_stride + c*ld + r   (transposed = true: the storage is the transpose)
// elements. ld >= the stored row length, except that ld = 0 (and batch_stride = 0) broadcast one
// row (or matrix), which only C uses.
struct GemmMatrix {
  void* data = nullptr;
  std::int64_t ld = 0;
  std::int64_t batch_stride = 0;
  bool transposed = false;
};

// Offset in elements of element (l, r, c) of x; int64, as operands may pass 2^31 elements. The
// CUDA kernels call it too.
MESHFUSE_HOST_DEVICE inline std::int64_t offset(const GemmMatrix& x, std::int64_t l, std::int64_t r,
                                                std::int64_t c) {
  return l * x.batch_stride + (x.transposed ? c * x.ld + r : r * x.ld + c);
}

// D[l] = alpha * A[l] @ B[l] + beta * C[l] for l < batch; A[l]: (m, k), B[l]: (k, n), C[l] and
// D[l]: (m, n). C.data == nullptr means no C (beta is then 0). D is row-major (not transposed); C
// may be D itself. alpha == 0 or k == 0: A and B are not read; beta == 0: C is not read. `op` is
// the public op, for error messages. out_dtype: C and D's dtype when it differs from A and B's,
// for bf16 / f16 operands with an f32 output (the fp32 accumulation unrounded: gemm's `d` or
// linear's `out` of f32, fused linear cross-entropy's logits).
struct GemmProblem {
  DType dtype;
  std::int64_t batch, m, n, k;
  double alpha, beta;
  const char* op = "gemm";
  std::optional<DType> out_dtype = std::nullopt;
  DType out() const { return out_dtype.value_or(dtype); }
};

// Calls f(T{}, O{}) with T the operands' type and O the output's: O = T, or float for 16-bit T.
template <typename F>
void dispatch_gemm(const GemmProblem& p, F&& f) {
  dispatch_float(p.dtype, p.op, [&](auto tag) {
    using T = decltype(tag);
    if (p.out() == p.dtype) return f(T{}, T{});
    if constexpr (sizeof(T) == 2) {
      if (p.out() == DType::F32) return f(T{}, float{});
    }
    throw Error(ErrorCode::Internal, std::string(p.op) + ": no " + std::string(to_string(p.dtype)) +
                                         " product with a " + std::string(to_string(p.out())) +
                                         " output");
  });
}

using GemmFn = void(const GemmProblem&, GemmMatrix a, GemmMatrix b, GemmMatrix c, GemmMatrix d,
                    const Stream&);

// out[j] = sum over i < rows of x(i, j), for j < cols; summed in double (in row order in the
// reference and cpu backends, in fixed row blocks on cuda), rounded once. x.batch_stride is
// unused.
using ColumnSumFn = void(DType, std::int64_t rows, std::int64_t cols, GemmMatrix x, void* out,
                         const Stream&);

// linear_backward's kernels: its GEMMs (grad_x, grad_weight) and the bias gradient.
struct LinearBackwardKernels {
  GemmFn* gemm;
  ColumnSumFn* column_sum;
};

namespace reference {
GemmFn gemm;
ColumnSumFn column_sum;
inline constexpr LinearBackwardKernels linear_backward{&gemm, &column_sum};
}  // namespace reference

namespace cpu {
GemmFn gemm;
// gemm for callers whose operands always come in the same layouts (fused linear cross-entropy's
// contiguous chunks), for whom gemm's copies into one layout buy nothing: f32 runs on oneDNN's
// matmul primitive as stored (faster than sgemm, MKL's too, at that op's skinny products, and no
// copy of the weight), a K of 1024 or more summed as two halves added once (cpu.cpp);
// other dtypes as gemm.
GemmFn gemm_fixed_layout;
ColumnSumFn column_sum;
inline constexpr LinearBackwardKernels linear_backward{&gemm, &column_sum};
}  // namespace cpu

// cuBLASLt for the GEMMs, a deterministic two-pass kernel for column_sum (cuda.cu says more).
namespace cuda {
GemmFn gemm;
ColumnSumFn column_sum;
inline constexpr LinearBackwardKernels linear_backward{&gemm, &column_sum};
std::string cublaslt_library();  // meshfuse::cublaslt_library in CUDA builds
}  // namespace cuda

}  // namespace meshfuse::detail
