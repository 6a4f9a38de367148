// DLPack arrays as meshfuse TensorViews, and meshfuse Tensors handed back as arrays (internal to
// the _meshfuse extension).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshfuse/core/error.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse::python {

namespace nb = nanobind;

// The DType of an array; DTypeMismatch naming it (`what`: "op: 'argument'") for one meshfuse
// lacks.
inline DType to_dtype(nb::dlpack::dtype t, std::string_view what) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 32) return DType::F32;
    if (code == Code::Float && t.bits == 64) return DType::F64;
    if (code == Code::Float && t.bits == 16) return DType::F16;
    if (code == Code::Bfloat && t.bits == 16) return DType::BF16;
    if (code == Code::Int && t.bits == 32) return DType::I32;
    if (code == Code::Int && t.bits == 64) return DType::I64;
    if (code == Code::UInt && t.bits == 8) return DType::U8;
    if (code == Code::UInt && t.bits == 32) return DType::U32;
    if (code == Code::Bool) return DType::Bool;
  }
  // The dtype as NumPy / PyTorch name it (int16, complex64, float8), for the message.
  constexpr std::pair<Code, const char*> kKinds[] = {
      {Code::Int, "int"},       {Code::UInt, "uint"},       {Code::Float, "float"},
      {Code::Bfloat, "bfloat"}, {Code::Complex, "complex"}, {Code::Bool, "bool"}};
  std::string kind =
      "(DLPack code " + std::to_string(t.code) + ") of " + std::to_string(t.bits) + " bits";
  for (const auto& [kind_code, kind_name] : kKinds)
    if (kind_code == code) kind = kind_name + std::to_string(t.bits);
  if (t.lanes != 1) kind += " x " + std::to_string(t.lanes) + " lanes";
  throw Error(ErrorCode::DTypeMismatch,
              std::string(what) + " is an array of dtype " + kind +
                  ", which no meshfuse op takes (meshfuse's dtypes: float32, float64, bfloat16, "
                  "float16, int32, int64, uint8, uint32 and bool; the op's docstring says which "
                  "this argument takes)");
}

inline Device to_device(int type, int id) {
  if (type == nb::device::cpu::value) return {DeviceType::CPU, 0};
  if (type == nb::device::cuda::value) return {DeviceType::CUDA, id};
  throw Error(ErrorCode::Unsupported, "meshfuse: arrays on DLPack device type " +
                                          std::to_string(type) +
                                          " are not supported (cpu and cuda are)");
}

// An array as a view; `what` names it in errors ("op: 'argument'", or a description).
template <typename... Ts>
TensorView view(const nb::ndarray<Ts...>& a, std::string_view what) {
  Shape shape(a.ndim()), strides(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = static_cast<std::int64_t>(a.shape(d));
    strides[d] = a.stride(d);
  }
  return {const_cast<void*>(static_cast<const void*>(a.data())), to_dtype(a.dtype(), what),
          std::move(shape), std::move(strides), to_device(a.device_type(), a.device_id())};
}

// An output argument: a writable array, converted with the other arguments (the GIL held). A
// conversion that fails is kept and raised by view(out, op, name), naming the argument, instead of
// nanobind's "incompatible function arguments" for the whole call.
struct Output {
  enum class Problem { None, ReadOnly, NotAnArray };
  nb::ndarray<> array;
  Problem problem = Problem::None;
  const char* type = "";  // the Python type that came (its tp_name, alive for the call)
};

// An input argument of the collectives: any array, read-only ones too, converted as Output is, so
// that one that is not an array is named by view(in, op, name).
struct Input {
  nb::ndarray<nb::ro> array;
  bool is_array = false;
  const char* type = "";  // the Python type that came (its tp_name, alive for the call)
};

// Argument `name` of `op` as a view; its errors name both.
template <typename... Ts>
TensorView view(const nb::ndarray<Ts...>& a, std::string_view op, std::string_view name) {
  return view(a, std::string(op) + ": '" + std::string(name) + "'");
}

inline TensorView view(const Output& out, std::string_view op, std::string_view name) {
  if (out.problem == Output::Problem::None) return view(out.array, op, name);
  const std::string what = std::string(op) + ": output '" + std::string(name) + "' ";
  if (out.problem == Output::Problem::ReadOnly)  // a bad value, as NumPy's ValueError for one
    throw Error(ErrorCode::InvalidArgument,
                what + "is a read-only " + out.type + " (outputs are written in place)");
  const std::string message =  // a bad type
      what + "must be a writable array of a DLPack dtype (PyTorch, NumPy, CuPy), got " + out.type;
  throw nb::type_error(message.c_str());
}

inline TensorView view(const Input& in, std::string_view op, std::string_view name) {
  if (in.is_array) return view(in.array, op, name);
  const std::string message = std::string(op) + ": '" + std::string(name) +
                              "' must be an array of a DLPack dtype on the CPU or a CUDA device "
                              "(PyTorch, NumPy, CuPy, JAX), got " +
                              in.type;
  throw nb::type_error(message.c_str());
}

template <typename A>
TensorView view(const std::optional<A>& a, std::string_view op, std::string_view name) {
  return a ? view(*a, op, name) : TensorView{};
}

template <typename... Ts>
Device device_of(const nb::ndarray<Ts...>& a) {
  return to_device(a.device_type(), a.device_id());
}

// The stream of a call from Python: `handle` (a cudaStream_t as an integer; 0: the default stream)
// on `device`, the device of the call's arrays (meshfuse/core/stream.h says why a stream carries
// its device).
inline Stream stream_on(Device device, std::uintptr_t handle) {
  return {device, reinterpret_cast<void*>(handle)};
}

// The DLPack dtype of a meshfuse DType (the inverse of to_dtype).
inline nb::dlpack::dtype to_dlpack_dtype(DType dtype) {
  using Code = nb::dlpack::dtype_code;
  const auto of = [](Code code, int bits) {
    return nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
  };
  switch (dtype) {
    case DType::F32:
      return of(Code::Float, 32);
    case DType::F64:
      return of(Code::Float, 64);
    case DType::F16:
      return of(Code::Float, 16);
    case DType::BF16:
      return of(Code::Bfloat, 16);
    case DType::I32:
      return of(Code::Int, 32);
    case DType::I64:
      return of(Code::Int, 64);
    case DType::U8:
      return of(Code::UInt, 8);
    case DType::U32:
      return of(Code::UInt, 32);
    case DType::Bool:
      return of(Code::Bool, 8);
  }
  throw Error(ErrorCode::Internal, "meshfuse: a DType without a DLPack code");
}

// What a Tensor made by meshfuse is handed back as: the framework of the caller's arrays, so that
// torch tensors in give torch tensors out; anything else (JAX, a buffer) gets nanobind's ndarray,
// which exports DLPack (__dlpack__, __dlpack_device__) for any framework's from_dlpack.
enum class ArrayKind { DLPack, NumPy, Torch, CuPy };

// The kind of `array` by the package its type comes from (torch.nn.Parameter is torch's too).
inline ArrayKind kind_of(nb::handle array) {
  if (!array.is_valid() || array.is_none()) return ArrayKind::DLPack;
  const nb::object module = nb::getattr(array.type(), "__module__", nb::none());
  if (!nb::isinstance<nb::str>(module)) return ArrayKind::DLPack;
  const std::string name = nb::cast<std::string>(module);
  const std::string top = name.substr(0, name.find('.'));
  if (top == "torch") return ArrayKind::Torch;
  if (top == "numpy") return ArrayKind::NumPy;
  if (top == "cupy") return ArrayKind::CuPy;
  return ArrayKind::DLPack;
}

// `tensor` as an array of `kind` that owns it (no copy; the storage is freed with the last Python
// reference, CUDA memory stream-ordered on the stream it was allocated on), on its device.
inline nb::object to_array(Tensor tensor, ArrayKind kind) {
  // NumPy has no bf16 and no CUDA arrays: those go back as DLPack-exporting ndarrays.
  if (kind == ArrayKind::NumPy &&
      (tensor.dtype() == DType::BF16 || tensor.device().type != DeviceType::CPU))
    kind = ArrayKind::DLPack;
  std::vector<std::size_t> shape(tensor.shape().begin(), tensor.shape().end());
  void* data = tensor.view().data();
  const nb::dlpack::dtype dtype = to_dlpack_dtype(tensor.dtype());
  const Device device = tensor.device();
  const int device_type =
      device.type == DeviceType::CUDA ? nb::device::cuda::value : nb::device::cpu::value;
  // The capsule owns a copy of the Tensor (a shared reference to its storage).
  nb::capsule owner(new Tensor(std::move(tensor)),
                    [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  const auto make = [&](auto framework) {
    using Array = nb::ndarray<decltype(framework)>;
    return nb::object(
        Array(data, shape.size(), shape.data(), owner, nullptr, dtype, device_type, device.index)
            .cast());
  };
  switch (kind) {
    case ArrayKind::NumPy:
      return make(nb::numpy{});
    case ArrayKind::Torch:
      return make(nb::pytorch{});
    case ArrayKind::CuPy:
      return make(nb::cupy{});
    case ArrayKind::DLPack:
      break;
  }
  // array_api, not no_framework: that one hands back a bare DLPack capsule, this nanobind's
  // ndarray object with __dlpack__ and __dlpack_device__.
  return make(nb::array_api{});
}

}  // namespace meshfuse::python

namespace nanobind::detail {

template <>
struct type_caster<meshfuse::python::Input> {
  NB_TYPE_CASTER(meshfuse::python::Input, const_name("numpy.typing.ArrayLike"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    value.type = Py_TYPE(src.ptr())->tp_name;
    value.is_array = try_cast(src, value.array, false);
    return true;
  }
};

template <>
struct type_caster<meshfuse::python::Output> {
  // Named as nanobind names an array, so that stubgen writes a type checkers know.
  NB_TYPE_CASTER(meshfuse::python::Output, const_name("numpy.typing.NDArray"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    using Problem = meshfuse::python::Output::Problem;
    value.type = Py_TYPE(src.ptr())->tp_name;
    if (try_cast(src, value.array, false)) {
      // A JAX array is immutable but exports DLPack without the read-only flag: written in
      // place, it would change a value JAX may share or reuse.
      if (is_jax(src)) value.problem = Problem::ReadOnly;
      return true;
    }
    ndarray<ro> readonly;
    value.problem = try_cast(src, readonly, false) ? Problem::ReadOnly : Problem::NotAnArray;
    return true;
  }

 private:
  static bool is_jax(handle src) noexcept {
    // A DLPack capsule (what meshfuse.torch passes) says nothing of its producer; the lookup of
    // __module__ below was a noticeable part of a tiny call's host time.
    if (PyCapsule_CheckExact(src.ptr())) return false;
    PyObject* module = PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(src.ptr())),
                                              "__module__");
    if (!module) {
      PyErr_Clear();
      return false;
    }
    const char* name = PyUnicode_Check(module) ? PyUnicode_AsUTF8(module) : nullptr;
    if (!name) PyErr_Clear();
    const bool jax = name && (std::string_view(name).starts_with("jax.") ||
                              std::string_view(name).starts_with("jaxlib."));
    Py_DECREF(module);
    return jax;
  }
};

}  // namespace nanobind::detail
