// Parsing the names of meshfuse's enums (internal): one rule for all of them, case-insensitive,
// and one error that lists the valid names.
#pragma once

#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>

#include "meshfuse/core/error.h"

namespace meshfuse::detail {

inline bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

// "a, b, c": the to_string names of `all`, in order.
template <typename E, std::size_t N>
std::string names_of(const E (&all)[N]) {
  std::string s;
  for (E e : all) {
    if (!s.empty()) s += ", ";
    s += to_string(e);
  }
  return s;
}

// The value of `all` whose to_string is `name` in any case. InvalidArgument otherwise:
// "<what>: unknown name '<name>' (expected one of a, b, c)".
template <typename E, std::size_t N>
E parse_name(std::string_view what, std::string_view name, const E (&all)[N]) {
  for (E e : all)
    if (equal_ignoring_case(to_string(e), name)) return e;
  fail(ErrorCode::InvalidArgument, "{}: unknown name '{}' (expected one of {})", what, name,
       names_of(all));
}

}  // namespace meshfuse::detail
