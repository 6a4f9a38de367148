#include "meshfuse/info.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "meshfuse/core/error.h"
#include "meshfuse/core/kernel_backend.h"
#include "meshfuse/core/platform.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/ops/gemm.h"

namespace meshfuse {
namespace {

constexpr KernelBackend kBackends[] = {KernelBackend::Reference, KernelBackend::CPU,
                                       KernelBackend::CUDA};

std::string dtypes_text(const std::vector<DType>& dtypes) {
  std::vector<std::string_view> names;
  for (DType d : dtypes) names.push_back(to_string(d));
  return fmt::format("{}", fmt::join(names, " "));
}

// What library() names, or "unusable: <why>" when it cannot open the library (info still succeeds).
std::string library_or_why(std::string (*library)()) {
  try {
    return library();
  } catch (const Error& e) {
    return fmt::format("unusable: {}", e.what());
  }
}

}  // namespace

std::string info() {
  std::string out;
  const std::vector<KernelInfo> kernels = registered_kernels();
  out += fmt::format("meshfuse {}\n", version());
  out += fmt::format("build: {} cuda={}\n", build_info(), built_with_cuda() ? "ON" : "OFF");
  out += fmt::format("cpu simd: {} (built for {}; MESHFUSE_CPU_TARGET pins a lower one)\n",
                     cpu_simd_target(), fmt::join(cpu_simd_targets(), " "));

  out += "devices and their kernel backends:\n";
  for (const Device& device : available_devices()) {
    std::vector<std::string_view> backends;
    for (KernelBackend b : kBackends) {
      const bool runs = std::any_of(kernels.begin(), kernels.end(), [&](const KernelInfo& k) {
        return k.backend == b &&
               std::find(k.devices.begin(), k.devices.end(), device.type) != k.devices.end();
      });
      if (runs) backends.push_back(to_string(b));
    }
    out += fmt::format("  {:<8} {}\n", device.str(), fmt::join(backends, ", "));
  }
  if (!built_with_cuda())
    out += "  (no cuda devices: this build has no cuda backend)\n";
  else if (cuda_device_count() == 0)
    out += "  (no cuda devices: this build has the cuda backend but sees no GPU)\n";

  out += fmt::format("cpu gemm library: {}\n", library_or_why(cpu_blas_library));
  if (built_with_cuda())
    out += fmt::format("cuda gemm library: {}\n", library_or_why(cublaslt_library));

  // The communicator backends of this build, and the NCCL library nccl opens.
  std::vector<std::string> comms;
  for (CommunicatorBackend b : {CommunicatorBackend::Local, CommunicatorBackend::Gloo,
                                CommunicatorBackend::Mpi, CommunicatorBackend::Nccl}) {
    if (!communicator_backend_built(b)) continue;
    std::string text(to_string(b));
    if (b == CommunicatorBackend::Nccl) {
      text += " (" + library_or_why(nccl_library) + ")";
    }
    comms.push_back(text);
  }
  out += fmt::format("communicator backends: {}\n", fmt::join(comms, ", "));

  // One row per op (kernel name), one column per backend that has any kernel.
  std::vector<KernelBackend> columns;
  for (KernelBackend b : kBackends)
    if (std::any_of(kernels.begin(), kernels.end(),
                    [&](const KernelInfo& k) { return k.backend == b; }))
      columns.push_back(b);
  std::vector<std::string> ops;
  for (const KernelInfo& k : kernels)
    if (ops.empty() || ops.back() != k.op) ops.push_back(k.op);  // sorted by op
  std::size_t op_width = 2;
  for (const std::string& op : ops) op_width = std::max(op_width, op.size());

  out += "kernels (op x backend: dtypes):\n";
  std::string head = fmt::format("  {:<{}}", "op", op_width);
  for (KernelBackend b : columns) head += fmt::format("  {:<16}", to_string(b));
  out += head.substr(0, head.find_last_not_of(' ') + 1) + '\n';
  for (const std::string& op : ops) {
    std::string line = fmt::format("  {:<{}}", op, op_width);
    for (KernelBackend b : columns) {
      const auto k = std::find_if(kernels.begin(), kernels.end(), [&](const KernelInfo& k) {
        return k.op == op && k.backend == b;
      });
      line += fmt::format("  {:<16}", k == kernels.end() ? "-" : dtypes_text(k->dtypes));
    }
    out += line.substr(0, line.find_last_not_of(' ') + 1) + '\n';
  }
  return out;
}

}  // namespace meshfuse
