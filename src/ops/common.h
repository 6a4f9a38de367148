// Helpers shared by the ops' front-ends and backends (internal, not installed).
#pragma once

#include <initializer_list>

#include "core/numeric.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/kernel_backend.h"
#include "meshfuse/core/tensor.h"

// The usual table of an op whose kernels share the name `fn` in each backend's namespace
// (detail::reference, detail::cpu, detail::cuda): see kernel_table() below.
//   const auto kForward = MESHFUSE_KERNEL_TABLE("softmax", detail::kFloatDTypes, softmax_forward);
#define MESHFUSE_KERNEL_TABLE(op, dtypes, fn)                                      \
  ::meshfuse::detail::kernel_table(op, dtypes, &::meshfuse::detail::reference::fn, \
                                   &::meshfuse::detail::cpu::fn MESHFUSE_CUDA_KERNEL(fn))
// The cuda kernel exists in CUDA builds only.
#ifdef MESHFUSE_WITH_CUDA
#define MESHFUSE_CUDA_KERNEL(fn) , &::meshfuse::detail::cuda::fn
#else
#define MESHFUSE_CUDA_KERNEL(fn)
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
// Throws DTypeMismatch unless t.dtype() is `expected` (the dtype of `expected_from`) or, when that
// is bf16 / f16, f32: the outputs a caller may keep in fp32 (a loss, a parameter's gradient).
void check_same_or_f32(std::string_view op, std::string_view name, const TensorView& t,
                       DType expected, std::string_view expected_from);
// A defined tensor of a floating dtype (f32, f64, bf16, f16), else InvalidArgument /
// DTypeMismatch.
void check_float(std::string_view op, std::string_view name, const TensorView& t);
// A defined tensor of the dtype of `like` (named `like_name`).
void check_dtype_of(std::string_view op, std::string_view name, const TensorView& t,
                    const TensorView& like, std::string_view like_name);
// A defined tensor of the dtype and shape of `like`.
void check_like(std::string_view op, std::string_view name, const TensorView& t,
                const TensorView& like, std::string_view like_name);
// Throws InvalidArgument unless t.dim() == rank.
void check_rank(std::string_view op, std::string_view name, const TensorView& t, std::int64_t rank);
// InvalidArgument unless the multiplier of softmax's and cross-entropy's logits is finite (any
// other gives rows of NaN).
void check_logits_multiplier(std::string_view op, double logits_multiplier);
// Throws ShapeMismatch unless t.shape() == expected.
void check_shape(std::string_view op, std::string_view name, const TensorView& t,
                 const Shape& expected);
// An output: defined, contiguous, the expected shape and dtype.
void check_output(std::string_view op, std::string_view name, const TensorView& t,
                  const Shape& expected, DType dtype);

// The devices the reference backend serves: the CPU, and CUDA tensors through host copies
// (slow; for tests and checks).
#ifdef MESHFUSE_WITH_CUDA
inline const std::vector<DeviceType> kReferenceDevices = {DeviceType::CPU, DeviceType::CUDA};
#else
inline const std::vector<DeviceType> kReferenceDevices = {DeviceType::CPU};
#endif

// An op's table with the usual kernels, each for `dtypes`: the reference on kReferenceDevices,
// cpu on the CPU and, when given (CUDA builds), cuda on CUDA devices.
template <typename Fn>
KernelTable<Fn> kernel_table(std::string op, const std::vector<DType>& dtypes, Fn* reference,
                             Fn* cpu, Fn* cuda = nullptr) {
  std::vector<typename KernelTable<Fn>::Entry> entries = {
      {KernelBackend::Reference, kReferenceDevices, dtypes, reference},
      {KernelBackend::CPU, {DeviceType::CPU}, dtypes, cpu}};
  if (cuda != nullptr) entries.push_back({KernelBackend::CUDA, {DeviceType::CUDA}, dtypes, cuda});
  return KernelTable<Fn>(std::move(op), entries);
}

// An output that an op may write over one of its inputs, the very same view (every backend reads
// each element before writing it, and reads nothing of that input afterwards): {"y", "x"}.
struct InPlace {
  std::string_view output, input;
};

// The operands of one kernel call, as the selected kernel reads them, and the stream it runs on.
// The caller's stream must be on the tensors' device (Error(DeviceMismatch) otherwise: a stream is
// never relabelled). Inputs are handed out contiguous (why: backends read rows with unit stride; a
// non-contiguous input costs one copy instead of a strided kernel per op). When the reference
// backend runs on CUDA tensors, inputs and outputs are host copies, stream() is the CPU's, and
// finish() copies the outputs back and waits; otherwise outputs pass through.
class KernelCall {
 public:
  // `tensors`: every operand of the call, by name (run_kernel's list), which outputs are checked
  // against; `in_place`: the outputs the op may write over an input. Both must outlive the call.
  KernelCall(std::string_view op, std::initializer_list<NamedTensor> tensors,
             std::initializer_list<InPlace> in_place, KernelBackend backend, Device device,
             const Stream& stream);
  KernelCall(const KernelCall&) = delete;  // one call finishes once
  KernelCall& operator=(const KernelCall&) = delete;
  // `t` contiguous, on the kernel's device (undefined stays undefined).
  TensorView input(const TensorView& t);
  // `t` on the kernel's device with its layout (gemm's operands are read with their strides); a
  // host copy, contiguous, when the reference runs on CUDA tensors.
  TensorView strided_input(const TensorView& t);
  // Where the kernel writes `t`; a host copy holds its current contents (some kernels accumulate
  // into outputs). Error(InvalidArgument) when `t` overlaps another operand, unless it is the same
  // view of an input that `in_place` lets it write over: a kernel writing `t` would change
  // elements it has yet to read, or another output.
  TensorView output(const TensorView& t);
  const Stream& stream() const { return host_ ? host_stream_ : stream_; }
  void finish();

 private:
  void check_overlap(const TensorView& out) const;

  std::string_view op_;
  std::initializer_list<NamedTensor> tensors_;
  std::initializer_list<InPlace> in_place_;
  bool host_;
  Stream stream_;
  Stream host_stream_{};
  std::vector<Tensor> copies_;
  std::vector<std::pair<Tensor, TensorView>> outputs_;  // host copy, device destination
};

// Runs one op call: selects the kernel for the tensors from the op's table (Error as
// kernel_backend.h says), checks the stream and stages the operands (KernelCall), runs
// body(fn, call), which calls fn on call's operands, and finishes the call.
//   detail::run_kernel(kForward, {{"x", x}, {"y", y}}, stream,
//                      [&](auto* fn, detail::KernelCall& call) {
//                        fn(shape, call.input(x).data(), call.output(y).data(), call.stream());
//                      });
// `tensors` lists inputs before outputs (one view object passed as several arguments is named by
// its last); `in_place`: the outputs that may be written over an input (KernelCall::output).
template <typename Fn, typename Body>
void run_kernel(const KernelTable<Fn>& table, std::initializer_list<NamedTensor> tensors,
                std::initializer_list<InPlace> in_place, const Stream& stream, Body&& body) {
  const typename KernelTable<Fn>::Selection kernel =
      table.select({tensors.begin(), tensors.size()});
  KernelCall call(table.op(), tensors, in_place, kernel.backend, kernel.device, stream);
  body(kernel.fn, call);
  call.finish();
}

template <typename Fn, typename Body>
void run_kernel(const KernelTable<Fn>& table, std::initializer_list<NamedTensor> tensors,
                const Stream& stream, Body&& body) {
  run_kernel(table, tensors, {}, stream, std::forward<Body>(body));
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

// Calls f(T{}) with T the element type of a cu_seqlens dtype: int32_t, uint32_t or int64_t.
template <typename F>
decltype(auto) dispatch_offsets(DType dtype, std::string_view op, F&& f) {
  if (dtype == DType::U32) return f(std::uint32_t{});
  return dispatch_index(dtype, op, f);
}

// `shape` with its last size replaced by `last`.
inline Shape with_last(Shape shape, std::int64_t last) {
  shape.back() = last;
  return shape;
}

// Product of all sizes but the last (the "rows" of a row-wise op); 1 for a 1-D tensor.
std::int64_t leading_rows(const TensorView& t);

}  // namespace meshfuse::detail
