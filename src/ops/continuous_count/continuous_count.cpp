// continuous_count front-end: checks and backend dispatch.
#include "meshfuse/ops/continuous_count.h"

#include "ops/common.h"
#include "ops/continuous_count/continuous_count_kernels.h"

namespace meshfuse {
namespace {

const auto kCount =
    MESHFUSE_KERNEL_TABLE("continuous_count", detail::kIndexDTypes, continuous_count);

}  // namespace

void continuous_count(const TensorView& x, const TensorView& out, const Stream& stream) {
  constexpr std::string_view op = "continuous_count";
  detail::check_defined(op, "x", x);
  detail::check_dtype(op, "x", x, {DType::I32, DType::I64});
  detail::check_rank(op, "x", x, 1);
  detail::check_defined(op, "out", out);
  detail::check_rank(op, "out", out, 1);
  detail::check_output(op, "out", out, out.shape(), DType::I64);
  detail::run_kernel(kCount, {{"x", x}, {"out", out}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       fn({x.dtype(), x.size(0), out.size(0)}, call.input(x).data(),
                          call.output(out).data_ptr<std::int64_t>(), call.stream());
                     });
}

}  // namespace meshfuse
