// RMSNorm kernel interface shared by the front-end and the backends (internal). One pair of
// kernels serves rmsnorm and fused_residual_add_rmsnorm: rmsnorm is the fused form without a
// residual and with multiplier 1.
#pragma once

#include <cstdint>
#include <type_traits>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"

namespace meshfuse::detail {

// Every tensor is contiguous: (rows, cols) with row stride cols; weight and dweight are (cols,),
// rstd is (rows,) of rstd_t<T>. Optional pointers are null when absent.
struct RmsNormShape {
  DType dtype;
  std::int64_t rows;
  std::int64_t cols;
};

struct RmsNormForwardArgs {
  const void* x;
  const void* residual;  // optional; r is written exactly when it is given
  const void* weight;    // optional (1)
  void* y;
  void* r;
  void* rstd;  // optional
  double eps;
  double multiplier;
};

struct RmsNormBackwardArgs {
  const void* grad_y;
  const void* grad_r;  // optional
  const void* input;   // r, or x when the forward had no residual
  const void* weight;  // optional (1)
  const void* rstd;
  void* dx;
  void* dresidual;     // optional
  void* dweight;       // optional
  double input_scale;  // r = input * input_scale: 1 for r, the multiplier for x
  double multiplier;
};

// rstd's element type for rows of T (rmsnorm_rstd_dtype).
template <typename T>
using rstd_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

using RmsNormForwardFn = void(const RmsNormShape&, const RmsNormForwardArgs&, const Stream&);
using RmsNormBackwardFn = void(const RmsNormShape&, const RmsNormBackwardArgs&, const Stream&);

namespace reference {
RmsNormForwardFn rmsnorm_forward;
RmsNormBackwardFn rmsnorm_backward;
}  // namespace reference

namespace cpu {
RmsNormForwardFn rmsnorm_forward;
RmsNormBackwardFn rmsnorm_backward;
}  // namespace cpu

namespace cuda {
RmsNormForwardFn rmsnorm_forward;
RmsNormBackwardFn rmsnorm_backward;
}  // namespace cuda

}  // namespace meshfuse::detail
