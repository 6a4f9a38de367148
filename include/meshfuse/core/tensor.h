// TensorView (non-owning, strided) and Tensor (owning). Sizes, strides and offsets are int64
// elements everywhere, so tensors past 2^31 elements index correctly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshfuse/core/device.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"

namespace meshfuse {

using Shape = std::vector<std::int64_t>;

// Row-major strides of a contiguous tensor of `shape`.
Shape contiguous_strides(const Shape& shape);
// Product of the sizes (1 for a 0-d shape); throws Error(InvalidArgument) on a negative size or
// on an overflow of int64.
std::int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);

// A view of memory owned by someone else (PyTorch, NumPy, a Tensor, ...): data pointer, shape,
// strides in elements, dtype and device. A default-constructed view is "undefined" and stands for
// an absent optional argument.
class TensorView {
 public:
  TensorView() = default;
  // Contiguous view.
  TensorView(void* data, DType dtype, Shape shape, Device device = {});
  TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device = {});

  bool defined() const { return defined_; }
  void* data() const { return data_; }
  template <typename T>
  T* data_ptr() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  std::int64_t dim() const { return static_cast<std::int64_t>(shape_.size()); }
  // Size of dimension d; negative d counts from the end.
  std::int64_t size(std::int64_t d) const;
  std::int64_t stride(std::int64_t d) const;
  std::int64_t numel() const { return shape_numel(shape_); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype_); }
  bool is_contiguous() const;

  // Views sharing the same memory.
  TensorView transpose(std::int64_t d0, std::int64_t d1) const;
  TensorView narrow(std::int64_t d, std::int64_t start, std::int64_t length) const;
  // Contiguous views only; one size may be -1.
  TensorView reshape(Shape shape) const;

  // e.g. "bf16[4096, 2048] cpu" (strides shown when not contiguous).
  std::string str() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Shape shape_;
  Shape strides_;
  Device device_{};
  bool defined_ = false;
};

// An owning, contiguous tensor for standalone C++ use (CLI, tests, executor). CPU memory is
// 64-byte aligned, and from 32 MiB on 2 MiB aligned and advised onto transparent huge pages
// (madvise MADV_HUGEPAGE: taken where the system's THP mode is "madvise" or "always"); CUDA memory
// comes from the device's meshfuse memory pool (memory.h), allocated and freed stream-ordered on
// the given stream, which must outlive the tensor. Copies share the storage (like torch.Tensor);
// use clone() for a deep copy.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage.
  Tensor(Shape shape, DType dtype, Device device = {}, const Stream& stream = {});

  static Tensor zeros(Shape shape, DType dtype, Device device = {}, const Stream& stream = {});
  // A contiguous copy of any view, on the same device.
  static Tensor copy_of(const TensorView& src, const Stream& stream = {});
  // A contiguous copy on another device (or the same one).
  Tensor to(Device device, const Stream& stream = {}) const;

  bool defined() const { return view_.defined(); }
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable as a view
  template <typename T>
  T* data_ptr() const {
    return view_.data_ptr<T>();
  }
  DType dtype() const { return view_.dtype(); }
  Device device() const { return view_.device(); }
  const Shape& shape() const { return view_.shape(); }
  std::int64_t numel() const { return view_.numel(); }
  std::int64_t size(std::int64_t d) const { return view_.size(d); }
  Tensor clone(const Stream& stream = {}) const { return copy_of(view_, stream); }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// dst = src element by element, converting dtypes; any strides; shapes must match. Either side
// may be on the CPU or a CUDA device; CUDA work is queued on `stream` (a copy into CPU memory
// returns once the data has arrived).
void copy(const TensorView& src, const TensorView& dst, const Stream& stream = {});

// Every element of dst = `value` rounded once to dst's dtype; any strides; CPU or CUDA (queued on
// `stream`).
void fill(const TensorView& dst, double value, const Stream& stream = {});

}  // namespace meshfuse
