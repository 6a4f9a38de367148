#include "meshfuse/core/dtype.h"

#include <cstring>

#include "core/numeric.h"
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

namespace detail {

void fail_dtype(std::string_view op, DType dtype) {
  fail(ErrorCode::DTypeMismatch, "{}: no kernel for dtype {}", op, to_string(dtype));
}

}  // namespace detail

bool is_sixteen_bit(DType dtype) { return dtype == DType::BF16 || dtype == DType::F16; }

bool is_floating_point(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
}

}  // namespace meshfuse
