// The yardstick of the GEMM cases: the vendor library's own f32 GEMM at the same shape, called
// directly. It is the library the cpu backend's GEMM runs on (Intel MKL where installed, else
// oneDNN: see src/ops/gemm/cpu_blas.h; its 16-bit GEMMs widen to this same f32 GEMM), so "ours /
// vendor" is what the backend keeps of it.
#pragma once

#include <cstdint>
#include <string>

namespace meshfuse::cli {

// What vendor_sgemm calls, for the output's notes: "Intel MKL 2026.2 sgemm (f32)" or
// "oneDNN 2.6.3 sgemm (f32)".
std::string vendor_gemm();

// c (m x n) = op(a) @ op(b), row-major: op(a) is m x k (a is k x m when transpose_a), op(b) is
// k x n (b is n x k when transpose_b).
void vendor_sgemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
                  std::int64_t k, const float* a, const float* b, float* c);

}  // namespace meshfuse::cli
