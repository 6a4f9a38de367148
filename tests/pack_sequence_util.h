// Inputs shared by the cpu and cuda pack_sequence tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "meshfuse/core/tensor.h"
#include "meshfuse/testing.h"

namespace meshfuse::test {

// pack_sequence and unpack_sequence copy bytes: every dtype.
inline const std::vector<DType> kAllDTypes = {DType::F32, DType::F64, DType::F16, DType::BF16,
                                              DType::I32, DType::I64, DType::U8,  DType::Bool};

// Integers in [0, 100) (0 or 1 for bool), exact in every dtype.
inline Tensor make_values(Shape shape, DType dtype, std::uint64_t seed) {
  Tensor ints(std::move(shape), DType::I64), t(ints.shape(), dtype);
  testing::fill_uniform_int(ints, seed, 0, dtype == DType::Bool ? 2 : 100);
  copy(ints, t);
  return t;
}

// cu_seqlens of `dtype` (i32 or i64) holding `cu`.
inline Tensor offsets(DType dtype, const std::vector<std::int64_t>& cu) {
  Tensor i64({static_cast<std::int64_t>(cu.size())}, DType::I64), t(i64.shape(), dtype);
  std::copy(cu.begin(), cu.end(), i64.data_ptr<std::int64_t>());
  copy(i64, t);
  return t;
}

}  // namespace meshfuse::test
