// Element-wise reductions of CPU buffers for the CPU communicator backends.
#include "distributed/reduce.h"

#include <algorithm>
#include <type_traits>

#include "core/numeric.h"
#include "distributed/combine.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

namespace {

// Calls f(T{}) with the element type of every reducible dtype.
template <typename F>
void dispatch_reducible(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      return f(float{});
    case DType::F64:
      return f(double{});
    case DType::F16:
      return f(float16{});
    case DType::BF16:
      return f(bfloat16{});
    case DType::I32:
      return f(std::int32_t{});
    case DType::I64:
      return f(std::int64_t{});
    case DType::U8:
      return f(std::uint8_t{});
    case DType::U32:
      return f(std::uint32_t{});
    case DType::Bool:
      break;
  }
  fail(ErrorCode::InvalidArgument, "communicator: cannot reduce {} tensors", to_string(dtype));
}

template <typename T>
using compute_t = std::conditional_t<std::is_integral_v<T>, T, acc_t<T>>;

template <typename T>
compute_t<T> to_compute(T x) {
  if constexpr (std::is_integral_v<T>)
    return x;
  else
    return to_float(x);
}

// In blocks of kBlock elements combined in a C scratch, source after source: vectorisable loops,
// and 16-bit values rounded once per element.
template <typename T, ReduceOp Op>
void reduce_typed(const std::vector<const void*>& srcs, void* dst, std::int64_t n) {
  using C = compute_t<T>;
  constexpr std::int64_t kBlock = 1024;
  C acc[kBlock];
  T* out = static_cast<T*>(dst);
  for (std::int64_t b = 0; b < n; b += kBlock) {
    const std::int64_t m = std::min(kBlock, n - b);
    const T* first = static_cast<const T*>(srcs[0]) + b;
    for (std::int64_t i = 0; i < m; ++i) acc[i] = static_cast<C>(to_compute(first[i]));
    for (std::size_t s = 1; s < srcs.size(); ++s) {
      const T* x = static_cast<const T*>(srcs[s]) + b;
      for (std::int64_t i = 0; i < m; ++i) acc[i] = combine<Op, C>(acc[i], to_compute(x[i]));
    }
    if constexpr (Op == ReduceOp::Avg && !std::is_integral_v<T>) {
      const C k = static_cast<C>(srcs.size());
      for (std::int64_t i = 0; i < m; ++i) acc[i] /= k;
    }
    if constexpr (std::is_integral_v<T>)
      std::copy(acc, acc + m, out + b);
    else
      for (std::int64_t i = 0; i < m; ++i) out[b + i] = store_as<T>(acc[i]);
  }
}

}  // namespace

void check_reducible(DType dtype, ReduceOp op, std::string_view what) {
  if (reducible(dtype, op)) return;
  if (dtype == DType::Bool)
    fail(ErrorCode::InvalidArgument, "{}: cannot reduce bool tensors (use u8)", what);
  fail(ErrorCode::InvalidArgument, "{}: avg needs a floating dtype, got {}", what,
       to_string(dtype));
}

void reduce_buffers(DType dtype, ReduceOp op, const std::vector<const void*>& srcs, void* dst,
                    std::int64_t n) {
  dispatch_reducible(dtype, [&](auto t) {
    using T = decltype(t);
    switch (op) {
      case ReduceOp::Sum:
        return reduce_typed<T, ReduceOp::Sum>(srcs, dst, n);
      case ReduceOp::Prod:
        return reduce_typed<T, ReduceOp::Prod>(srcs, dst, n);
      case ReduceOp::Min:
        return reduce_typed<T, ReduceOp::Min>(srcs, dst, n);
      case ReduceOp::Max:
        return reduce_typed<T, ReduceOp::Max>(srcs, dst, n);
      case ReduceOp::Avg:
        return reduce_typed<T, ReduceOp::Avg>(srcs, dst, n);
    }
  });
}

void divide_buffer(DType dtype, void* data, std::int64_t n, int divisor) {
  dispatch_float(dtype, "communicator avg", [&](auto t) {
    using T = decltype(t);
    T* p = static_cast<T*>(data);
    for (std::int64_t i = 0; i < n; ++i)
      p[i] = store_as<T>(to_float(p[i]) / static_cast<acc_t<T>>(divisor));
  });
}

}  // namespace meshfuse::detail
