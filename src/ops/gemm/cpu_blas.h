// The library under the cpu backend's f32 GEMMs (internal; cpu.cpp calls it): Intel MKL's sgemm
// where MKL can be opened (x86-64), else oneDNN's (on Arm64 OpenBLAS's). MKL comes first because
// it is the BLAS that PyTorch's x86-64 wheels compute with: its K loop sums closer to the exact
// product than oneDNN's sgemm, and meshfuse's error is held to PyTorch's. On AMD CPUs, where MKL
// takes its generic path, that costs time against oneDNN's AVX-512 kernels (figures:
// docs/kernels/gemm.md); MESHFUSE_CPU_BLAS=onednn chooses speed there. MKL is opened at
// run time, not linked: it is an optional, large install (the PyPI wheel `mkl`, or oneAPI), and a
// build must run where it is absent.
#pragma once

#include <string>

namespace meshfuse::detail::cpu {

// MKL's CBLAS sgemm with 64-bit sizes (cblas_sgemm_64): d (m x n) = alpha * op(a) @ op(b) +
// beta * d, layout and transposes as CBLAS's enum values.
inline constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;
using MklSgemm = void (*)(int layout, int trans_a, int trans_b, long long m, long long n,
                          long long k, float alpha, const float* a, long long lda, const float* b,
                          long long ldb, float beta, float* d, long long ldd);

// MKL's sgemm when MKL is the library in use, null when oneDNN's (or OpenBLAS's) is. The choice is
// made at the first call and kept: MESHFUSE_CPU_BLAS=mkl or onednn pins it (any case); unset, MKL
// if it opens, else oneDNN. MKL is libmkl_rt.so.3 as the loader finds it, else the file found at
// build time; MESHFUSE_MKL_LIBRARY names another. Its threads are GNU OpenMP's, as meshfuse's.
// Throws Error(BackendUnavailable) when MESHFUSE_CPU_BLAS=mkl and MKL cannot be opened (tried
// again by the next call), Error(InvalidArgument) for another value of the variable.
MklSgemm mkl_sgemm();

// The library in use, as "Intel MKL 2026.2.1 (file)" or "oneDNN 2.6.3"; throws as mkl_sgemm.
std::string cpu_blas_library();

}  // namespace meshfuse::detail::cpu
