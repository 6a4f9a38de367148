// Kernel backends, the registry of op implementations, and backend resolution.
//
// Every op has implementations ("kernels") registered per backend, each stating the device types
// and dtypes it supports. An op call resolves its backend from the device of its tensors:
//   1. all defined tensors of the call must be on one device, else Error(DeviceMismatch) naming the
//      op and the two devices;
//   2. the backend is the one forced on this thread (ForceKernelBackend), else the device's own
//      (cpu -> `cpu`, cuda -> `cuda`);
//   3. that backend must have a kernel for the op supporting the device type and the op's dtype
//      (the dtype of its first tensor), else Error(Unsupported / BackendUnavailable) naming the
//      op, backend, device and dtype. There is never a silent fallback to another backend.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshfuse/core/device.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

enum class KernelBackend {
  Reference,  // plain loops, double accumulation: the ground truth for tests
  CPU,        // optimised CPU kernels (OpenMP, vectorised, BLAS)
  CUDA,       // NVIDIA GPUs
};

std::string_view to_string(KernelBackend backend);
// "reference", "cpu", "cuda"; throws Error(InvalidArgument) for anything else.
KernelBackend parse_kernel_backend(std::string_view name);
// The backend chosen for tensors on a device of this type when none is forced.
KernelBackend default_kernel_backend(DeviceType type);

// Forces a backend for the current thread while alive. Guards nest (the innermost wins), restore
// the previous state on scope exit (also during exception unwinding), and leave other threads
// unaffected.
class ForceKernelBackend {
 public:
  explicit ForceKernelBackend(KernelBackend backend);
  ~ForceKernelBackend();
  ForceKernelBackend(const ForceKernelBackend&) = delete;
  ForceKernelBackend& operator=(const ForceKernelBackend&) = delete;

 private:
  std::optional<KernelBackend> previous_;
};

// The backend forced on this thread, if any.
std::optional<KernelBackend> forced_kernel_backend();

// One registered implementation: op x backend, with the devices and dtypes it runs.
struct KernelInfo {
  std::string op;
  KernelBackend backend;
  std::vector<DeviceType> devices;
  std::vector<DType> dtypes;
};

// Every registered kernel, sorted by op then backend.
std::vector<KernelInfo> registered_kernels();
// Registers a kernel; called by the ops' static registration tables.
void register_kernel(KernelInfo info);

// A tensor argument of an op call, named for error messages.
struct NamedTensor {
  std::string_view name;
  const TensorView& tensor;
};

// The backend that `op` would run on for these tensors (undefined views are skipped), applying the
// rules above; throws what the call itself would throw.
KernelBackend resolved_backend(std::string_view op, const std::vector<NamedTensor>& tensors);

// An op's table of kernels of one signature, registered at static initialisation. Each op's
// front-end owns one per direction and calls select() to get the function to run.
template <typename Fn>
class KernelTable {
 public:
  struct Entry {
    KernelBackend backend;
    std::vector<DeviceType> devices;
    std::vector<DType> dtypes;
    Fn* fn;
  };

  KernelTable(std::string op, std::vector<Entry> entries)
      : op_(std::move(op)), entries_(std::move(entries)) {
    for (const Entry& e : entries_) register_kernel({op_, e.backend, e.devices, e.dtypes});
  }

  Fn* select(const std::vector<NamedTensor>& tensors) const {
    const KernelBackend backend = resolved_backend(op_, tensors);
    for (const Entry& e : entries_)
      if (e.backend == backend) return e.fn;
    return nullptr;  // unreachable: resolved_backend checked the registry
  }

 private:
  std::string op_;
  std::vector<Entry> entries_;
};

}  // namespace meshfuse
