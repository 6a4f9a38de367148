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
//      op, backend, device and dtype. There is never a silent fallback to another backend;
//   4. the call's stream must be on that device (stream.h), else Error(DeviceMismatch): a stream
//      is never relabelled.
#pragma once

#include <optional>
#include <span>
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
// Inverse of to_string (case-insensitive); Error(InvalidArgument) listing the names otherwise.
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

// A tensor argument of an op call, named for error messages.
struct NamedTensor {
  std::string_view name;
  const TensorView& tensor;
};

// The backend that `op` would run on for these tensors (undefined views are skipped), applying the
// rules above; throws what the call itself would throw.
KernelBackend resolved_backend(std::string_view op, const std::vector<NamedTensor>& tensors);

namespace detail {

// The part of a KernelTable that does not depend on its function type: the op's kernels and the
// rules above. Each table adds itself to the registry once, at construction (the tables are
// namespace-scope objects that live as long as the program); the registry is only an index of
// the tables, read by registered_kernels() and resolved_backend(), never by an op call.
class KernelTableBase {
 public:
  KernelTableBase(const KernelTableBase&) = delete;
  KernelTableBase& operator=(const KernelTableBase&) = delete;

  const std::string& op() const { return op_; }
  const std::vector<KernelInfo>& kernels() const { return kernels_; }

  // Which kernel runs these tensors: its index in kernels(), its backend and the tensors' device.
  struct Resolution {
    std::size_t index;
    KernelBackend backend;
    Device device;
  };
  // Applies the rules above, reading the forced backend once; throws their errors.
  Resolution resolve(std::span<const NamedTensor> tensors) const;

 protected:
  KernelTableBase(std::string op, std::vector<KernelInfo> kernels);
  ~KernelTableBase();  // leaves the registry (tables of a static library's unloading, exit)

 private:
  std::string op_;
  std::vector<KernelInfo> kernels_;
};

}  // namespace detail

// An op's table of kernels of one signature: the one place that says which backend runs it on
// which devices and dtypes, and with which function. Each op's front-end owns one per direction
// (src/ops/common.h builds the usual ones) and calls select() to get the function to run.
template <typename Fn>
class KernelTable : public detail::KernelTableBase {
 public:
  struct Entry {
    KernelBackend backend;
    std::vector<DeviceType> devices;
    std::vector<DType> dtypes;
    Fn* fn;
  };

  // The kernel an op call runs: its backend, its function, and the device of the call's tensors.
  struct Selection {
    KernelBackend backend;
    Fn* fn;
    Device device;
  };

  KernelTable(std::string op, const std::vector<Entry>& entries)
      : KernelTableBase(op, info(op, entries)) {
    for (const Entry& e : entries) fns_.push_back(e.fn);
  }

  Selection select(std::span<const NamedTensor> tensors) const {
    const Resolution r = resolve(tensors);
    return {r.backend, fns_[r.index], r.device};
  }

 private:
  static std::vector<KernelInfo> info(const std::string& op, const std::vector<Entry>& entries) {
    std::vector<KernelInfo> out;
    for (const Entry& e : entries) out.push_back({op, e.backend, e.devices, e.dtypes});
    return out;
  }

  std::vector<Fn*> fns_;
};

}  // namespace meshfuse
