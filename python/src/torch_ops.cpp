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
#include <nanobind/stl/string.h>

// ATen's DLPack conversion of a dtype, so that an unsupported one gets _meshfuse's message.
#include <ATen/DLConvertor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "arrays.h"
#include "meshfuse/meshfuse.h"
#include "options.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace meshfuse::python {
namespace {

// An operand: the torch tensor, kept alive for the call (a lazily negated one, torch._neg_view,
// materialised, as meshfuse.torch's _d does for the DLPack exporter), and its view.
struct Operand {
  at::Tensor tensor;
  TensorView view;
};

// `t` as an operand, with the errors arrays.h's view() gives a DLPack array.
Operand operand(const at::Tensor& t, std::string_view op, std::string_view name) {
  const std::string what = std::string(op) + ": '" + std::string(name) + "'";
  if (t.layout() != at::kStrided) {
    std::ostringstream layout;
    layout << t.layout();
    throw Error(ErrorCode::Unsupported, what + " is a tensor of layout " + layout.str() +
                                            "; meshfuse's ops take strided (dense) tensors");
  }
  Operand o{t.is_neg() ? t.resolve_neg() : t, {}};
  const DLDataType dl = at::getDLDataType(o.tensor);
  const DType dtype = to_dtype({dl.code, dl.bits, dl.lanes}, what);
  Device device;
  if (o.tensor.is_cuda())
    device = {DeviceType::CUDA, o.tensor.get_device()};
  else if (!o.tensor.is_cpu())
    throw Error(ErrorCode::Unsupported, what + " is a tensor on " + o.tensor.device().str() +
                                            "; meshfuse's ops take cpu and cuda tensors");
  const at::IntArrayRef sizes = o.tensor.sizes(), strides = o.tensor.strides();
  o.view = TensorView(o.tensor.data_ptr(), dtype, Shape(sizes.begin(), sizes.end()),
                      Shape(strides.begin(), strides.end()), device);
  return o;
}

// Argument `name`: a torch.Tensor, or None where `optional` (an undefined view). Another object
// is a TypeError naming the argument (nanobind's would list the signature only).
Operand operand(nb::handle h, std::string_view op, std::string_view name, bool optional = false) {
  if (optional && h.is_none()) return {};
  bool tensor = false;
  try {
    tensor = THPVariable_Check(h.ptr());
  } catch (const python_error&) {  // isinstance raised (a class's __instancecheck__): that error
    throw nb::python_error();
  }
  if (!tensor) {
    const std::string message = std::string(op) + ": '" + std::string(name) + "' must be a " +
                                (optional ? "torch.Tensor or None" : "torch.Tensor") + ", got " +
                                Py_TYPE(h.ptr())->tp_name;
    throw nb::type_error(message.c_str());
  }
  return operand(THPVariable_Unpack(h.ptr()), op, name);
}

nb::object wrap(const at::Tensor& t) {
  PyObject* object = THPVariable_Wrap(t);
  if (!object) throw nb::python_error();
  return nb::steal(object);
}

nb::object wrap(const Operand& o) { return o.tensor.defined() ? wrap(o.tensor) : nb::none(); }

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

// Each op: the operands and outputs first, with the GIL held (ATen, Python objects, errors), then
// the kernel with the GIL released (a CUDA cross_entropy may wait for its label check).

nb::tuple rmsnorm_op(nb::handle x_arg, nb::handle weight_arg, double eps, bool save_rstd) {
  constexpr std::string_view op = "rmsnorm";
  const Operand x = operand(x_arg, op, "x"), weight = operand(weight_arg, op, "weight", true);
  const Operand y = operand(empty(x.tensor.sizes(), x.tensor), op, "y");
  Operand rstd;
  if (save_rstd && x.view.dim() > 0) {  // a 0-d x is the kernel's error
    const at::IntArrayRef sizes = x.tensor.sizes();
    rstd = operand(empty({c10::multiply_integers(sizes.begin(), sizes.end() - 1)}, x.tensor,
                         scalar_type(rmsnorm_rstd_dtype(x.view.dtype()))),
                   op, "rstd");
  }
  const Stream stream = stream_of(x.tensor);
  {
    const nb::gil_scoped_release release;
    rmsnorm(x.view, weight.view, y.view, rstd.view, eps, stream);
  }
  return nb::make_tuple(wrap(y), wrap(rstd));
}

nb::object softmax_op(nb::handle x_arg, double logits_multiplier) {
  constexpr std::string_view op = "softmax";
  const Operand x = operand(x_arg, op, "x");
  const Operand y = operand(empty(x.tensor.sizes(), x.tensor), op, "y");
  const Stream stream = stream_of(x.tensor);
  {
    const nb::gil_scoped_release release;
    softmax(x.view, y.view, logits_multiplier, stream);
  }
  return wrap(y);
}

nb::object swiglu_op(nb::handle gate_arg, nb::handle up_arg) {
  constexpr std::string_view op = "swiglu";
  const Operand gate = operand(gate_arg, op, "gate"), up = operand(up_arg, op, "up");
  const Operand out = operand(empty(gate.tensor.sizes(), gate.tensor), op, "out");
  const Stream stream = stream_of(gate.tensor);
  {
    const nb::gil_scoped_release release;
    swiglu(gate.view, up.view, out.view, stream);
  }
  return wrap(out);
}

nb::tuple cross_entropy_op(nb::handle logits_arg, nb::handle labels_arg, std::int64_t ignore_index,
                           const std::string& reduction, double label_smoothing,
                           double logits_multiplier, double z_loss_scale, bool fp32_loss,
                           std::int64_t vocab_start, std::int64_t vocab_size, bool save_lse,
                           const std::string& label_check) {
  constexpr std::string_view op = "cross_entropy";
  const Operand logits = operand(logits_arg, op, "logits"),
                labels = operand(labels_arg, op, "labels");
  const CrossEntropyOptions options =
      ce_options(op, ignore_index, reduction, label_smoothing, logits_multiplier, z_loss_scale,
                 vocab_start, vocab_size, label_check);
  const std::int64_t n = logits.view.dim() > 0 ? logits.view.size(0) : 0;
  const std::optional<at::ScalarType> loss_type =
      fp32_loss ? std::optional(at::kFloat) : std::nullopt;
  const Operand loss =
      operand(options.reduction == Reduction::None ? empty({n}, logits.tensor, loss_type)
                                                   : empty({}, logits.tensor, loss_type),
              op, "loss");
  Operand lse;
  if (save_lse)
    lse = operand(
        empty({n}, logits.tensor, scalar_type(cross_entropy_lse_dtype(logits.view.dtype()))), op,
        "lse");
  const Stream stream = stream_of(logits.tensor);
  {
    const nb::gil_scoped_release release;
    cross_entropy(logits.view, labels.view, loss.view, lse.view, options, stream);
  }
  return nb::make_tuple(wrap(loss), wrap(lse));
}

}  // namespace
}  // namespace meshfuse::python

NB_MODULE(_torch_ops, m) {
  using namespace meshfuse::python;
  m.doc() =
      "meshfuse.torch's eager forward kernels on torch tensors, compiled against one PyTorch "
      "(TORCH_VERSION); internal: meshfuse.torch calls them.";
  // PyTorch's errors (an allocation's out of memory: torch.OutOfMemoryError) as PyTorch raises
  // them. meshfuse::Error reaches Python through _meshfuse's translator (imported first by
  // meshfuse.torch; nanobind extensions of one build share their translators).
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const c10::Error&) {
      torch::translate_exception_to_python(p);
    } catch (const python_error&) {  // a torch helper's: the Python error it carries
      torch::translate_exception_to_python(p);
    }
  });
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
