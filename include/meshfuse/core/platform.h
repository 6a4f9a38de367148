// What this build of meshfuse is and what it can run on: version, build options, devices.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "meshfuse/core/device.h"

namespace meshfuse {

// The library version, e.g. "0.1.0".
std::string_view version();
// The build options as space-separated "key=value" pairs, e.g.
// "native=OFF sanitize=OFF blas=OpenBLAS-0.3.21 type=Release".
std::string_view build_info();
// The SIMD target the cpu kernels run on: "avx512", "avx2", "sse4", "neon", "sve", "scalar", ...
// The best one of cpu_simd_targets() that the CPU allows, unless the environment variable
// MESHFUSE_CPU_TARGET, read when the library is loaded, names a lower one of them.
std::string cpu_simd_target();
// The SIMD targets this build's cpu kernels are compiled for, best first (the CPU may lack some).
std::vector<std::string> cpu_simd_targets();
// True when this build has the cuda kernel backend.
bool built_with_cuda();
// The devices this build can run on, cpu first: only cpu without the cuda backend; a CUDA build
// adds cuda:0 .. cuda:N-1 for the GPUs this process sees.
std::vector<Device> available_devices();

}  // namespace meshfuse
