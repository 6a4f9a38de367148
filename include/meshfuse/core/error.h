// Error type of meshfuse: one exception class carrying a code, and a check macro.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace meshfuse {

enum class ErrorCode {
  InvalidArgument,
  ShapeMismatch,
  DTypeMismatch,
  DeviceMismatch,
  Unsupported,
  BackendUnavailable,
  CommunicationFailure,
  Timeout,
  OutOfMemory,
  Internal,
};

std::string_view to_string(ErrorCode code);

// Every error meshfuse raises. The message names the op (or component), the argument, what was
// expected and what came; what() prefixes it with the code, e.g. "[shape mismatch] rmsnorm: ...".
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }
  // The message without the "[code] " prefix of what(), for wrapping in another error's message.
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_;
  std::string message_;
};

}  // namespace meshfuse

// fail() and MESHFUSE_CHECK format with fmt, whose compile-time format checks nvcc cannot
// evaluate: .cu files throw Error directly instead.
#ifndef __CUDACC__
#include <fmt/format.h>

namespace meshfuse {

template <typename... Args>
[[noreturn]] void fail(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace meshfuse

// MESHFUSE_CHECK(cond, code, "fmt", args...): throws meshfuse::Error(code, message) when !cond.
#define MESHFUSE_CHECK(cond, code, ...)               \
  do {                                                \
    if (!(cond)) ::meshfuse::fail(code, __VA_ARGS__); \
  } while (false)
#endif  // __CUDACC__
