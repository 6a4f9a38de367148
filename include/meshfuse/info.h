// The report `meshfuse info` and Python's meshfuse.info() print: version, build options, the SIMD
// target, devices and their kernel backends, the CUDA GEMM and communicator libraries, and the
// op x backend x dtype table of every registered kernel.
#pragma once

#include <string>

namespace meshfuse {

// Lines ending in '\n'. Never throws for a library it cannot open: that line says "unusable: ...".
std::string info();

}  // namespace meshfuse
