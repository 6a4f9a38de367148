// Helpers shared by the ops' front-ends and backends (internal, not installed).
#pragma once

#include <initializer_list>

#include "core/numeric.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/kernel_backend.h"
#include "meshfuse/core/tensor.h"

// A KernelTable entry for the cuda backend in CUDA builds, nothing otherwise:
//   {reference entry, cpu entry MESHFUSE_CUDA_ENTRY(kFloatDTypes, swiglu_forward)}
#ifdef MESHFUSE_WITH_CUDA
#define MESHFUSE_CUDA_ENTRY(dtypes, fn) \
  , { KernelBackend::CUDA, {DeviceType::CUDA}, dtypes, &::meshfuse::detail::cuda::fn }
#else
#define MESHFUSE_CUDA_ENTRY(dtypes, fn)
#endif

namespace meshfuse::detail {

inline const std::vector<DType> kFloatDTypes = {DType::F32, DType::F64, DType::F16, DType::BF16};
inline const std::vector<DType> kIndexDTypes = {DType::I32, DType::I64};

// Throws InvalidArgument unless `t` is defined.
void check_defined(std::string_view op, std::string_view name, const TensorView& t);
// Throws DTypeMismatch unless t.dtype() is one of `allowed`.
void check_dtype(std::string_view op, std::string_view name, const TensorView& t,
                 std::initializer_list<DType> allowed);
// Throws DTypeMismatch unless t.dtype() == expected.
void check_same_dtype(std::string_view op, std::string_view name, const TensorView& t,
                      DType expected, std::string_view expected_from);
// Throws InvalidArgument unless t.dim() == rank.
void check_rank(std::string_view op, std::string_view name, const TensorView& t, std::int64_t rank);
// Throws ShapeMismatch unless t.shape() == expected.
void check_shape(std::string_view op, std::string_view name, const TensorView& t,
                 const Shape& expected);
// An output: defined, contiguous, the expected shape and dtype.
void check_output(std::string_view op, std::string_view name, const TensorView& t,
                  const Shape& expected, DType dtype);

// `t` itself when contiguous, else a contiguous copy on the same device (why: backends read rows
// with unit stride; a non-contiguous input costs one copy instead of a strided kernel per op).
class Contiguous {
 public:
  explicit Contiguous(const TensorView& t, const Stream& stream = {});
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT

 private:
  Tensor copy_;
  TensorView view_;
};

// The devices the reference backend serves: the CPU, and CUDA tensors through host copies
// (slow; for tests and checks).
#ifdef MESHFUSE_WITH_CUDA
inline const std::vector<DeviceType> kReferenceDevices = {DeviceType::CPU, DeviceType::CUDA};
#else
inline const std::vector<DeviceType> kReferenceDevices = {DeviceType::CPU};
#endif

// The stream a kernel runs on, and the reference backend on CUDA tensors. stream() is the
// caller's stream, or the default stream of the tensors' device when the caller passed a CPU
// stream (the default argument); a CUDA stream of another device is Error(DeviceMismatch).
// When the tensors are on a CUDA device and the reference backend is forced, input() and output()
// hand out host copies, stream() a CPU stream, and finish() copies the outputs back and waits.
// Otherwise input() and output() pass their tensors through.
//   detail::HostStaging host("op", x, stream);
//   fn(host.input(x), host.output(y), host.stream());
//   host.finish();
class HostStaging {
 public:
  HostStaging(std::string_view op, const TensorView& any_input, const Stream& stream);
  TensorView input(const TensorView& t);
  // A host copy holding the output's current contents (some kernels accumulate into outputs).
  TensorView output(const TensorView& t);
  const Stream& stream() const { return active_ ? host_stream_ : stream_; }
  void finish();

 private:
  bool active_;
  Stream stream_;
  Stream host_stream_{};
  std::vector<Tensor> inputs_;
  std::vector<std::pair<Tensor, TensorView>> outputs_;  // host copy, device destination
};

// Throws Error(DTypeMismatch): `op` has no kernel for `dtype` (used by the dispatchers below).
[[noreturn]] void fail_dtype(std::string_view op, DType dtype);

// Calls f(T{}) with T the element type of a floating dtype (float, double, bfloat16, float16).
template <typename F>
decltype(auto) dispatch_float(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::F32:
      return f(float{});
    case DType::F64:
      return f(double{});
    case DType::BF16:
      return f(bfloat16{});
    case DType::F16:
      return f(float16{});
    default:
      fail_dtype(op, dtype);
  }
}

// Calls f(T{}) with T = int32_t or int64_t.
template <typename F>
decltype(auto) dispatch_index(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::I32:
      return f(std::int32_t{});
    case DType::I64:
      return f(std::int64_t{});
    default:
      fail_dtype(op, dtype);
  }
}

// Product of all sizes but the last (the "rows" of a row-wise op); 1 for a 1-D tensor.
std::int64_t leading_rows(const TensorView& t);

}  // namespace meshfuse::detail
