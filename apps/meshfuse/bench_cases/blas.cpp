#include "bench_cases/blas.h"

#include <oneapi/dnnl/dnnl.h>

#include "meshfuse/core/error.h"
#include "ops/gemm/cpu_blas.h"

namespace meshfuse::cli {

std::string vendor_gemm() {
  std::string library = detail::cpu::cpu_blas_library();
  library = library.substr(0, library.find(" ("));  // without MKL's file
  return library + " sgemm (f32)";
}

void vendor_sgemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
                  std::int64_t k, const float* a, const float* b, float* c) {
  const std::int64_t lda = transpose_a ? m : k, ldb = transpose_b ? k : n;
  if (const detail::cpu::MklSgemm mkl = detail::cpu::mkl_sgemm()) {
    using namespace detail::cpu;
    return mkl(kCblasRowMajor, transpose_a ? kCblasTrans : kCblasNoTrans,
               transpose_b ? kCblasTrans : kCblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c,
               n);
  }
  const dnnl_status_t status = dnnl_sgemm(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k,
                                          1.0f, a, lda, b, ldb, 0.0f, c, n);
  MESHFUSE_CHECK(status == dnnl_success, ErrorCode::Internal,
                 "bench: dnnl_sgemm ({} x {} x {}) failed with status {}", m, n, k,
                 static_cast<int>(status));
}

}  // namespace meshfuse::cli
