#include "meshfuse/core/tensor.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/huge_pages.h"
#include "core/numeric.h"
#include "meshfuse/core/error.h"

#ifdef MESHFUSE_WITH_CUDA
#include "core/cuda/runtime.h"
#endif

namespace meshfuse {
namespace {

std::int64_t wrap_dim(std::int64_t d, std::int64_t rank, const char* what) {
  const std::int64_t wrapped = d < 0 ? d + rank : d;
  MESHFUSE_CHECK(wrapped >= 0 && wrapped < rank, ErrorCode::InvalidArgument,
                 "{}: dimension {} out of range for a tensor of rank {}", what, d, rank);
  return wrapped;
}

std::shared_ptr<void> allocate(Device device, std::size_t bytes, const Stream& stream) {
  // A CUDA stream belongs to one device: allocating on it for another would put the memory there.
  MESHFUSE_CHECK(stream.device.type != DeviceType::CUDA || stream.device == device,
                 ErrorCode::DeviceMismatch, "Tensor: allocating on {} with a stream of {}",
                 device.str(), stream.device.str());
  if (device.type == DeviceType::CUDA) {
#ifdef MESHFUSE_WITH_CUDA
    detail::check_cuda_device(device, "Tensor");
    return detail::cuda_allocate(device, bytes, stream);
#else
    (void)stream;
    fail(ErrorCode::BackendUnavailable,
         "Tensor: cannot allocate on {}: this build of meshfuse has no CUDA support", device.str());
#endif
  }
  // Buffers of 32 MiB or more on 2 MiB transparent huge pages, where the system gives them on
  // request (THP "madvise" or "always"; "never" turns this off): kernels streaming several such
  // buffers take fewer TLB misses (docs/kernels/common.md). The rounding wastes at most one huge
  // page per buffer.
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const bool huge = bytes >= detail::kMinHugePageBuffer;
  const std::size_t align = huge ? kHugePage : 64;
  const std::size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  MESHFUSE_CHECK(p != nullptr, ErrorCode::OutOfMemory, "Tensor: cannot allocate {} bytes on cpu",
                 bytes);
  if (huge) detail::advise_huge_pages(p, rounded);
  return {p, std::free};
}

template <typename T>
double load(const void* p) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>)
    return to_float(*static_cast<const T*>(p));
  else
    return static_cast<double>(*static_cast<const T*>(p));
}

template <typename T>
void store(void* p, double v) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>)
    *static_cast<T*>(p) = from_double<T>(v);  // rounded once, also from f64
  else if constexpr (std::is_same_v<T, bool>)
    *static_cast<bool*>(p) = v != 0.0;
  else if constexpr (std::is_unsigned_v<T>)  // modulo 2^bits, as PyTorch: -1 -> 255 in u8
    *static_cast<T*>(p) = static_cast<T>(static_cast<std::int64_t>(v));
  else
    *static_cast<T*>(p) = static_cast<T>(v);
}

using LoadFn = double (*)(const void*);
using StoreFn = void (*)(void*, double);

// dst = src converted, both contiguous, with load and store inlined: the per-element loop of
// copy() below pays an index computation and two indirect calls per element.
template <typename S, typename D>
void convert(const void* src, void* dst, std::int64_t n) {
  const auto* in = static_cast<const S*>(src);
  auto* out = static_cast<D*>(dst);
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<S, double> || std::is_same_v<D, double>)
      store<D>(out + i, load<S>(in + i));
    else  // S is exact in a float: one rounding, which vectorises, without the trip through double
      out[i] = from_float<D>(to_float(in[i]));
  }
}

LoadFn loader(DType d) {
  switch (d) {
    case DType::F32: return load<float>;
    case DType::F64: return load<double>;
    case DType::F16: return load<float16>;
    case DType::BF16: return load<bfloat16>;
    case DType::I32: return load<std::int32_t>;
    case DType::I64: return load<std::int64_t>;
    case DType::U8: return load<std::uint8_t>;
    case DType::U32: return load<std::uint32_t>;
    case DType::Bool: return load<bool>;
  }
  return nullptr;
}

StoreFn storer(DType d) {
  switch (d) {
    case DType::F32: return store<float>;
    case DType::F64: return store<double>;
    case DType::F16: return store<float16>;
    case DType::BF16: return store<bfloat16>;
    case DType::I32: return store<std::int32_t>;
    case DType::I64: return store<std::int64_t>;
    case DType::U8: return store<std::uint8_t>;
    case DType::U32: return store<std::uint32_t>;
    case DType::Bool: return store<bool>;
  }
  return nullptr;
}

}  // namespace

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<std::int64_t>(shape[i], 1);
  }
  return strides;
}

std::int64_t shape_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) {
    MESHFUSE_CHECK(s >= 0, ErrorCode::InvalidArgument, "shape {}: sizes must be >= 0, got {}",
                   shape_str(shape), s);
    MESHFUSE_CHECK(s == 0 || n <= std::numeric_limits<std::int64_t>::max() / s,
                   ErrorCode::InvalidArgument, "shape {}: element count overflows int64",
                   shape_str(shape));
    n *= s;
  }
  return n;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

TensorView::TensorView(void* data, DType dtype, Shape shape, Device device)
    : TensorView(data, dtype, shape, contiguous_strides(shape), device) {}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device)
    : data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      device_(device),
      defined_(true) {
  MESHFUSE_CHECK(shape_.size() == strides_.size(), ErrorCode::InvalidArgument,
                 "TensorView: shape {} and strides {} differ in rank", shape_str(shape_),
                 shape_str(strides_));
  const std::int64_t n = shape_numel(shape_);
  MESHFUSE_CHECK(n == 0 || data_ != nullptr, ErrorCode::InvalidArgument,
                 "TensorView: null data for a non-empty tensor of shape {}", shape_str(shape_));
}

std::int64_t TensorView::size(std::int64_t d) const {
  return shape_[wrap_dim(d, dim(), "TensorView::size")];
}

std::int64_t TensorView::stride(std::int64_t d) const {
  return strides_[wrap_dim(d, dim(), "TensorView::stride")];
}

bool TensorView::is_contiguous() const {
  // No elements: any strides (NumPy gives an empty array's every dim stride 0).
  if (numel() == 0) return true;
  std::int64_t expected = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

TensorView TensorView::transpose(std::int64_t d0, std::int64_t d1) const {
  Shape shape = shape_, strides = strides_;
  const std::int64_t a = wrap_dim(d0, dim(), "transpose"), b = wrap_dim(d1, dim(), "transpose");
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  return {data_, dtype_, shape, strides, device_};
}

TensorView TensorView::narrow(std::int64_t d, std::int64_t start, std::int64_t length) const {
  const std::int64_t w = wrap_dim(d, dim(), "narrow");
  MESHFUSE_CHECK(start >= 0 && length >= 0 && start + length <= shape_[w],
                 ErrorCode::InvalidArgument,
                 "narrow: range [{}, {}) out of bounds for dimension {} of size {}", start,
                 start + length, d, shape_[w]);
  Shape shape = shape_;
  shape[w] = length;
  char* p = static_cast<char*>(data_);
  if (length > 0) p += start * strides_[w] * static_cast<std::int64_t>(element_size(dtype_));
  return {p, dtype_, shape, strides_, device_};
}

TensorView TensorView::reshape(Shape shape) const {
  MESHFUSE_CHECK(is_contiguous(), ErrorCode::InvalidArgument,
                 "reshape: needs a contiguous tensor, got {}", str());
  std::int64_t known = 1, infer = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MESHFUSE_CHECK(infer < 0, ErrorCode::InvalidArgument, "reshape: more than one -1 in {}",
                     shape_str(shape));
      infer = static_cast<std::int64_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) shape[infer] = known == 0 ? 0 : numel() / known;
  MESHFUSE_CHECK(shape_numel(shape) == numel(), ErrorCode::ShapeMismatch,
                 "reshape: cannot view {} as {}", str(), shape_str(shape));
  return {data_, dtype_, std::move(shape), device_};
}

std::string TensorView::str() const {
  if (!defined_) return "undefined";
  if (is_contiguous())
    return fmt::format("{}{} {}", to_string(dtype_), shape_str(shape_), device_.str());
  return fmt::format("{}{} strides {} {}", to_string(dtype_), shape_str(shape_),
                     shape_str(strides_), device_.str());
}

Tensor::Tensor(Shape shape, DType dtype, Device device, const Stream& stream) {
  const std::int64_t n = shape_numel(shape);
  // Half the address space at most: the byte count, and its rounding in allocate, cannot wrap.
  MESHFUSE_CHECK(static_cast<std::uint64_t>(n) <=
                     std::numeric_limits<std::size_t>::max() / 2 / element_size(dtype),
                 ErrorCode::OutOfMemory, "Tensor: {} elements of {} ({}) exceed the address space",
                 n, to_string(dtype), shape_str(shape));
  storage_ = allocate(device, static_cast<std::size_t>(n) * element_size(dtype), stream);
  view_ = TensorView(storage_.get(), dtype, std::move(shape), device);
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device, const Stream& stream) {
  Tensor t(std::move(shape), dtype, device, stream);
  fill(t, 0.0, stream);
  return t;
}

Tensor Tensor::copy_of(const TensorView& src, const Stream& stream) {
  Tensor t(src.shape(), src.dtype(), src.device(), stream);
  copy(src, t, stream);
  return t;
}

Tensor Tensor::to(Device device, const Stream& stream) const {
  Tensor t(shape(), dtype(), device, stream);
  copy(view_, t, stream);
  return t;
}

void copy(const TensorView& src, const TensorView& dst, const Stream& stream) {
  MESHFUSE_CHECK(src.shape() == dst.shape(), ErrorCode::ShapeMismatch,
                 "copy: src {} and dst {} differ in shape", src.str(), dst.str());
  if (src.device().type == DeviceType::CUDA || dst.device().type == DeviceType::CUDA) {
#ifdef MESHFUSE_WITH_CUDA
    return detail::cuda_copy(src, dst, stream);
#else
    (void)stream;
    fail(ErrorCode::BackendUnavailable,
         "copy: {} -> {} needs CUDA, and this build of meshfuse has no CUDA support", src.str(),
         dst.str());
#endif
  }
  const std::int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    std::memmove(dst.data(), src.data(), src.nbytes());
    return;
  }
  if (src.is_contiguous() && dst.is_contiguous() && is_floating_point(src.dtype()) &&
      is_floating_point(dst.dtype())) {
    detail::dispatch_float(src.dtype(), "copy", [&](auto s) {
      detail::dispatch_float(dst.dtype(), "copy", [&](auto d) {
        convert<decltype(s), decltype(d)>(src.data(), dst.data(), n);
      });
    });
    return;
  }
  const LoadFn ld = loader(src.dtype());
  const StoreFn st = storer(dst.dtype());
  const auto es = static_cast<std::int64_t>(element_size(src.dtype()));
  const auto ed = static_cast<std::int64_t>(element_size(dst.dtype()));
  const bool same_dtype = src.dtype() == dst.dtype();
  const std::int64_t rank = src.dim();
  Shape index(rank, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t so = 0, d_off = 0;
    for (std::int64_t d = 0; d < rank; ++d) {
      so += index[d] * src.strides()[d];
      d_off += index[d] * dst.strides()[d];
    }
    char* out = static_cast<char*>(dst.data()) + d_off * ed;
    const char* in = static_cast<const char*>(src.data()) + so * es;
    if (same_dtype)  // bitwise: no round trip through double (int64 beyond 2^53, NaN payloads)
      std::memcpy(out, in, static_cast<std::size_t>(es));
    else
      st(out, ld(in));
    for (std::int64_t d = rank - 1; d >= 0; --d) {
      if (++index[d] < src.shape()[d]) break;
      index[d] = 0;
    }
  }
}

void fill(const TensorView& dst, double value, const Stream& stream) {
  if (dst.numel() == 0) return;
  if (dst.device().type == DeviceType::CPU && dst.is_contiguous()) {
    auto* bytes = static_cast<unsigned char*>(dst.data());
    const std::size_t total = dst.nbytes();
    if (value == 0 && !std::signbit(value)) {
      std::memset(bytes, 0, total);  // +0 is all zero bits in every dtype
      return;
    }
    // One element converted as copy() converts a double, then repeated by doubling copies (at
    // memcpy's speed; the broadcast copy below converts every element).
    storer(dst.dtype())(bytes, value);
    for (std::size_t done = element_size(dst.dtype()); done < total;) {
      const std::size_t n = std::min(done, total - done);
      std::memcpy(bytes + done, bytes, n);
      done += n;
    }
    return;
  }
  // A copy from one element broadcast by zero strides: the copy converts it, on the device. A
  // contiguous dst goes as one dimension (CUDA's strided copy takes rank 8 at most).
  const TensorView to = dst.is_contiguous() ? dst.reshape({dst.numel()}) : dst;
  Tensor one({1}, DType::F64);
  *one.data_ptr<double>() = value;
  if (dst.device().type != DeviceType::CPU) one = one.to(dst.device(), stream);
  copy(TensorView(one.view().data(), DType::F64, to.shape(), Shape(to.shape().size(), 0),
                  dst.device()),
       to, stream);
}

}  // namespace meshfuse

namespace meshfuse::detail {

void advise_huge_pages(void* p, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kMinHugePageBuffer) return;
  static const std::uintptr_t huge = [] {
    unsigned long size = 0;
    if (std::FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r")) {
      if (std::fscanf(f, "%lu", &size) != 1) size = 0;
      std::fclose(f);
    }
    return std::uintptr_t{size > 0 && std::has_single_bit(size) ? size : 2ul << 20};
  }();
  const auto begin = (reinterpret_cast<std::uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(p) + bytes) & ~(huge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace meshfuse::detail
