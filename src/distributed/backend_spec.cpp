// BackendSpec: the backend of each device type, parsed from "cpu:gloo,cuda:nccl" or one name.
#include <algorithm>
#include <cctype>
#include <string>

#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse {

BackendSpec BackendSpec::defaults() {
  return BackendSpec{{{DeviceType::CPU, CommunicatorBackend::Gloo},
                      {DeviceType::CUDA, CommunicatorBackend::Nccl}}};
}

BackendSpec BackendSpec::parse(std::string_view text) {
  if (text.empty()) return defaults();
  BackendSpec spec;
  if (text.find(':') == std::string_view::npos) {
    const CommunicatorBackend b = parse_communicator_backend(text);
    for (DeviceType d : communicator_backend_devices(b)) spec.backends[d] = b;
    return spec;
  }
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    std::string_view item = text.substr(start, end - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front())))
      item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back())))
      item.remove_suffix(1);
    const std::size_t colon = item.find(':');
    MESHFUSE_CHECK(colon != std::string_view::npos, ErrorCode::InvalidArgument,
                   "backend spec '{}': '{}' is not device:backend", text, item);
    const DeviceType device = Device::parse(item.substr(0, colon)).type;
    const CommunicatorBackend backend = parse_communicator_backend(item.substr(colon + 1));
    const std::vector<DeviceType> served = communicator_backend_devices(backend);
    MESHFUSE_CHECK(std::find(served.begin(), served.end(), device) != served.end(),
                   ErrorCode::InvalidArgument, "backend spec '{}': {} cannot serve {} tensors",
                   text, to_string(backend), to_string(device));
    MESHFUSE_CHECK(spec.backends.emplace(device, backend).second, ErrorCode::InvalidArgument,
                   "backend spec '{}': {} is listed twice", text, to_string(device));
    start = end + 1;
  }
  return spec;
}

CommunicatorBackend BackendSpec::for_device(DeviceType type) const {
  auto it = backends.find(type);
  MESHFUSE_CHECK(it != backends.end(), ErrorCode::BackendUnavailable,
                 "communicator: the backend spec '{}' has no backend for {} tensors", str(),
                 to_string(type));
  return it->second;
}

std::string BackendSpec::str() const {
  std::string s;
  for (const auto& [device, backend] : backends)
    s += fmt::format("{}{}:{}", s.empty() ? "" : ",", to_string(device), to_string(backend));
  return s;
}

}  // namespace meshfuse
