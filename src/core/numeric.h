// The element types' arithmetic shared by the ops' kernels and the communicators' reductions
// (internal, not installed; host code and CUDA code).
#pragma once

#include <type_traits>

#include "meshfuse/core/dtype.h"

namespace meshfuse::detail {

// The accumulation type of a kernel on T: double for f64, float for everything else.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Whether T is one of the storage-only 16-bit floats (bf16, f16).
template <typename T>
constexpr bool kSixteenBit = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

// The arithmetic type of kernels that round each f32 output once: double for f32 (and f64), float
// for the 16-bit types, whose outputs round far above f32 arithmetic's error.
template <typename T>
using once_t = std::conditional_t<kSixteenBit<T>, float, double>;

// Stores an accumulator value as T (rounding once for 16-bit types).
template <typename T, typename A>
inline T store_as(A x) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return static_cast<T>(x);
  else
    return from_float<T>(static_cast<float>(x));
}

}  // namespace meshfuse::detail
