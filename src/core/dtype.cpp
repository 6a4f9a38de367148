#include "meshfuse/core/dtype.h"

#include <cstring>

#include "meshfuse/core/error.h"

namespace meshfuse {

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
    case DType::U32:
      return 4;
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::U8:
    case DType::Bool:
      return 1;
  }
  fail(ErrorCode::Internal, "element_size: unknown dtype {}", static_cast<int>(dtype));
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::U32: return "u32";
    case DType::Bool: return "bool";
  }
  return "unknown";
}

std::optional<DType> parse_dtype(std::string_view name) {
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"f32", DType::F32},     {"float32", DType::F32}, {"float", DType::F32},
      {"f64", DType::F64},     {"float64", DType::F64}, {"double", DType::F64},
      {"f16", DType::F16},     {"float16", DType::F16}, {"half", DType::F16},
      {"bf16", DType::BF16},   {"bfloat16", DType::BF16}, {"i32", DType::I32},
      {"int32", DType::I32},   {"i64", DType::I64},     {"int64", DType::I64},
      {"u8", DType::U8},       {"uint8", DType::U8},    {"u32", DType::U32},
      {"uint32", DType::U32},  {"bool", DType::Bool},
  };
  for (const Alias& a : kAliases)
    if (a.name == name) return a.dtype;
  return std::nullopt;
}

bool is_sixteen_bit(DType dtype) { return dtype == DType::BF16 || dtype == DType::F16; }

bool is_floating_point(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
}

float half_bits_to_float_soft(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1f) {  // inf or NaN: keep the payload
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    bits = sign | (static_cast<std::uint32_t>(e) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t float_to_half_bits_soft(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)  // NaN: quiet it, keep the top payload bits
    return sign | 0x7e00u | static_cast<std::uint16_t>((abs >> 13) & 0x3ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs >= 0x38800000u) {                       // normal half
    const std::uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return sign | static_cast<std::uint16_t>((rounded - 0x38000000u) >> 13);
  }
  // Subnormal half (or zero): value = m * 2^-24 with m the rounded integer below.
  const float magnitude = std::bit_cast<float>(abs);
  const float scaled = magnitude * 16777216.0f;  // exact: power of two
  // Round to nearest even through the float's own rounding at 2^23 (exact for scaled < 2^10).
  const float r = (scaled + 8388608.0f) - 8388608.0f;
  return sign | static_cast<std::uint16_t>(r);
}

}  // namespace meshfuse
