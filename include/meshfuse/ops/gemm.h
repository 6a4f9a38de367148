// GEMM family: gemm, bmm, linear (forward and backward).
//
//   gemm:   D = alpha * op(A) @ op(B) + beta * C,   op(X) = X or X^T (transpose_a / transpose_b)
//           A: (M, K), or (K, M) when transpose_a; B: (K, N), or (N, K) when transpose_b;
//           C (optional): (M, N); D: (M, N).
//   bmm:    the same for each l of a batch: A (L, M, K) or (L, K, M), B (L, K, N) or (L, N, K),
//           C (optional) and D (L, M, N).
//   linear: out = x @ weight^T + bias, like torch.nn.functional.linear;
//           x (..., K), weight (N, K), bias (N) optional, out (..., N).
//
// BLAS semantics for the scalars, like cuBLAS and torch.addmm: beta = 0 means C is not read (NaN
// or inf in C do not propagate), alpha = 0 or K = 0 means A and B are not read (D = beta * C, or
// zeros without C). beta must be 0 when C is absent. D may be C itself (in place); any other
// overlap of an output with an operand is InvalidArgument.
//
// linear_backward, with dy = grad_out and the leading dims of x flattened into R rows:
//   grad_x = dy @ weight                      (..., K)
//   grad_weight = dy^T @ x, summed over rows  (N, K)
//   grad_bias = sum of dy over rows           (N)
// Each gradient output is optional (an undefined view is not computed).
//
// dtypes: all tensors of a call share one: f32, f64, bf16 or f16, except that bf16 / f16
// operands may have an f32 output (gemm/bmm's d, and then c; linear's out, with a bias of x's
// dtype, widened, or of f32): the fp32 accumulation unrounded, as torch.mm's
// out_dtype=torch.float32 gives it (fused linear cross-entropy's logits on a vocabulary shard take
// it). 16-bit types are stored as 16-bit, multiplied and accumulated in fp32 and rounded once; f64
// accumulates in f64. alpha and beta * C meet the accumulated product once (D = alpha * sum + beta
// * C in the accumulator's type, then one rounding to D's dtype), as in cuBLAS and torch: never
// inside the sums. The `reference` backend accumulates in double. linear's grad_bias (a column sum,
// ours on both backends) is summed in double and rounded once. Results are deterministic for a
// fixed thread count (cpu) or GPU model (cuda). The cpu backend runs f32, bf16 and f16 on one sgemm
// (Intel MKL's where installed, else oneDNN's: cpu_blas_library) with both operands row-major f32
// (16-bit ones widened, in blocks of bounded size), and f64 on OpenBLAS's dgemm:
// bench/blas_choice.cpp measures why these libraries, src/ops/gemm/cpu.cpp why one layout. The cuda
// backend runs every dtype on cuBLASLt (fp32 accumulation without TF32 for f32, bf16 and f16; f64
// in f64), linear's bias in cuBLASLt's bias epilogue, and grad_bias as a fixed-order column sum
// (src/ops/gemm/cuda.cu).
//
// Inputs may be strided views: a transposed view (unit stride along rows) is read in place (the
// cuda backend and f64 pass it to the BLAS as a transposed operand; the cpu backend's f32 and
// 16-bit GEMMs transpose it block by block on the way to sgemm); other layouts are copied once.
// A view gives bitwise the result of its contiguous copy. Outputs are contiguous and preallocated
// by the caller.
//
// Errors: DTypeMismatch (dtypes differ other than as above, or not floating), ShapeMismatch (inner
// dims, batch or output shapes disagree; the message names both shapes), InvalidArgument (wrong
// rank, beta != 0 without C, output not contiguous or partly overlapping an operand),
// DeviceMismatch, Unsupported / BackendUnavailable (see kernel_backend.h).
#pragma once

#include <string>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

struct GemmOptions {
  bool transpose_a = false;
  bool transpose_b = false;
  double alpha = 1.0;
  double beta = 0.0;
};

// a, b: 2-D; c: (M, N) or undefined; d: (M, N).
void gemm(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& d,
          const GemmOptions& options = {}, const Stream& stream = {});

// a, b: 3-D with equal batch L; c: (L, M, N) or undefined; d: (L, M, N).
void bmm(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& d,
         const GemmOptions& options = {}, const Stream& stream = {});

// x: (..., K) with at least 1 dim; weight: (N, K); bias: (N) or undefined; out: (..., N).
void linear(const TensorView& x, const TensorView& weight, const TensorView& bias,
            const TensorView& out, const Stream& stream = {});

// grad_out: (..., N); x: (..., K); weight: (N, K); writes grad_x (..., K), grad_weight (N, K) and
// grad_bias (N), each optional.
void linear_backward(const TensorView& grad_out, const TensorView& x, const TensorView& weight,
                     const TensorView& grad_x, const TensorView& grad_weight,
                     const TensorView& grad_bias, const Stream& stream = {});

// The cuBLASLt that the cuda backend's GEMMs run on, as "cuBLASLt 13.0.2 (file)", opened now if it
// is not yet. It is opened at first use, not linked: libcublasLt.so.<CUDA major of the build> as
// the loader finds it (the copy already in the process, e.g. PyTorch's, if there is one), else the
// file found at build time; MESHFUSE_CUBLASLT_LIBRARY names another file. Needs no GPU.
// Throws Error(BackendUnavailable) in a build without CUDA, or when the library cannot be loaded,
// lacks a function, or has another major version than the build's.
std::string cublaslt_library();

// The library that the cpu backend's f32, bf16 and f16 GEMMs run on (their fp32 sums), as
// "Intel MKL 2026.2 (file), GNU OpenMP threads" or "oneDNN 2.6.3" ("OpenBLAS" on Arm64), chosen
// now if it is not yet. On x86-64 Intel MKL when it can be opened (PyTorch's BLAS: the same
// accuracy), else oneDNN. MKL is opened at first use, not linked: libmkl_rt.so.3 as the loader
// finds it, else the file found at build time (e.g. under the Python prefix of PyPI's `mkl`
// wheel); MESHFUSE_MKL_LIBRARY names another file (and so asks for MKL), MESHFUSE_CPU_BLAS=
// mkl|onednn pins one library. MKL's threads are GNU OpenMP's, as meshfuse's own loops, unless
// MKL_THREADING_LAYER says otherwise.
// Throws Error(BackendUnavailable) when MKL is asked for and cannot be opened, and
// Error(InvalidArgument) for another value of MESHFUSE_CPU_BLAS; so do the f32, bf16 and f16 cpu
// GEMMs on x86-64 then (f64 runs on OpenBLAS whatever the variables say).
std::string cpu_blas_library();

}  // namespace meshfuse
