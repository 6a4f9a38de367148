// The element types' arithmetic shared by the ops' kernels and the communicators' reductions
// (internal, not installed; host code and CUDA code).
#pragma once

#include <string_view>
#include <type_traits>

#include "meshfuse/core/dtype.h"

// A function that both host code and CUDA kernels call.
#ifdef __CUDACC__
#define MESHFUSE_HOST_DEVICE __host__ __device__
#else
#define MESHFUSE_HOST_DEVICE
#endif

namespace meshfuse::detail {

// Throws Error(DTypeMismatch): `op` has no kernel for `dtype` (used by the dispatchers).
[[noreturn]] void fail_dtype(std::string_view op, DType dtype);

// Calls f(T{}) with T the element type of a floating dtype (float, double, bfloat16, float16);
// fail_dtype(op, dtype) for the others.
template <typename F>
decltype(auto) dispatch_float(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::F32:
      return f(float{});
    case DType::F64:
      return f(double{});
    case DType::BF16:
      return f(bfloat16{});
    case DType::F16:
      return f(float16{});
    default:
      fail_dtype(op, dtype);
  }
}

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
