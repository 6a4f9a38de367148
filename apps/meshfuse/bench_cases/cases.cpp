#include "bench_cases/case.h"

namespace meshfuse::cli {

std::vector<BenchCase> all_cases() {
  std::vector<BenchCase> cases;
  for (auto family : {rmsnorm_cases, linear_cases, swiglu_cases, softmax_cases, cross_entropy_cases,
                      fused_linear_cross_entropy_cases, recurrent_cases, pack_sequence_cases}) {
    for (BenchCase& c : family()) cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace meshfuse::cli
