// Elementwise kernel interface shared by the front-end and the backends (internal).
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "core/numeric.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse::detail {

// Dimensions a kernel indexes, at most. Inputs that need more once merged (elementwise_layout)
// are made contiguous by the front-end first.
inline constexpr int kElementwiseMaxDims = 6;

// The common shape of a call with its dimensions of size 1 dropped and neighbours merged wherever
// every input steps through the pair as through one dimension (out, contiguous, always does): a
// call on contiguous inputs has one dimension of numel elements. dims >= 1.
struct ElementwiseShape {
  DType dtype;
  std::int64_t numel;
  int dims;
  std::int64_t sizes[kElementwiseMaxDims];
};

// One input: element (i_0, ..., i_{dims-1}) is at data + sum_d i_d * strides[d] elements; strides
// of any sign, 0 where the input repeats. linear: that offset is always the element's row-major
// index (the input is laid out as out is), which lets kernels skip the index arithmetic.
struct ElementwiseInput {
  const void* data;
  std::int64_t strides[kElementwiseMaxDims];
  bool linear;
};

struct ElementwiseLayout {
  ElementwiseShape shape;
  ElementwiseInput inputs[2];  // the first inputs.size() are set
};

// The merged layout of `inputs` (1 or 2 views of one shape and dtype); nullopt when they need
// more than kElementwiseMaxDims dimensions.
std::optional<ElementwiseLayout> elementwise_layout(std::span<const TensorView> inputs);

// The offset in elements of the element of row-major index i; int64 throughout, as tensors pass
// 2^31 elements. The CUDA kernels call it too.
MESHFUSE_HOST_DEVICE inline std::int64_t element_offset(const ElementwiseShape& s,
                                                        const ElementwiseInput& in,
                                                        std::int64_t i) {
  if (in.linear) return i;
  std::int64_t offset = 0;
  for (int d = s.dims - 1; d > 0; --d) {
    const std::int64_t q = i / s.sizes[d];
    offset += (i - q * s.sizes[d]) * in.strides[d];
    i = q;
  }
  return offset + i * in.strides[0];
}

// out = a + alpha * b, out contiguous (it may be a's or b's own data when that input is linear).
using ElementwiseAddFn = void(const ElementwiseShape&, ElementwiseInput a, ElementwiseInput b,
                              void* out, double alpha, const Stream&);
// out = a * scalar, out contiguous (it may be a's own data when a is linear).
using ElementwiseMulFn = void(const ElementwiseShape&, ElementwiseInput a, void* out, double scalar,
                              const Stream&);

namespace reference {
ElementwiseAddFn elementwise_add;
ElementwiseMulFn elementwise_mul;
}  // namespace reference

namespace cpu {
ElementwiseAddFn elementwise_add;
ElementwiseMulFn elementwise_mul;
}  // namespace cpu

namespace cuda {
ElementwiseAddFn elementwise_add;
ElementwiseMulFn elementwise_mul;
}  // namespace cuda

}  // namespace meshfuse::detail
