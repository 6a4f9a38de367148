// The cpu GEMM's operand packing (internal): blocks of an operand widened and/or transposed to
// row-major f32 for sgemm. Compiled once per SIMD target (cpu_pack.cpp), dispatched at run time.
#pragma once

#include <cstdint>

#include "meshfuse/core/dtype.h"

namespace meshfuse::detail::cpu {

// out[i * cols + j] = element (r0 + i, c0 + j) of the matrix at `base` (f32, bf16 or f16, leading
// dim ld, stored transposed when `transposed`) as f32, for i < rows and j < cols; with streaming
// stores where `stream` (out 64-byte aligned). Runs on the calling OpenMP team when large enough,
// each thread fencing its streaming stores before it returns.
void pack_f32(DType dtype, const void* base, std::int64_t ld, bool transposed, std::int64_t r0,
              std::int64_t rows, std::int64_t c0, std::int64_t cols, float* out, bool stream);

}  // namespace meshfuse::detail::cpu
