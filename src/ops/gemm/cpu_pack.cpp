// The cpu GEMM's operand packing (cpu_pack.h): rows widened with Highway's loads and streaming
// stores; transposed operands in 16 x 16 tiles whose loops the compiler vectorises for each
// target (gathers along the source's columns).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/gemm/cpu_pack.cpp"
#include "ops/gemm/cpu_pack.h"

#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "ops/common.h"
#include "ops/cpu_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace {

template <typename T>
void widen_rows(const T* base, std::int64_t ld, std::int64_t rows, std::int64_t cols, float* out,
                [[maybe_unused]] bool stream) {
  parallel_if(rows * cols >= kParallelMin, [&] {
#pragma omp for schedule(static) nowait
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* src = base + i * ld;
      float* dst = out + i * cols;
      std::int64_t j = 0;
#if HWY_TARGET != HWY_SCALAR
      const DF d;
      const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
      if (stream && cols % 16 == 0)  // whole aligned lines (scratch is 64-byte aligned)
        for (; j + lanes <= cols; j += lanes) hn::Stream(LoadF(d, src + j), d, dst + j);
#endif
#pragma omp simd
      for (std::int64_t t = j; t < cols; ++t) dst[t] = to_float(src[t]);
    }
    hwy::FlushStream();
  });
}

// The transposed operand in 256 x 256 blocks (their pages fit the TLB) of 16 x 16 tiles.
template <typename T>
void transpose_rows(const T* base, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                    float* out) {
  constexpr std::int64_t kBlock = 256, kTile = 16;
  parallel_if(rows * cols >= kParallelMin, [&] {
#pragma omp for collapse(2) schedule(static)
    for (std::int64_t ib = 0; ib < rows; ib += kBlock)
      for (std::int64_t jb = 0; jb < cols; jb += kBlock)
        for (std::int64_t i0 = ib; i0 < std::min(rows, ib + kBlock); i0 += kTile)
          for (std::int64_t j0 = jb; j0 < std::min(cols, jb + kBlock); j0 += kTile) {
            const std::int64_t ni = std::min(kTile, rows - i0), nj = std::min(kTile, cols - j0);
            const T* src = base + j0 * ld + i0;
            for (std::int64_t i = 0; i < ni; ++i) {
              float* dst = out + (i0 + i) * cols + j0;
#pragma omp simd
              for (std::int64_t j = 0; j < nj; ++j) dst[j] = to_float(src[j * ld + i]);
            }
          }
  });
}

}  // namespace

void PackF32(DType dtype, const void* base, std::int64_t ld, bool transposed, std::int64_t r0,
             std::int64_t rows, std::int64_t c0, std::int64_t cols, float* out, bool stream) {
  dispatch_float(dtype, "gemm", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      const T* b = static_cast<const T*>(base);
      if (transposed)
        transpose_rows(b + c0 * ld + r0, ld, rows, cols, out);
      else
        widen_rows(b + r0 * ld + c0, ld, rows, cols, out, stream);
    }
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(PackF32);

void pack_f32(DType dtype, const void* base, std::int64_t ld, bool transposed, std::int64_t r0,
              std::int64_t rows, std::int64_t c0, std::int64_t cols, float* out, bool stream) {
  HWY_DYNAMIC_DISPATCH(PackF32)(dtype, base, ld, transposed, r0, rows, c0, cols, out, stream);
}

}  // namespace meshfuse::detail::cpu
#endif
