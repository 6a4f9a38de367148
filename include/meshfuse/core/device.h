// Where a tensor lives.
#pragma once

#include <string>
#include <string_view>

namespace meshfuse {

enum class DeviceType { CPU, CUDA };

std::string_view to_string(DeviceType type);

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  bool operator==(const Device&) const = default;
  // "cpu" or "cuda:<index>".
  std::string str() const;
  // Parses "cpu", "cuda" (index 0) or "cuda:N"; throws Error(InvalidArgument) otherwise.
  static Device parse(std::string_view text);
};

// Number of CUDA devices this process can use: 0 in builds without CUDA, or when no driver or
// device is present.
int cuda_device_count();

}  // namespace meshfuse
