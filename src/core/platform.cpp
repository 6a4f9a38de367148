#include "meshfuse/core/platform.h"

namespace meshfuse {

// MESHFUSE_VERSION and MESHFUSE_BUILD_INFO are set on the library target by CMake.
std::string_view version() { return MESHFUSE_VERSION; }

std::string_view build_info() { return MESHFUSE_BUILD_INFO; }

bool built_with_cuda() {
#ifdef MESHFUSE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<Device> available_devices() {
  std::vector<Device> devices = {Device{DeviceType::CPU, 0}};
  for (int i = 0; i < cuda_device_count(); ++i) devices.push_back({DeviceType::CUDA, i});
  return devices;
}

}  // namespace meshfuse
