#include "meshfuse/core/device.h"

#include <charconv>

#include "meshfuse/core/error.h"

#ifdef MESHFUSE_WITH_CUDA
#include "core/cuda/runtime.h"
#endif

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

#ifdef MESHFUSE_WITH_CUDA
void detail::check_cuda_device(Device device, std::string_view what) {
  const int count = cuda_device_count();
  MESHFUSE_CHECK(device.index >= 0 && device.index < count, ErrorCode::BackendUnavailable,
                 "{}: no CUDA device {}: this process sees {} CUDA device(s)", what, device.str(),
                 count);
}
#endif

int cuda_device_count() {
#ifdef MESHFUSE_WITH_CUDA
  return detail::cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace meshfuse
