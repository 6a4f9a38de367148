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

// IEEE binary16, round to nearest even; NaN stays NaN (quietened, top payload bits kept), inf
// stays inf. On Arm64 through __fp16 (fcvt; GCC 12 defines __FLT16_MAX__ there too, but C++ gets
// __fp16, IEEE binary16, converted to and from float in one rounding). Elsewhere in integer
// operations and masks without a branch: GCC 12 converts x86-64's _Float16 one element at a time
// with F16C and through a libgcc call without it, where this form vectorises in the kernels' loops
// (the tests check it against the compiler's conversion for every half and across the floats).
namespace detail {
constexpr std::uint32_t all_ones_if(bool c) { return 0u - static_cast<std::uint32_t>(c); }
}  // namespace detail

inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t magnitude = h & 0x7fffu;
  // A subnormal half is its integer significand times 2^-24, exact in float.
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(
      static_cast<float>(static_cast<std::int32_t>(magnitude)) * 0x1p-24f);
  // Otherwise the exponent rebiased by 127 - 15, inf / NaN's all-ones exponent kept all ones, and a
  // NaN quietened (the rule of F16C and of Arm's fcvt: the payload kept, the quiet bit set).
  const std::uint32_t rebiased = ((magnitude << 13) + 0x38000000u +
                                  (detail::all_ones_if(magnitude >= 0x7c00u) & 0x38000000u)) |
                                 (detail::all_ones_if(magnitude > 0x7c00u) & 0x00400000u);
  const std::uint32_t is_subnormal = detail::all_ones_if(magnitude < 0x400u);
  return std::bit_cast<float>((std::uint32_t{h & 0x8000u} << 16) | (subnormal & is_subnormal) |
                              (rebiased & ~is_subnormal));
}

inline std::uint16_t float_to_half_bits(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t abs = u & 0x7fffffffu;
  // A normal half: the significand rounded at bit 13 (ties to even), the exponent rebiased.
  const std::uint32_t normal = (abs + 0xfffu + ((abs >> 13) & 1u) - 0x38000000u) >> 13;
  // A subnormal half (or zero): |x| * 2^24 rounded to an integer by the float addition of 2^23.
  const std::uint32_t subnormal =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(abs) * 0x1p24f + 0x1p23f) - 0x4b000000u;
  const std::uint32_t nan = 0x7e00u | ((abs >> 13) & 0x3ffu);
  const std::uint32_t is_nan = detail::all_ones_if(abs > 0x7f800000u);
  const std::uint32_t is_inf = detail::all_ones_if(abs >= 0x477ff000u) & ~is_nan;  // >= 65520
  const std::uint32_t is_normal = detail::all_ones_if(abs >= 0x38800000u) & ~(is_nan | is_inf);
  const std::uint32_t is_subnormal = ~(is_nan | is_inf | is_normal);
  return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | (nan & is_nan) | (0x7c00u & is_inf) |
                                    (normal & is_normal) | (subnormal & is_subnormal));
}

#if defined(__aarch64__) && !defined(__CUDACC__)
inline float to_float(float16 x) { return static_cast<float>(std::bit_cast<__fp16>(x.bits)); }
inline float16 to_float16(float x) {
  return {std::bit_cast<std::uint16_t>(static_cast<__fp16>(x))};
}
#else
inline float to_float(float16 x) { return half_bits_to_float(x.bits); }
inline float16 to_float16(float x) { return {float_to_half_bits(x)}; }
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
