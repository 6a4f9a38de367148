// rmsnorm of one row through the installed headers and library; exits 0 when the value is right.
#include <cmath>
#include <cstdio>

#include "meshfuse/meshfuse.h"

int main() {
  using namespace meshfuse;
  float x[4] = {1, 2, 3, 4}, weight[4] = {1, 1, 2, 1}, y[4];
  rmsnorm(TensorView(x, DType::F32, {1, 4}), TensorView(weight, DType::F32, {4}),
          TensorView(y, DType::F32, {1, 4}), TensorView(), 0.0);
  const double want = 3 * 2 / std::sqrt(30.0 / 4);  // x[2] * weight[2] / rms(x)
  std::printf("rmsnorm: y[2] = %.7f, want %.7f\n", y[2], want);
  return std::fabs(y[2] - want) <= 1e-6 * want ? 0 : 1;
}
