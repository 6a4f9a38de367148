// The _meshfuse extension: meshfuse's ops on any DLPack tensor (PyTorch, NumPy, CuPy, JAX).
// Inputs and caller-allocated outputs are passed as arrays; nothing is copied. Each op releases the
// GIL while it runs. `stream` is a cudaStream_t as an integer on the device of the arrays (0: that
// device's default stream).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <thread>

#include "arrays.h"
#include "meshfuse/core/memory.h"
#include "meshfuse/meshfuse.h"
#include "options.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace meshfuse::python {
namespace {

using In = nb::ndarray<nb::ro>;
using Out = Output;
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

// Holds a ForceKernelBackend between __enter__ and __exit__. The forcing is the entering thread's,
// so __exit__ must come from that thread, once per __enter__ (as `with` does); called by hand out
// of turn, it raises instead of undoing another thread's scope or popping an empty stack.
class ForceKernelBackendScope {
 public:
  explicit ForceKernelBackendScope(const std::string& backend)
      : backend_(parse_kernel_backend(backend)) {}
  ForceKernelBackendScope(const ForceKernelBackendScope&) = delete;
  ForceKernelBackendScope& operator=(const ForceKernelBackendScope&) = delete;
  void enter() {
    guards_.push_back({std::make_unique<ForceKernelBackend>(backend_), std::this_thread::get_id()});
  }
  void exit() {
    MESHFUSE_CHECK(!guards_.empty(), ErrorCode::InvalidArgument,
                   "force_kernel_backend: __exit__ without a matching __enter__");
    MESHFUSE_CHECK(guards_.back().thread == std::this_thread::get_id(), ErrorCode::InvalidArgument,
                   "force_kernel_backend: __exit__ on another thread than its __enter__ (the "
                   "forcing belongs to the entering thread)");
    guards_.pop_back();
  }

 private:
  struct Entered {
    std::unique_ptr<ForceKernelBackend> guard;
    std::thread::id thread;
  };
  KernelBackend backend_;
  std::vector<Entered> guards_;
};

// meshfuse.Error, and under it one class per ErrorCode that also derives from the built-in
// exception Python code expects for that kind of error (`except ValueError` catches a shape
// mismatch). Each class has the code's name as `code`; str(e) is the C++ what(), "[code] message".
struct ErrorClass {
  ErrorCode code;
  const char* name;
  PyObject* builtin;
};

PyObject* error_classes[static_cast<int>(ErrorCode::Internal) + 1];

void bind_errors(nb::module_& m) {
  const nb::object base = nb::steal(PyErr_NewExceptionWithDoc(
      "meshfuse.Error", "Every error meshfuse raises; its subclasses say the kind.",
      PyExc_Exception, nullptr));
  m.attr("Error") = base;
  // Names and built-in bases as PyTorch's where it has one (torch.OutOfMemoryError and
  // torch.distributed's errors are RuntimeErrors); NotImplementedError is a RuntimeError.
  const ErrorClass classes[] = {
      {ErrorCode::InvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {ErrorCode::ShapeMismatch, "ShapeMismatchError", PyExc_ValueError},
      {ErrorCode::DTypeMismatch, "DTypeMismatchError", PyExc_TypeError},
      {ErrorCode::DeviceMismatch, "DeviceMismatchError", PyExc_RuntimeError},
      {ErrorCode::Unsupported, "UnsupportedError", PyExc_NotImplementedError},
      {ErrorCode::BackendUnavailable, "BackendUnavailableError", PyExc_RuntimeError},
      {ErrorCode::CommunicationFailure, "CommunicationError", PyExc_RuntimeError},
      {ErrorCode::Timeout, "CommunicationTimeoutError", PyExc_TimeoutError},
      {ErrorCode::OutOfMemory, "OutOfMemoryError", PyExc_RuntimeError},
      {ErrorCode::Internal, "InternalError", PyExc_RuntimeError},
  };
  for (const ErrorClass& c : classes) {
    nb::dict attributes;
    attributes["code"] = std::string(to_string(c.code));
    attributes["__doc__"] = "A meshfuse error of code '" + std::string(to_string(c.code)) +
                            "'; also a " + reinterpret_cast<PyTypeObject*>(c.builtin)->tp_name +
                            ".";
    const std::string qualified = std::string("meshfuse.") + c.name;
    const nb::object cls = nb::steal(PyErr_NewException(
        qualified.c_str(), nb::make_tuple(base, nb::handle(c.builtin)).ptr(), attributes.ptr()));
    m.attr(c.name) = cls;
    error_classes[static_cast<int>(c.code)] = cls.inc_ref().ptr();  // for the module's lifetime
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_classes[static_cast<int>(e.code())], e.what());
    }
  });
}

void bind_core(nb::module_& m) {
  bind_errors(m);
  m.def("version", &version);
  m.def("info", &info,
        "What `meshfuse info` prints: version, build options, devices and their kernel backends, "
        "the communicator backends, every registered kernel with its dtypes.");
  m.def("built_with_cuda", &built_with_cuda, "Whether this build has the cuda backend.");
  m.def("cuda_device_count", &cuda_device_count);
  m.def("device_memory_stats", [](const std::string& device) {
    const DeviceMemoryStats s = device_memory_stats(Device::parse(device));
    nb::dict d;
    d["allocated"] = s.allocated;
    d["peak_allocated"] = s.peak_allocated;
    d["reserved"] = s.reserved;
    d["peak_reserved"] = s.peak_reserved;
    return d;
  }, "device"_a, "The CUDA device's meshfuse memory pool, which meshfuse allocates from (tensors "
                 "and ops' scratch), in bytes: allocated, peak_allocated (since the last reset), "
                 "reserved (allocated or cached for reuse), peak_reserved "
                 "(meshfuse/core/memory.h).");
  m.def("reset_peak_memory_stats", [](const std::string& device) {
    reset_peak_memory_stats(Device::parse(device));
  }, "device"_a, "Sets the device's peak_allocated and peak_reserved to the current values.");
  m.def("empty_cache", [](const std::string& device) { empty_cache(Device::parse(device)); },
        "device"_a, "Hands the memory the device's meshfuse pool caches (freed, unused) back to "
                    "the device, as torch.cuda.empty_cache does for torch's (which does not "
                    "reach meshfuse's pool); synchronise first to release all of it.");
  nb::class_<ForceKernelBackendScope>(m, "force_kernel_backend",
                                      "Context manager: forces a kernel backend ('reference', "
                                      "'cpu', 'cuda') on this thread while active; nests.")
      .def(nb::init<const std::string&>(), "backend"_a)
      .def("__enter__", [](ForceKernelBackendScope& s) { s.enter(); return &s; },
           nb::rv_policy::reference)
      .def("__exit__", [](ForceKernelBackendScope& s, nb::args) { s.exit(); });
  m.def("forced_kernel_backend", []() -> std::optional<std::string> {
    const auto b = forced_kernel_backend();
    return b ? std::optional<std::string>(std::string(to_string(*b))) : std::nullopt;
  });
  m.def("registered_kernels", [] {
    std::vector<std::tuple<std::string, std::string, std::vector<std::string>,
                           std::vector<std::string>>>
        out;
    for (const KernelInfo& k : registered_kernels()) {
      std::vector<std::string> devices, dtypes;
      for (DeviceType d : k.devices) devices.emplace_back(to_string(d));
      for (DType d : k.dtypes) dtypes.emplace_back(to_string(d));
      out.emplace_back(k.op, std::string(to_string(k.backend)), devices, dtypes);
    }
    return out;
  }, "Every kernel as (op, backend, devices, dtypes).");
}

GemmOptions gemm_options(bool transpose_a, bool transpose_b, double alpha, double beta) {
  return {transpose_a, transpose_b, alpha, beta};
}

void bind_gemm(nb::module_& m) {
  const auto release = nb::call_guard<nb::gil_scoped_release>();
  m.def(
      "gemm",
      [](In a, In b, OptIn c, Out d, bool transpose_a, bool transpose_b, double alpha, double beta,
         std::uintptr_t stream) {
        gemm(view(a, "gemm", "a"), view(b, "gemm", "b"), view(c, "gemm", "c"), view(d, "gemm", "d"),
             gemm_options(transpose_a, transpose_b, alpha, beta), stream_on(device_of(a), stream));
      },
      "a"_a, "b"_a, "c"_a.none(), "d"_a, "transpose_a"_a = false, "transpose_b"_a = false,
      "alpha"_a = 1.0, "beta"_a = 0.0, "stream"_a = 0, release,
      "d = alpha * op(a) @ op(b) + beta * c (op: transpose when asked). a (M, K), b (K, N), c "
      "(M, N) or None, d (M, N), one float dtype (float32, float64, bfloat16, float16; 16-bit "
      "computed in fp32, rounded once), except that 16-bit a and b may have a float32 d (and c): "
      "the fp32 sums unrounded, as torch.mm's out_dtype; d written in place. Raises meshfuse.Error "
      "subclasses: "
      "ShapeMismatchError, InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), "
      "DeviceMismatchError, BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/gemm.h. "
      "Outputs are caller-allocated arrays written in place; `stream` is a cudaStream_t as an "
      "integer on the arrays' device (0: its default stream).");
  m.def(
      "bmm",
      [](In a, In b, OptIn c, Out d, bool transpose_a, bool transpose_b, double alpha, double beta,
         std::uintptr_t stream) {
        bmm(view(a, "bmm", "a"), view(b, "bmm", "b"), view(c, "bmm", "c"), view(d, "bmm", "d"),
            gemm_options(transpose_a, transpose_b, alpha, beta), stream_on(device_of(a), stream));
      },
      "a"_a, "b"_a, "c"_a.none(), "d"_a, "transpose_a"_a = false, "transpose_b"_a = false,
      "alpha"_a = 1.0, "beta"_a = 0.0, "stream"_a = 0, release,
      "The batched gemm: a (B, M, K), b (B, K, N), c (B, M, N) or None, d (B, M, N), one float "
      "dtype (float32, float64, bfloat16, float16; 16-bit computed in fp32, rounded once; a "
      "float32 d and c allowed for 16-bit a and b). "
      "Raises meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/gemm.h. Outputs are caller-allocated arrays written "
      "in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its default "
      "stream).");
  m.def("cpu_blas_library", &cpu_blas_library,
        "The library of the cpu backend's f32/bf16/f16 GEMMs: 'Intel MKL <version> (file)' where "
        "MKL opens (x86-64; PyTorch's BLAS, pip install mkl), else 'oneDNN <version>' ('OpenBLAS' "
        "on Arm64). MESHFUSE_CPU_BLAS=mkl|onednn pins one, MESHFUSE_MKL_LIBRARY names MKL's file. "
        "Raises BackendUnavailableError when MKL is pinned but does not open.");
  m.def("cublaslt_library", &cublaslt_library,
        "The cuBLASLt of the cuda backend's GEMMs, e.g. 'cuBLASLt 13.0.2 (libcublasLt.so.13)': "
        "opened at first use, so a process with torch imported first shares torch's. Raises "
        "meshfuse.Error in a build without CUDA or when none loads (MESHFUSE_CUBLASLT_LIBRARY "
        "names one).");
  m.def(
      "linear",
      [](In x, In weight, OptIn bias, Out out, std::uintptr_t stream) {
        linear(view(x, "linear", "x"), view(weight, "linear", "weight"),
               view(bias, "linear", "bias"), view(out, "linear", "out"),
               stream_on(device_of(x), stream));
      },
      "x"_a, "weight"_a, "bias"_a.none(), "out"_a, "stream"_a = 0, release,
      "out = x @ weight.T + bias (torch.nn.functional.linear). x (..., K), weight (N, K), bias "
      "(N,) or None, out (..., N), one float dtype (float32, float64, bfloat16, float16; 16-bit "
      "computed in fp32, rounded once), except that out may be float32 for 16-bit x and weight "
      "(the fp32 sums unrounded; bias then 16-bit or float32). Raises meshfuse.Error subclasses: "
      "ShapeMismatchError, "
      "InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/gemm.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on "
      "the arrays' device (0: its default stream).");
  m.def(
      "linear_backward",
      [](In grad_out, In x, In weight, OptOut grad_x, OptOut grad_weight, OptOut grad_bias,
         std::uintptr_t stream) {
        linear_backward(view(grad_out, "linear_backward", "grad_out"),
                        view(x, "linear_backward", "x"), view(weight, "linear_backward", "weight"),
                        view(grad_x, "linear_backward", "grad_x"),
                        view(grad_weight, "linear_backward", "grad_weight"),
                        view(grad_bias, "linear_backward", "grad_bias"),
                        stream_on(device_of(grad_out), stream));
      },
      "grad_out"_a, "x"_a, "weight"_a, "grad_x"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "stream"_a = 0, release,
      "The gradients of linear for grad_out (..., N): grad_x (..., K), grad_weight (N, K), "
      "grad_bias (N,), each None when not wanted. Raises meshfuse.Error subclasses: "
      "ShapeMismatchError, InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), "
      "DeviceMismatchError, BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/gemm.h. "
      "Outputs are caller-allocated arrays written in place; `stream` is a cudaStream_t as an "
      "integer on the arrays' device (0: its default stream).");
  m.def(
      "fused_linear_cross_entropy",
      [](In x, In weight, OptIn bias, In labels, OptIn grad_loss, Out loss, OptOut grad_x,
         OptOut grad_weight, OptOut grad_bias, std::int64_t ignore_index,
         const std::string& reduction, double label_smoothing, double logits_multiplier,
         double z_loss_scale, std::int64_t chunk_rows, const std::string& label_check,
         std::uintptr_t stream) {
        fused_linear_cross_entropy(
            view(x, "fused_linear_cross_entropy", "x"),
            view(weight, "fused_linear_cross_entropy", "weight"),
            view(bias, "fused_linear_cross_entropy", "bias"),
            view(labels, "fused_linear_cross_entropy", "labels"),
            view(grad_loss, "fused_linear_cross_entropy", "grad_loss"),
            view(loss, "fused_linear_cross_entropy", "loss"),
            view(grad_x, "fused_linear_cross_entropy", "grad_x"),
            view(grad_weight, "fused_linear_cross_entropy", "grad_weight"),
            view(grad_bias, "fused_linear_cross_entropy", "grad_bias"),
            ce_options("fused_linear_cross_entropy", ignore_index, reduction, label_smoothing,
                       logits_multiplier, z_loss_scale, 0, 0, label_check),
            chunk_rows, stream_on(device_of(x), stream));
      },
      "x"_a, "weight"_a, "bias"_a.none(), "labels"_a, "grad_loss"_a.none(), "loss"_a,
      "grad_x"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(), "ignore_index"_a = -100,
      "reduction"_a = "mean", "label_smoothing"_a = 0.0, "logits_multiplier"_a = 1.0,
      "z_loss_scale"_a = 0.0, "chunk_rows"_a = kFusedLinearCrossEntropyChunkRows,
      "label_check"_a = "raise", "stream"_a = 0, release,
      "cross_entropy(linear(x, weight, bias), labels) and its gradients without the (N, V) "
      "logits: x (N, H), weight (V, H), bias (V,) or None, labels (N,) int32/int64; loss () or "
      "(N,) for reduction none, in x's dtype or float32 for 16-bit x; grad_x (N, H), "
      "grad_weight (V, H), grad_bias (V,) written when given (then grad_loss, in the loss's "
      "dtype, is required; grad_weight and grad_bias may be float32 for 16-bit x). Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). label_check: as cross_entropy's. Spec: "
      "meshfuse/ops/fused_linear_cross_entropy.h. Outputs are caller-allocated arrays written in "
      "place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its default "
      "stream).");
}

void bind_ops(nb::module_& m) {
  const auto release = nb::call_guard<nb::gil_scoped_release>();
  m.def(
      "swiglu",
      [](In gate, In up, Out out, std::uintptr_t stream) {
        swiglu(view(gate, "swiglu", "gate"), view(up, "swiglu", "up"), view(out, "swiglu", "out"),
               stream_on(device_of(gate), stream));
      },
      "gate"_a, "up"_a, "out"_a, "stream"_a = 0, release,
      "out = up * silu(gate) (SwiGLU, Shazeer 2020, arXiv:2002.05202). gate, up, out: (..., I), "
      "one float dtype (float32, float64, bfloat16, float16; 16-bit computed in fp32, rounded "
      "once). Raises meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError "
      "(ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/swiglu.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on "
      "the arrays' device (0: its default stream).");
  m.def(
      "swiglu_backward",
      [](In grad_out, In gate, In up, Out grad_gate, Out grad_up, std::uintptr_t stream) {
        swiglu_backward(
            view(grad_out, "swiglu_backward", "grad_out"), view(gate, "swiglu_backward", "gate"),
            view(up, "swiglu_backward", "up"), view(grad_gate, "swiglu_backward", "grad_gate"),
            view(grad_up, "swiglu_backward", "grad_up"), stream_on(device_of(grad_out), stream));
      },
      "grad_out"_a, "gate"_a, "up"_a, "grad_gate"_a, "grad_up"_a, "stream"_a = 0, release,
      "grad_gate, grad_up of swiglu for grad_out, all (..., I), one float dtype (float32, "
      "float64, bfloat16, float16; 16-bit computed in fp32, rounded once). Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/swiglu.h. Outputs are caller-allocated arrays written "
      "in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its default "
      "stream).");
  m.def(
      "swiglu_packed",
      [](In x, const std::string& layout, Out out, std::uintptr_t stream) {
        swiglu_packed(view(x, "swiglu_packed", "x"), parse_layout(layout, "swiglu_packed"),
                      view(out, "swiglu_packed", "out"), stream_on(device_of(x), stream));
      },
      "x"_a, "layout"_a, "out"_a, "stream"_a = 0, release,
      "swiglu of one tensor x (..., 2I) holding gate and up, layout 'halves' ([gate | up]) or "
      "'interleaved' (g0 u0 g1 u1 ...); out (..., I). Raises meshfuse.Error subclasses: "
      "ShapeMismatchError, InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), "
      "DeviceMismatchError, BackendUnavailableError (RuntimeError). Spec: "
      "meshfuse/ops/swiglu.h. Outputs are caller-allocated arrays written in place; `stream` is "
      "a cudaStream_t as an integer on the arrays' device (0: its default stream).");
  m.def(
      "swiglu_packed_backward",
      [](In grad_out, In x, const std::string& layout, Out grad_x, std::uintptr_t stream) {
        swiglu_packed_backward(view(grad_out, "swiglu_packed_backward", "grad_out"),
                               view(x, "swiglu_packed_backward", "x"),
                               parse_layout(layout, "swiglu_packed_backward"),
                               view(grad_x, "swiglu_packed_backward", "grad_x"),
                               stream_on(device_of(grad_out), stream));
      },
      "grad_out"_a, "x"_a, "layout"_a, "grad_x"_a, "stream"_a = 0, release,
      "grad_x (..., 2I) of swiglu_packed for grad_out (..., I), in x's layout. Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/swiglu.h. Outputs are caller-allocated arrays written "
      "in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its default "
      "stream).");

  m.def(
      "add",
      [](In a, In b, Out out, double alpha, std::uintptr_t stream) {
        add(view(a, "add", "a"), view(b, "add", "b"), view(out, "add", "out"), alpha,
            stream_on(device_of(a), stream));
      },
      "a"_a, "b"_a, "out"_a, "alpha"_a = 1.0, "stream"_a = 0, release,
      "out = a + alpha * b (torch.add); out may be a or b itself (in place).");
  m.def(
      "mul",
      [](In a, double scalar, Out out, std::uintptr_t stream) {
        mul(view(a, "mul", "a"), scalar, view(out, "mul", "out"), stream_on(device_of(a), stream));
      },
      "a"_a, "scalar"_a, "out"_a, "stream"_a = 0, release,
      "out = a * scalar (torch.mul); out may be a itself (in place).");

  m.def(
      "rmsnorm",
      [](In x, OptIn weight, Out y, OptOut rstd, double eps, std::uintptr_t stream) {
        rmsnorm(view(x, "rmsnorm", "x"), view(weight, "rmsnorm", "weight"), view(y, "rmsnorm", "y"),
                view(rstd, "rmsnorm", "rstd"), eps, stream_on(device_of(x), stream));
      },
      "x"_a, "weight"_a.none(), "y"_a, "rstd"_a.none(), "eps"_a, "stream"_a = 0, release,
      "y = x / sqrt(mean(x^2) + eps) * weight over the last dim (Zhang & Sennrich 2019; "
      "torch.nn.functional.rms_norm). x, y (..., H), weight (H,) or None, one float dtype "
      "(float32, float64, bfloat16, float16; 16-bit computed in fp32, rounded once); rstd "
      "(rows,) float32 (float64 for float64 x) or None: 1 / sqrt(mean(x^2) + eps), saved for "
      "the backward. Raises meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError "
      "(ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/rmsnorm.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on the "
      "arrays' device (0: its default stream).");
  m.def(
      "rmsnorm_backward",
      [](In grad_y, In x, OptIn weight, In rstd, Out dx, OptOut dweight, std::uintptr_t stream) {
        rmsnorm_backward(
            view(grad_y, "rmsnorm_backward", "grad_y"), view(x, "rmsnorm_backward", "x"),
            view(weight, "rmsnorm_backward", "weight"), view(rstd, "rmsnorm_backward", "rstd"),
            view(dx, "rmsnorm_backward", "dx"), view(dweight, "rmsnorm_backward", "dweight"),
            stream_on(device_of(grad_y), stream));
      },
      "grad_y"_a, "x"_a, "weight"_a.none(), "rstd"_a, "dx"_a, "dweight"_a.none(), "stream"_a = 0,
      release,
      "dx (..., H) and dweight (H,) (or None) of rmsnorm for grad_y, from x, weight and the "
      "forward's rstd. Raises meshfuse.Error subclasses: ShapeMismatchError, "
      "InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/rmsnorm.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on "
      "the arrays' device (0: its default stream).");
  m.def(
      "fused_residual_add_rmsnorm",
      [](In x, OptIn residual, OptIn weight, Out y, OptOut r, OptOut rstd, double eps,
         double multiplier, std::uintptr_t stream) {
        fused_residual_add_rmsnorm(view(x, "fused_residual_add_rmsnorm", "x"),
                                   view(residual, "fused_residual_add_rmsnorm", "residual"),
                                   view(weight, "fused_residual_add_rmsnorm", "weight"),
                                   view(y, "fused_residual_add_rmsnorm", "y"),
                                   view(r, "fused_residual_add_rmsnorm", "r"),
                                   view(rstd, "fused_residual_add_rmsnorm", "rstd"), eps,
                                   multiplier, stream_on(device_of(x), stream));
      },
      "x"_a, "residual"_a.none(), "weight"_a.none(), "y"_a, "r"_a.none(), "rstd"_a.none(), "eps"_a,
      "multiplier"_a = 1.0, "stream"_a = 0, release,
      "r = x * multiplier + residual; y = rmsnorm(r) * weight, in one pass. x, residual, y, r "
      "(..., H) (residual and r may be None), weight (H,) or None, rstd (rows,) float32 "
      "(float64 for float64 x) or None. Raises meshfuse.Error subclasses: ShapeMismatchError, "
      "InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/rmsnorm.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on "
      "the arrays' device (0: its default stream).");
  m.def(
      "fused_residual_add_rmsnorm_backward",
      [](In grad_y, OptIn grad_r, In r, OptIn weight, In rstd, Out dx, OptOut dresidual,
         OptOut dweight, double multiplier, std::uintptr_t stream) {
        fused_residual_add_rmsnorm_backward(
            view(grad_y, "fused_residual_add_rmsnorm_backward", "grad_y"),
            view(grad_r, "fused_residual_add_rmsnorm_backward", "grad_r"),
            view(r, "fused_residual_add_rmsnorm_backward", "r"),
            view(weight, "fused_residual_add_rmsnorm_backward", "weight"),
            view(rstd, "fused_residual_add_rmsnorm_backward", "rstd"),
            view(dx, "fused_residual_add_rmsnorm_backward", "dx"),
            view(dresidual, "fused_residual_add_rmsnorm_backward", "dresidual"),
            view(dweight, "fused_residual_add_rmsnorm_backward", "dweight"), multiplier,
            stream_on(device_of(grad_y), stream));
      },
      "grad_y"_a, "grad_r"_a.none(), "r"_a, "weight"_a.none(), "rstd"_a, "dx"_a,
      "dresidual"_a.none(), "dweight"_a.none(), "multiplier"_a = 1.0, "stream"_a = 0, release,
      "dx, dresidual, dweight of fused_residual_add_rmsnorm for grad_y (and grad_r, the "
      "gradient of r, or None), from r, weight and rstd; dresidual may be dx itself when "
      "multiplier is 1. Raises meshfuse.Error subclasses: ShapeMismatchError, "
      "InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/rmsnorm.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on "
      "the arrays' device (0: its default stream).");

  m.def(
      "softmax",
      [](In x, Out y, double logits_multiplier, std::uintptr_t stream) {
        softmax(view(x, "softmax", "x"), view(y, "softmax", "y"), logits_multiplier,
                stream_on(device_of(x), stream));
      },
      "x"_a, "y"_a, "logits_multiplier"_a = 1.0, "stream"_a = 0, release,
      "y = softmax(x * logits_multiplier) over the last dim (torch.softmax). x, y (..., V), one "
      "float dtype (float32, float64, bfloat16, float16; 16-bit computed in fp32, rounded "
      "once); a row all -inf gives NaN. Raises meshfuse.Error subclasses: ShapeMismatchError, "
      "InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/softmax.h. Outputs are "
      "caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer on "
      "the arrays' device (0: its default stream).");
  m.def(
      "softmax_backward",
      [](In grad_y, In y, Out grad_x, double logits_multiplier, std::uintptr_t stream) {
        softmax_backward(view(grad_y, "softmax_backward", "grad_y"),
                         view(y, "softmax_backward", "y"),
                         view(grad_x, "softmax_backward", "grad_x"), logits_multiplier,
                         stream_on(device_of(grad_y), stream));
      },
      "grad_y"_a, "y"_a, "grad_x"_a, "logits_multiplier"_a = 1.0, "stream"_a = 0, release,
      "grad_x of softmax for grad_y, from the forward's output y; all (..., V). Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/softmax.h. Outputs are caller-allocated arrays "
      "written in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its "
      "default stream).");

  m.def(
      "cross_entropy",
      [](In logits, In labels, Out loss, OptOut lse, std::int64_t ignore_index,
         const std::string& reduction, double label_smoothing, double logits_multiplier,
         double z_loss_scale, std::int64_t vocab_start, std::int64_t vocab_size,
         const std::string& label_check, std::uintptr_t stream) {
        cross_entropy(
            view(logits, "cross_entropy", "logits"), view(labels, "cross_entropy", "labels"),
            view(loss, "cross_entropy", "loss"), view(lse, "cross_entropy", "lse"),
            ce_options("cross_entropy", ignore_index, reduction, label_smoothing, logits_multiplier,
                       z_loss_scale, vocab_start, vocab_size, label_check),
            stream_on(device_of(logits), stream));
      },
      "logits"_a, "labels"_a, "loss"_a, "lse"_a.none(), "ignore_index"_a = -100,
      "reduction"_a = "mean", "label_smoothing"_a = 0.0, "logits_multiplier"_a = 1.0,
      "z_loss_scale"_a = 0.0, "vocab_start"_a = 0, "vocab_size"_a = 0, "label_check"_a = "raise",
      "stream"_a = 0, release,
      "torch.nn.functional.cross_entropy of logits (N, V) float32/float64/bfloat16/float16 and "
      "labels (N,) int32/int64 (ignore_index rows skipped), with label_smoothing, a z-loss "
      "(z_loss_scale * lse^2) and logits scaled by logits_multiplier: loss () for 'mean' and "
      "'sum', (N,) for 'none', in the logits' dtype or float32 for 16-bit logits; lse (N,) "
      "float32 (float64 for float64), or None: not written (inference; the backward needs it). "
      "vocab_size != 0: the logits are columns [vocab_start, vocab_start + V) of a vocabulary of "
      "vocab_size classes (a shard). Raises InvalidArgumentError (ValueError: a label outside "
      "[0, V) that is not ignore_index, naming its row), ShapeMismatchError, DTypeMismatchError "
      "(TypeError), DeviceMismatchError. label_check (CUDA arrays): 'raise' waits for the "
      "device's check of the labels so that a bad one raises from the call; 'device_assert' does "
      "not wait, and a bad label prints the error and traps (a device-side assert, as PyTorch; "
      "the process's CUDA context is then unusable). Spec: meshfuse/ops/cross_entropy.h.");
  m.def(
      "cross_entropy_backward",
      [](In grad_loss, In logits, In labels, In lse, Out grad_logits, std::int64_t ignore_index,
         const std::string& reduction, double label_smoothing, double logits_multiplier,
         double z_loss_scale, std::int64_t vocab_start, std::int64_t vocab_size,
         const std::string& label_check, std::uintptr_t stream) {
        cross_entropy_backward(
            view(grad_loss, "cross_entropy_backward", "grad_loss"),
            view(logits, "cross_entropy_backward", "logits"),
            view(labels, "cross_entropy_backward", "labels"),
            view(lse, "cross_entropy_backward", "lse"),
            view(grad_logits, "cross_entropy_backward", "grad_logits"),
            ce_options("cross_entropy_backward", ignore_index, reduction, label_smoothing,
                       logits_multiplier, z_loss_scale, vocab_start, vocab_size, label_check),
            stream_on(device_of(grad_loss), stream));
      },
      "grad_loss"_a, "logits"_a, "labels"_a, "lse"_a, "grad_logits"_a, "ignore_index"_a = -100,
      "reduction"_a = "mean", "label_smoothing"_a = 0.0, "logits_multiplier"_a = 1.0,
      "z_loss_scale"_a = 0.0, "vocab_start"_a = 0, "vocab_size"_a = 0, "label_check"_a = "raise",
      "stream"_a = 0, release,
      "grad_logits (N, V), the logits' dtype, from grad_loss (the loss's shape; the logits' "
      "dtype or float32 for 16-bit logits) and the forward's logits, labels and lse; "
      "grad_logits may be logits itself (in place). For a shard (vocab_start, vocab_size as "
      "in cross_entropy), lse is the whole vocabulary's. Errors as cross_entropy.");
}

}  // namespace
}  // namespace meshfuse::python

namespace meshfuse::python {
void bind_distributed(nb::module_& m);  // distributed.cpp
void bind_exec(nb::module_& m);  // exec.cpp
void bind_recurrent(nb::module_& m);  // recurrent.cpp
void bind_sequence(nb::module_& m);  // sequence.cpp
}  // namespace meshfuse::python

NB_MODULE(_meshfuse, m) {
  m.doc() = "meshfuse kernels on DLPack arrays (see the meshfuse package for the PyTorch API)";
  meshfuse::python::bind_core(m);
  meshfuse::python::bind_ops(m);
  meshfuse::python::bind_gemm(m);
  meshfuse::python::bind_distributed(m);
  meshfuse::python::bind_exec(m);
  meshfuse::python::bind_recurrent(m);
  meshfuse::python::bind_sequence(m);
}
