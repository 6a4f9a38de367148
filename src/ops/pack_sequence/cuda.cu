// CUDA packing: a group of threads per output row (a packed row for pack, a padded row for
// unpack: every row is one copy or one zero fill, so the work is balanced whatever the sequence
// lengths), moving the row in the widest unit (16 bytes down to 1) that the row size and both
// buffers' alignment allow.
#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/pack_sequence/pack_sequence_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

constexpr int kThreads = 256;

// The sequence holding packed row t < T: the b with cu[b] <= t < cu[b + 1] (a binary search
// over the B + 1 offsets, which stay in cache; empty sequences are never the answer).
template <typename I>
__device__ std::int64_t sequence_of(const I* cu, std::int64_t batch, std::int64_t t) {
  std::int64_t lo = 0, hi = batch;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (cu[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// `group` threads (a power of two dividing kThreads) per output row; each row is `units` units
// of U. Every thread loads its two units before storing them (two loads in flight).
template <typename U, typename I, bool kUnpack>
__global__ void __launch_bounds__(kThreads)
    pack_kernel(PackShape s, const I* cu, const U* __restrict__ src, U* __restrict__ dst,
                std::int64_t units, int group) {
  const std::int64_t rows = kUnpack ? s.batch * s.seq_len : s.tokens;
  const std::int64_t per_block = kThreads / group;
  const int lane = threadIdx.x % group;
  for (std::int64_t r = blockIdx.x * per_block + threadIdx.x / group; r < rows;
       r += gridDim.x * per_block) {
    std::int64_t from = -1;  // the source row; -1: padding, written as zeros
    if constexpr (kUnpack) {
      const std::int64_t b = r / s.seq_len, len = cu[b + 1] - cu[b];
      const std::int64_t i = r - padded_row(b, 0, len, s.seq_len, s.side);
      if (i >= 0 && i < len) from = cu[b] + i;
    } else {
      const std::int64_t b = sequence_of(cu, s.batch, r);
      from = padded_row(b, r - cu[b], cu[b + 1] - cu[b], s.seq_len, s.side);
    }
    U* out = dst + r * units;
    for (std::int64_t c = lane; c < units; c += 2 * group) {
      const bool second = c + group < units;
      U a{}, b{};
      if (from >= 0) {
        const U* in = src + from * units;
        a = in[c];
        if (second) b = in[c + group];
      }
      out[c] = a;
      if (second) out[c + group] = b;
    }
  }
}

// Calls launch(U{}) with the widest unit dividing the row and aligning both buffers.
template <typename L>
void with_unit(std::int64_t row_bytes, const void* a, const void* b, L&& launch) {
  const auto fits = [&](std::int64_t w) {
    return row_bytes % w == 0 && reinterpret_cast<std::uintptr_t>(a) % w == 0 &&
           reinterpret_cast<std::uintptr_t>(b) % w == 0;
  };
  if (fits(16)) return launch(uint4{});
  if (fits(8)) return launch(uint2{});
  if (fits(4)) return launch(std::uint32_t{});
  if (fits(2)) return launch(std::uint16_t{});
  launch(std::uint8_t{});
}

template <bool kUnpack>
void run(const PackShape& s, const void* x, void* out, const Stream& stream, const char* op) {
  const std::int64_t rows = kUnpack ? s.batch * s.seq_len : s.tokens;
  if (rows == 0 || s.row_bytes == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_offsets(s.index_dtype, op, [&](auto index_tag) {
    using I = decltype(index_tag);
    with_unit(s.row_bytes, x, out, [&](auto unit_tag) {
      using U = decltype(unit_tag);
      const std::int64_t units = s.row_bytes / static_cast<std::int64_t>(sizeof(U));
      int group = 1;
      while (group < kThreads && group < units) group *= 2;
      pack_kernel<U, I, kUnpack>
          <<<grid_size(rows * group, kThreads), kThreads, 0, native(stream)>>>(
              s, static_cast<const I*>(s.cu_seqlens), static_cast<const U*>(x),
              static_cast<U*>(out), units, group);
    });
  });
  check_launch(op);
}

}  // namespace

void pack_sequence(const PackShape& s, const void* x, void* out, const Stream& stream) {
  run<false>(s, x, out, stream, "pack_sequence");
}

void unpack_sequence(const PackShape& s, const void* x, void* out, const Stream& stream) {
  run<true>(s, x, out, stream, "unpack_sequence");
}

}  // namespace meshfuse::detail::cuda
