#include "meshfuse/core/device.h"

#include <charconv>

#include "meshfuse/core/error.h"

namespace meshfuse {

std::string_view to_string(DeviceType type) {
  return type == DeviceType::CPU ? "cpu" : "cuda";
}

std::string Device::str() const {
  return type == DeviceType::CPU ? "cpu" : fmt::format("cuda:{}", index);
}

Device Device::parse(std::string_view text) {
  if (text == "cpu") return {DeviceType::CPU, 0};
  if (text == "cuda") return {DeviceType::CUDA, 0};
  if (text.starts_with("cuda:")) {
    const std::string_view digits = text.substr(5);
    int index = -1;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc() && end == digits.data() + digits.size() && index >= 0)
      return {DeviceType::CUDA, index};
  }
  fail(ErrorCode::InvalidArgument, "device: expected 'cpu', 'cuda' or 'cuda:N', got '{}'", text);
}

}  // namespace meshfuse
