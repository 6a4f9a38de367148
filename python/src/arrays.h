// DLPack arrays as meshfuse TensorViews (internal to the _meshfuse extension).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>

#include "meshfuse/core/error.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse::python {

namespace nb = nanobind;

inline DType to_dtype(nb::dlpack::dtype t) {
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
  throw Error(ErrorCode::DTypeMismatch, "meshfuse: unsupported array dtype (DLPack code " +
                                            std::to_string(t.code) + ", " + std::to_string(t.bits) +
                                            " bits, " + std::to_string(t.lanes) + " lanes)");
}

inline Device to_device(int type, int id) {
  if (type == nb::device::cpu::value) return {DeviceType::CPU, 0};
  if (type == nb::device::cuda::value) return {DeviceType::CUDA, id};
  throw Error(ErrorCode::Unsupported, "meshfuse: arrays on DLPack device type " +
                                          std::to_string(type) +
                                          " are not supported (cpu and cuda are)");
}

template <typename... Ts>
TensorView view(const nb::ndarray<Ts...>& a) {
  Shape shape(a.ndim()), strides(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = static_cast<std::int64_t>(a.shape(d));
    strides[d] = a.stride(d);
  }
  return {const_cast<void*>(static_cast<const void*>(a.data())), to_dtype(a.dtype()),
          std::move(shape), std::move(strides), to_device(a.device_type(), a.device_id())};
}

template <typename A>
TensorView view(const std::optional<A>& a) {
  return a ? view(*a) : TensorView{};
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

}  // namespace meshfuse::python
