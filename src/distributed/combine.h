// How the communicators' element-wise reductions combine two values, shared by the host's loops
// (reduce.cpp) and the local communicator's CUDA kernel (local_reduce.cu), so that both give the
// same bits: integers wrap in their own type, NaN wins min and max (as torch.minimum and
// torch.maximum). Internal; host and CUDA code.
#pragma once

#include <type_traits>

#include "core/numeric.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::detail {

template <typename C>
MESHFUSE_HOST_DEVICE bool is_nan(C x) {
  if constexpr (std::is_floating_point_v<C>)
    return x != x;
  else
    return false;
}

// acc op x, in the compute type C (fp32 for 16-bit values, the type itself otherwise).
template <ReduceOp Op, typename C>
MESHFUSE_HOST_DEVICE C combine(C acc, C x) {
  if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Avg)
    return static_cast<C>(acc + x);
  else if constexpr (Op == ReduceOp::Prod)
    return static_cast<C>(acc * x);
  else if constexpr (Op == ReduceOp::Min)
    return (x < acc || is_nan(x)) ? x : acc;
  else
    return (x > acc || is_nan(x)) ? x : acc;
}

}  // namespace meshfuse::detail
