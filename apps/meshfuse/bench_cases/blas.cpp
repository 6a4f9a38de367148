#include "bench_cases/blas.h"

#include <oneapi/dnnl/dnnl.h>

#include "meshfuse/core/error.h"

namespace meshfuse::cli {

void vendor_sgemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
                  std::int64_t k, const float* a, const float* b, float* c) {
  const dnnl_status_t status =
      dnnl_sgemm(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k, 1.0f, a,
                 transpose_a ? m : k, b, transpose_b ? k : n, 0.0f, c, n);
  MESHFUSE_CHECK(status == dnnl_success, ErrorCode::Internal,
                 "bench: dnnl_sgemm ({} x {} x {}) failed with status {}", m, n, k,
                 static_cast<int>(status));
}

}  // namespace meshfuse::cli
