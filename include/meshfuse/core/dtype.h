// Element types and the f32 <-> bf16 / f16 conversions (round to nearest even, NaN and inf kept).
#pragma once

#include <bit>
#include <cmath>
#include <type_traits>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace meshfuse {

enum class DType { F32, F64, F16, BF16, I32, I64, U8, U32, Bool };

// Size of one element in bytes.
std::size_t element_size(DType dtype);
// "f32", "f64", "f16", "bf16", "i32", "i64", "u8", "u32", "bool".
std::string_view to_string(DType dtype);
// Inverse of to_string; also accepts the PyTorch names "float32", "bfloat16", "float16", ...
std::optional<DType> parse_dtype(std::string_view name);
bool is_floating_point(DType dtype);
// bf16 or f16: the storage-only floats, computed in f32.
bool is_sixteen_bit(DType dtype);

// Storage-only 16-bit floats: arithmetic happens in float after to_float().
struct bfloat16 {
  std::uint16_t bits;
};
struct float16 {
  std::uint16_t bits;
};

// bfloat16 is the top half of an IEEE binary32.
inline float to_float(bfloat16 x) { return std::bit_cast<float>(std::uint32_t{x.bits} << 16); }

// Round to nearest even; NaN stays NaN (quietened, sign kept), inf stays inf.
// (One select on 32-bit values, then one shift: the form the compiler vectorises best.)
inline bfloat16 to_bfloat16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t r =
      (u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : u + 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<std::uint16_t>(r >> 16)};
}

// IEEE binary16. The conversion goes through the compiler's half type where it exists (F16C /
// AVX512-FP16 instructions on x86-64, fcvt on Arm64; round to nearest even); otherwise through the
// bit-exact software path below, which is also what the tests check the hardware path against.
// GCC 12 has _Float16 in C++ on x86-64 only (it defines __FLT16_MAX__ on Arm64 too, where C++ gets
// __fp16: IEEE binary16 there, converted to and from float in one rounding).
float half_bits_to_float_soft(std::uint16_t bits);
std::uint16_t float_to_half_bits_soft(float x);

#if defined(__aarch64__) && !defined(__CUDACC__)
#define MESHFUSE_NATIVE_HALF __fp16
#elif defined(__FLT16_MAX__) && !defined(__CUDACC__)
#define MESHFUSE_NATIVE_HALF _Float16
#endif
#ifdef MESHFUSE_NATIVE_HALF
inline float to_float(float16 x) {
  return static_cast<float>(std::bit_cast<MESHFUSE_NATIVE_HALF>(x.bits));
}
inline float16 to_float16(float x) {
  return {std::bit_cast<std::uint16_t>(static_cast<MESHFUSE_NATIVE_HALF>(x))};
}
#else
inline float to_float(float16 x) { return half_bits_to_float_soft(x.bits); }
inline float16 to_float16(float x) { return {float_to_half_bits_soft(x)}; }
#endif

inline float to_float(float x) { return x; }
inline double to_float(double x) { return x; }

// from_float<T>(float): the store half of a kernel's "load as float, compute, store as T".
template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline double from_float<double>(float x) { return x; }
template <>
inline bfloat16 from_float<bfloat16>(float x) { return to_bfloat16(x); }
template <>
inline float16 from_float<float16>(float x) { return to_float16(x); }

// Rounds a double to float toward zero and sets the last bit when inexact ("round to odd"):
// rounding that float once more to a 16-bit type then equals rounding the double directly.
inline float to_float_round_to_odd(double d) {
  float f = static_cast<float>(d);
  if (!(static_cast<double>(f) != d) || !std::isfinite(f)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
}

// from_double<T>(double): the store of the reference backend, rounded once to T.
template <typename T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, double>)
    return x;
  else if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(x);
  else
    return from_float<T>(to_float_round_to_odd(x));
}

// The DType of a C++ element type.
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<double>() { return DType::F64; }
template <>
constexpr DType dtype_of<float16>() { return DType::F16; }
template <>
constexpr DType dtype_of<bfloat16>() { return DType::BF16; }
template <>
constexpr DType dtype_of<std::int32_t>() { return DType::I32; }
template <>
constexpr DType dtype_of<std::int64_t>() { return DType::I64; }
template <>
constexpr DType dtype_of<std::uint8_t>() { return DType::U8; }
template <>
constexpr DType dtype_of<std::uint32_t>() { return DType::U32; }
template <>
constexpr DType dtype_of<bool>() { return DType::Bool; }

}  // namespace meshfuse
