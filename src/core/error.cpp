#include "meshfuse/core/error.h"

namespace meshfuse {

std::string_view to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidArgument: return "invalid argument";
    case ErrorCode::ShapeMismatch: return "shape mismatch";
    case ErrorCode::DTypeMismatch: return "dtype mismatch";
    case ErrorCode::DeviceMismatch: return "device mismatch";
    case ErrorCode::Unsupported: return "unsupported";
    case ErrorCode::BackendUnavailable: return "backend unavailable";
    case ErrorCode::CommunicationFailure: return "communication failure";
    case ErrorCode::Timeout: return "timeout";
    case ErrorCode::OutOfMemory: return "out of memory";
    case ErrorCode::Internal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(fmt::format("[{}] {}", to_string(code), message)),
      code_(code),
      message_(message) {}

}  // namespace meshfuse
