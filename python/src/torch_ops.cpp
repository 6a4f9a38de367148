// The _torch_ops extension: the forward kernels of meshfuse.torch's eager path, called on torch
// tensors directly. Built only against an installed PyTorch, whose C++ ABI it takes: it serves the
// torch version it was compiled for (meshfuse/_torch_build.py names it) and meshfuse.torch takes
// the DLPack path of _meshfuse under any other.
//
// Why it exists: on tiny inputs a call is host time, and the DLPack path pays for an output
// allocated from Python, one capsule per tensor and nanobind's array conversion, which together
// put a one-launch op well above PyTorch's own call (bench/python_overhead.py). Here a tensor is
// read in place and the outputs come from ATen's allocator in C++. The kernels, their checks and
// their errors are the library's, the same as through _meshfuse.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

// ATen's DLPack conversion of a dtype, so that an unsupported one gets _meshfuse's message.
#include <ATen/DLConvertor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "arrays.h"
#include "meshfuse/meshfuse.h"
#include "options.h"

namespace nb = nanobind;
using namespace nb::literals;

// torch.Tensor <-> at::Tensor, without a copy (the tensor's reference count is all that changes).
namespace nanobind::detail {
template <>
struct type_caster<at::Tensor> {
  NB_TYPE_CASTER(at::Tensor, const_name("torch.Tensor"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    if (!THPVariable_Check(src.ptr())) return false;
    value = THPVariable_Unpack(src.ptr());
    return true;
  }

  static handle from_cpp(const at::Tensor& t, rv_policy, cleanup_list*) noexcept {
    return THPVariable_Wrap(t);
  }
};
}  // namespace nanobind::detail

namespace meshfuse::python {
namespace {

using OptTensor = std::optional<at::Tensor>;

// A tensor as a view, as arrays.h's view() makes one of a DLPack array, with the same errors. A
// lazily negated tensor (torch._neg_view) is materialised into `keep`, as meshfuse.torch's _d does.
TensorView view(const at::Tensor& t, std::string_view op, std::string_view name, at::Tensor& keep) {
  keep = t.is_neg() ? t.resolve_neg() : t;
  const std::string what = std::string(op) + ": '" + std::string(name) + "'";
  const DLDataType dl = at::getDLDataType(keep);
  const DType dtype = to_dtype({dl.code, dl.bits, dl.lanes}, what);
  Device device;
  if (keep.is_cuda())
    device = {DeviceType::CUDA, keep.get_device()};
  else if (!keep.is_cpu())
    throw Error(ErrorCode::Unsupported, what + " is a tensor on " + keep.device().str() +
                                            "; meshfuse's ops take cpu and cuda tensors");
  return {keep.data_ptr(), dtype, Shape(keep.sizes().begin(), keep.sizes().end()),
          Shape(keep.strides().begin(), keep.strides().end()), device};
}

TensorView view(const OptTensor& t, std::string_view op, std::string_view name, at::Tensor& keep) {
  return t ? view(*t, op, name, keep) : TensorView{};
}

// A contiguous tensor of `sizes` on x's device, of x's dtype unless `dtype` is given.
at::Tensor empty(at::IntArrayRef sizes, const at::Tensor& x,
                 std::optional<at::ScalarType> dtype = std::nullopt) {
  return at::empty(sizes, x.options().dtype(dtype.value_or(x.scalar_type())));
}

// The current stream of x's device, as torch's own ops run on (torch.cuda.current_stream).
Stream stream_of(const at::Tensor& x) {
  if (!x.is_cuda()) return {};
  const c10::Device d = x.device();
  return {Device{DeviceType::CUDA, d.index()},
          c10::impl::getDeviceGuardImpl(d.type())->getStream(d).native_handle()};
}

// The saved statistics' dtypes (C++ rmsnorm_rstd_dtype, cross_entropy_lse_dtype): F32 or F64.
at::ScalarType scalar_type(DType dtype) { return dtype == DType::F64 ? at::kDouble : at::kFloat; }

std::tuple<at::Tensor, OptTensor> rmsnorm_op(const at::Tensor& x, const OptTensor& weight,
                                             double eps, bool save_rstd) {
  constexpr std::string_view op = "rmsnorm";
  at::Tensor keep_x, keep_w, keep_y, keep_rstd;
  const TensorView xv = view(x, op, "x", keep_x);
  const at::Tensor y = empty(x.sizes(), x);
  OptTensor rstd;
  if (save_rstd) {
    std::int64_t rows = 1;  // every dim but the last (a 0-d x is the kernel's error)
    for (std::int64_t d = 0; d + 1 < xv.dim(); ++d) rows *= xv.size(d);
    rstd = empty({rows}, x, scalar_type(rmsnorm_rstd_dtype(xv.dtype())));
  }
  {
    const nb::gil_scoped_release release;
    rmsnorm(xv, view(weight, op, "weight", keep_w), view(y, op, "y", keep_y),
            view(rstd, op, "rstd", keep_rstd), eps, stream_of(x));
  }
  return {y, rstd};
}

at::Tensor softmax_op(const at::Tensor& x, double logits_multiplier) {
  constexpr std::string_view op = "softmax";
  at::Tensor keep_x, keep_y;
  const TensorView xv = view(x, op, "x", keep_x);
  const at::Tensor y = empty(x.sizes(), x);
  const nb::gil_scoped_release release;
  softmax(xv, view(y, op, "y", keep_y), logits_multiplier, stream_of(x));
  return y;
}

at::Tensor swiglu_op(const at::Tensor& gate, const at::Tensor& up) {
  constexpr std::string_view op = "swiglu";
  at::Tensor keep_gate, keep_up, keep_out;
  const TensorView gv = view(gate, op, "gate", keep_gate), uv = view(up, op, "up", keep_up);
  const at::Tensor out = empty(gate.sizes(), gate);
  const nb::gil_scoped_release release;
  swiglu(gv, uv, view(out, op, "out", keep_out), stream_of(gate));
  return out;
}

std::tuple<at::Tensor, OptTensor> cross_entropy_op(
    const at::Tensor& logits, const at::Tensor& labels, std::int64_t ignore_index,
    const std::string& reduction, double label_smoothing, double logits_multiplier,
    double z_loss_scale, bool fp32_loss, std::int64_t vocab_start, std::int64_t vocab_size,
    bool save_lse, const std::string& label_check) {
  constexpr std::string_view op = "cross_entropy";
  const CrossEntropyOptions options =
      ce_options(op, ignore_index, reduction, label_smoothing, logits_multiplier, z_loss_scale,
                 vocab_start, vocab_size, label_check);
  at::Tensor keep_logits, keep_labels, keep_loss, keep_lse;
  const TensorView lv = view(logits, op, "logits", keep_logits);
  const std::int64_t n = lv.dim() > 0 ? lv.size(0) : 0;
  const at::Tensor loss =
      options.reduction == Reduction::None
          ? empty({n}, logits, fp32_loss ? std::optional(at::kFloat) : std::nullopt)
          : empty({}, logits, fp32_loss ? std::optional(at::kFloat) : std::nullopt);
  OptTensor lse;
  if (save_lse) lse = empty({n}, logits, scalar_type(cross_entropy_lse_dtype(lv.dtype())));
  {
    const nb::gil_scoped_release release;
    cross_entropy(lv, view(labels, op, "labels", keep_labels), view(loss, op, "loss", keep_loss),
                  view(lse, op, "lse", keep_lse), options, stream_of(logits));
  }
  return {loss, lse};
}

}  // namespace
}  // namespace meshfuse::python

NB_MODULE(_torch_ops, m) {
  using namespace meshfuse::python;
  m.doc() =
      "meshfuse.torch's eager forward kernels on torch tensors, compiled against one PyTorch "
      "(meshfuse._torch_build.TORCH_VERSION); internal: meshfuse.torch calls them.";
  m.def("rmsnorm", &rmsnorm_op, "x"_a, "weight"_a.none(), "eps"_a, "save_rstd"_a,
        "(y, rstd or None) of rmsnorm on x (..., H) with weight (H,) or None: as "
        "meshfuse.torch.rmsnorm_forward without a residual.");
  m.def("softmax", &softmax_op, "x"_a, "logits_multiplier"_a,
        "y = softmax(x * logits_multiplier) over the last dim: as meshfuse.torch.softmax_forward.");
  m.def("swiglu", &swiglu_op, "gate"_a, "up"_a,
        "up * silu(gate): as meshfuse.torch.swiglu_forward.");
  m.def("cross_entropy", &cross_entropy_op, "logits"_a, "labels"_a, "ignore_index"_a, "reduction"_a,
        "label_smoothing"_a, "logits_multiplier"_a, "z_loss_scale"_a, "fp32_loss"_a,
        "vocab_start"_a, "vocab_size"_a, "save_lse"_a, "label_check"_a,
        "(loss, lse or None): as meshfuse.torch.cross_entropy_forward; fp32_loss: a float32 loss "
        "for 16-bit logits (else the logits' dtype).");
  m.attr("TORCH_VERSION") = MESHFUSE_TORCH_VERSION;
}
