// Pieces of the cuda backend's row-wise kernels, shared by rmsnorm, softmax and cross_entropy
// (internal).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/cuda/cuda_utils.cuh"

namespace meshfuse::detail::cuda {

// W elements of T moved as one access (16 bytes, or one element). 16-bit elements stay in pairs
// in 32-bit words and are taken out only when used: ptxas gives every lone 16-bit value a whole
// register, which would double the registers of a bf16 row.
template <typename T, int W>
struct alignas(sizeof(T) * W) Chunk {
  static constexpr bool kPaired = sizeof(T) == 2 && W % 2 == 0;
  using Word = std::conditional_t<kPaired, unsigned, T>;
  static constexpr int kWords = kPaired ? W / 2 : W;
  Word w[kWords];

  // Element i in the accumulation type (exact).
  __device__ __forceinline__ acc_t<T> operator[](int i) const {
    if constexpr (!kPaired) {
      return load(w[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(i % 2 ? w[i / 2] & 0xffff0000u : w[i / 2] << 16);
    } else {
      __half2 h;
      std::memcpy(&h, &w[i / 2], sizeof(h));
      return i % 2 ? __high2float(h) : __low2float(h);
    }
  }

  // From W accumulator values, each rounded once to T.
  __device__ __forceinline__ static Chunk from(const acc_t<T> (&a)[W]) {
    Chunk c;
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (!kPaired) {
        c.w[i] = store<T>(a[i]);
      } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const __nv_bfloat162 p = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
        std::memcpy(&c.w[i], &p, sizeof(p));
      } else {
        const __half2 p = __floats2half2_rn(a[2 * i], a[2 * i + 1]);
        std::memcpy(&c.w[i], &p, sizeof(p));
      }
    }
    return c;
  }
};

// Blocks for a loop over rows, one row per block at a time.
inline unsigned row_blocks(std::int64_t rows) {
  return static_cast<unsigned>(std::min<std::int64_t>(rows, std::int64_t{1} << 30));
}

}  // namespace meshfuse::detail::cuda
