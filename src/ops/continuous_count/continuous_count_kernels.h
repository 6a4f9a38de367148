// continuous_count kernel interface shared by the front-end and the backends (internal).
#pragma once

#include <cstdint>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"

namespace meshfuse::detail {

struct CountShape {
  DType dtype;        // of x: i32 or i64
  std::int64_t n;     // elements of x
  std::int64_t bins;  // elements of out
};

// x: n contiguous values; out: bins contiguous i64 counts, all overwritten (values outside
// [0, bins) are not counted).
using CountFn = void(const CountShape&, const void* x, std::int64_t* out, const Stream&);

namespace reference {
CountFn continuous_count;
}  // namespace reference

namespace cpu {
CountFn continuous_count;
}  // namespace cpu

namespace cuda {
CountFn continuous_count;
}  // namespace cuda

}  // namespace meshfuse::detail
