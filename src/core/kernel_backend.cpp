#include "meshfuse/core/kernel_backend.h"

#include <algorithm>
#include <mutex>

#include "core/names.h"
#include "meshfuse/core/error.h"

namespace meshfuse {
namespace {

thread_local std::optional<KernelBackend> t_forced;

// The index of every KernelTable, filled during static initialisation and read afterwards.
struct Registry {
  std::mutex mutex;
  std::vector<const detail::KernelTableBase*> tables;
};

Registry& registry() {
  static Registry r;
  return r;
}

template <typename T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string list_dtypes(const std::vector<DType>& dtypes) {
  std::string out;
  for (DType d : dtypes) out += fmt::format("{}{}", out.empty() ? "" : ", ", to_string(d));
  return out;
}

}  // namespace

std::string_view to_string(KernelBackend backend) {
  switch (backend) {
    case KernelBackend::Reference:
      return "reference";
    case KernelBackend::CPU:
      return "cpu";
    case KernelBackend::CUDA:
      return "cuda";
  }
  return "unknown";
}

KernelBackend parse_kernel_backend(std::string_view name) {
  constexpr KernelBackend kAll[] = {KernelBackend::Reference, KernelBackend::CPU,
                                    KernelBackend::CUDA};
  return detail::parse_name("kernel backend", name, kAll);
}

KernelBackend default_kernel_backend(DeviceType type) {
  return type == DeviceType::CUDA ? KernelBackend::CUDA : KernelBackend::CPU;
}

ForceKernelBackend::ForceKernelBackend(KernelBackend backend) : previous_(t_forced) {
  t_forced = backend;
}

ForceKernelBackend::~ForceKernelBackend() { t_forced = previous_; }

std::optional<KernelBackend> forced_kernel_backend() { return t_forced; }

namespace {

// The rules of kernel_backend.h for `op` with these kernels (none when no table has the op);
// returns the index of the kernel that runs the tensors.
detail::KernelTableBase::Resolution resolve(std::string_view op,
                                            const std::vector<KernelInfo>& kernels,
                                            std::span<const NamedTensor> tensors) {
  const NamedTensor* first = nullptr;
  for (const NamedTensor& t : tensors) {
    if (!t.tensor.defined()) continue;
    if (first == nullptr) {
      first = &t;
    } else if (t.tensor.device() != first->tensor.device()) {
      fail(ErrorCode::DeviceMismatch,
           "{}: all tensors must be on one device, got {} on {} and {} on {}", op, first->name,
           first->tensor.device().str(), t.name, t.tensor.device().str());
    }
  }
  MESHFUSE_CHECK(first != nullptr, ErrorCode::Internal, "{}: called without tensors", op);
  const Device device = first->tensor.device();
  const DType dtype = first->tensor.dtype();
  const std::optional<KernelBackend> forced = t_forced;
  const KernelBackend backend = forced.value_or(default_kernel_backend(device.type));

  const auto kernel = std::find_if(kernels.begin(), kernels.end(),
                                   [&](const KernelInfo& k) { return k.backend == backend; });
  const char* how = forced ? "forced" : "selected for the device";
  if (kernel == kernels.end())
    fail(ErrorCode::BackendUnavailable,
         "{}: kernel backend '{}' ({}) has no kernel for this op in this build (device {}, dtype "
         "{})",
         op, to_string(backend), how, device.str(), to_string(dtype));
  if (!contains(kernel->devices, device.type))
    fail(ErrorCode::Unsupported,
         "{}: kernel backend '{}' ({}) cannot run on device {} (tensor {}, dtype {})", op,
         to_string(backend), how, device.str(), first->name, to_string(dtype));
  if (!contains(kernel->dtypes, dtype))
    fail(ErrorCode::Unsupported,
         "{}: kernel backend '{}' ({}) on device {} does not support dtype {} of {} (supported: "
         "{})",
         op, to_string(backend), how, device.str(), to_string(dtype), first->name,
         list_dtypes(kernel->dtypes));
  return {static_cast<std::size_t>(kernel - kernels.begin()), backend, device};
}

}  // namespace

namespace detail {

KernelTableBase::KernelTableBase(std::string op, std::vector<KernelInfo> kernels)
    : op_(std::move(op)), kernels_(std::move(kernels)) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  // One table per op name: resolved_backend() and the listings find an op by its name.
  for (const KernelTableBase* t : r.tables)
    MESHFUSE_CHECK(t->op() != op_, ErrorCode::Internal, "kernel registry: two tables for op '{}'",
                   op_);
  r.tables.push_back(this);
}

KernelTableBase::~KernelTableBase() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::erase(r.tables, this);
}

KernelTableBase::Resolution KernelTableBase::resolve(std::span<const NamedTensor> tensors) const {
  return meshfuse::resolve(op_, kernels_, tensors);
}

}  // namespace detail

std::vector<KernelInfo> registered_kernels() {
  Registry& r = registry();
  std::vector<KernelInfo> out;
  {
    std::lock_guard lock(r.mutex);
    for (const detail::KernelTableBase* table : r.tables)
      out.insert(out.end(), table->kernels().begin(), table->kernels().end());
  }
  std::stable_sort(out.begin(), out.end(), [](const KernelInfo& a, const KernelInfo& b) {
    return a.op != b.op ? a.op < b.op : a.backend < b.backend;
  });
  return out;
}

KernelBackend resolved_backend(std::string_view op, const std::vector<NamedTensor>& tensors) {
  static const std::vector<KernelInfo> kNone;
  const detail::KernelTableBase* table = nullptr;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    for (const detail::KernelTableBase* t : r.tables)
      if (t->op() == op) table = t;  // names are unique (checked as tables register)
  }
  return resolve(op, table ? table->kernels() : kNone, tensors).backend;
}

}  // namespace meshfuse
