// Reference elementwise ops: one element at a time, walking each input's strides with a
// multi-index. Unlike the other references this one does not compute in double: the ops are
// defined as one fma (add) or one product (mul) in the compute type, rounded once, and the
// reference is that definition (the tests hold it against double results separately).
#include <cmath>

#include "ops/common.h"
#include "ops/elementwise/elementwise_kernels.h"

namespace meshfuse::detail::reference {
namespace {

// Calls f(i, offsets) for every element in row-major order: i its index, offsets[k] its offset
// in input k.
template <int K, typename F>
void for_each_element(const ElementwiseShape& s, const ElementwiseInput (&in)[K], F&& f) {
  std::int64_t index[kElementwiseMaxDims] = {};
  std::int64_t offsets[K] = {};
  for (std::int64_t i = 0; i < s.numel; ++i) {
    f(i, offsets);
    for (int d = s.dims - 1; d >= 0; --d) {  // advance the multi-index like an odometer
      for (int k = 0; k < K; ++k) offsets[k] += in[k].strides[d];
      if (++index[d] < s.sizes[d]) break;
      for (int k = 0; k < K; ++k) offsets[k] -= index[d] * in[k].strides[d];
      index[d] = 0;
    }
  }
}

template <typename T>
acc_t<T> at(const ElementwiseInput& in, std::int64_t offset) {
  return to_float(static_cast<const T*>(in.data)[offset]);
}

}  // namespace

void elementwise_add(const ElementwiseShape& s, ElementwiseInput a, ElementwiseInput b, void* out,
                     double alpha, const Stream&) {
  dispatch_float(s.dtype, "add", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A al = static_cast<A>(alpha);
    const ElementwiseInput in[2] = {a, b};
    for_each_element<2>(s, in, [&](std::int64_t i, const std::int64_t* o) {
      static_cast<T*>(out)[i] = store_as<T>(std::fma(al, at<T>(b, o[1]), at<T>(a, o[0])));
    });
  });
}

void elementwise_mul(const ElementwiseShape& s, ElementwiseInput a, void* out, double scalar,
                     const Stream&) {
  dispatch_float(s.dtype, "mul", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A sc = static_cast<A>(scalar);
    const ElementwiseInput in[1] = {a};
    for_each_element<1>(s, in, [&](std::int64_t i, const std::int64_t* o) {
      static_cast<T*>(out)[i] = store_as<T>(at<T>(a, o[0]) * sc);
    });
  });
}

}  // namespace meshfuse::detail::reference
