// What this build of meshfuse is and what it can run on: version, build options, devices.
#pragma once

#include <string_view>
#include <vector>

#include "meshfuse/core/device.h"

namespace meshfuse {

// The library version, e.g. "0.1.0".
std::string_view version();
// The build options as space-separated "key=value" pairs, e.g.
// "native=ON sanitize=OFF blas=OpenBLAS-0.3.21 type=Release".
std::string_view build_info();
// True when this build has the cuda kernel backend.
bool built_with_cuda();
// The devices this build can run on, cpu first: only cpu without the cuda backend; a CUDA build
// adds cuda:0 .. cuda:N-1 for the GPUs this process sees.
std::vector<Device> available_devices();

}  // namespace meshfuse
