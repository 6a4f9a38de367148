// CUDA fused linear cross-entropy: chunks of rows, as on the cpu; per chunk the logits in the
// compute type A (fp32, f64 for f64) from a cuBLASLt GEMM, the cuda cross-entropy row kernels
// (the gradient written over the logits), then the chunk's share of the three gradients.
//
// Why this is not the cpu loop with other kernels: the cpu BLAS multiplies fp32 only, so the cpu
// loop widens 16-bit operands into fp32 staging buffers (x per chunk, the weight per block of
// rows, grad_x per chunk). cuBLASLt multiplies bf16 / f16 directly with fp32 accumulation and an
// fp32 or 16-bit output (GemmProblem::out_dtype), so here there is no staging, no weight blocks
// and no widening; instead the two gradient GEMMs need the logits' gradient in the operand dtype
// (cuBLASLt takes no f32 x bf16 product, and an fp32 x fp32 one runs at a small fraction of the
// tensor-core rate), so for 16-bit types each chunk's fp32 gradient is rounded once to the input
// dtype, in place (as the unfused linear + cross_entropy and Liger Kernel use it; the loss, lse
// and grad_bias still come from the fp32 logits). The per-row state (lse, row losses, upstream)
// lives on the device, and the helpers that read it (check_labels, read_upstream, store_loss) are
// the cuda ones of cross_entropy_kernels.h. What is shared is every kernel: the GEMM, the
// cross-entropy rows, the label check and the loss reduction.
//
// grad_weight: each chunk's GEMM adds its product into grad_weight in place (beta = 1 from the
// second chunk, C = D), in grad_weight's dtype: fp32 (f64) sums for an f32 (f64) grad_weight, the
// 16-bit running sum plus the fp32 product rounded once per chunk for a 16-bit one (the header says
// what that costs in accuracy). No V x H scratch: with chunks of K >= ~1024 rows each GEMM is
// compute-bound, where an fp32 accumulator beside a 16-bit output would add 8 bytes of traffic per
// element and chunk, and V x H x 4 bytes of memory.
//
// Memory (all on the caller's stream, released when the call returns): the chunk's logits,
// min(chunk_rows, N) x V x sizeof(A); V x 4 for a 16-bit bias in fp32 (the epilogue adds it to
// fp32 logits); V x 8 for grad_bias's double accumulator; N x (8 + 8 + 8) for lse (double for
// fp32 and f64 logits: cross_entropy_lse_dtype), row losses and upstream; plus cuBLASLt's workspace
// (<= 32 MiB).
//
// Determinism: a fixed sequence of kernels with fixed shapes per chunk_rows; cuBLASLt's choice is
// cached per problem (gemm/cuda.cu); grad_bias sums each column in row order; no atomics. The only
// host synchronisation is check_labels' (none with LabelCheck::DeviceAssert or under CUDA graph
// capture).
#include <algorithm>

#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/fused_linear_cross_entropy/fused_linear_cross_entropy_kernels.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";

// acc[j] += sum over the rows of d (rows, cols), each column in row order, in double (as the cpu
// backend); one thread per column (adjacent threads read adjacent columns).
template <typename A>
__global__ void add_column_sums_kernel(const A* d, std::int64_t rows, std::int64_t cols,
                                       double* acc) {
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  double sum = acc[j];
  for (std::int64_t i = 0; i < rows; ++i) sum += d[i * cols + j];
  acc[j] = sum;
}

// Row i of the fp32 matrix d (rows, cols) rounded to T into the first half of its own storage:
// the T rows then have leading dimension 2 * cols. One block per row, a tile of 4 * blockDim.x
// elements at a time: every thread reads its 4 elements (one 16-byte load when the rows are
// 16-byte aligned, cols % 4 == 0), the block waits, then each writes. Tile k's T elements lie in
// bytes [0, 2 (k + 1) B) of the row (B the tile's elements), which tiles 0..k have already read,
// and later tiles read beyond them, so no value is overwritten before it is read.
template <typename T>
__global__ void narrow_rows_kernel(float* d, std::int64_t rows, std::int64_t cols) {
  constexpr int kPer = 4;
  const bool vec = cols % kPer == 0;  // d comes from a Tensor: 256-byte aligned
  const std::int64_t tile = static_cast<std::int64_t>(blockDim.x) * kPer;
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    float* row = d + i * cols;
    T* out = reinterpret_cast<T*>(row);
    for (std::int64_t j0 = 0; j0 < cols; j0 += tile) {
      // Element k of this thread: j0 + 4 t + k when vectorised, else j0 + k blockDim + t.
      const std::int64_t first = vec ? j0 + threadIdx.x * kPer : j0 + threadIdx.x;
      const std::int64_t step = vec ? 1 : blockDim.x;
      Vec<float, kPer> v{};
      if (vec && first < cols) {
        v = *reinterpret_cast<const Vec<float, kPer>*>(row + first);
      } else if (!vec) {
        for (int k = 0; k < kPer; ++k)
          if (first + k * step < cols) v.v[k] = row[first + k * step];
      }
      __syncthreads();
      if (vec && first < cols) {
        Vec<T, kPer> t;
        for (int k = 0; k < kPer; ++k) t.v[k] = store<T>(v.v[k]);
        *reinterpret_cast<Vec<T, kPer>*>(out + first) = t;
      } else if (!vec) {
        for (int k = 0; k < kPer; ++k)
          if (first + k * step < cols) out[first + k * step] = store<T>(v.v[k]);
      }
    }
  }
}

GemmMatrix row_major(const void* data, std::int64_t ld) {
  return {const_cast<void*>(data), std::max<std::int64_t>(ld, 1), 0, false};
}
GemmMatrix transposed(const void* data, std::int64_t ld) {
  return {const_cast<void*>(data), std::max<std::int64_t>(ld, 1), 0, true};
}

// d (m, n) [out: out_dtype] = a (m, k) @ b (k, n) [ + d when accumulate] [ + the row `row`].
void matmul(DType dtype, DType out_dtype, std::int64_t m, std::int64_t n, std::int64_t k,
            GemmMatrix a, GemmMatrix b, GemmMatrix d, bool accumulate, const void* row,
            const Stream& stream) {
  const GemmMatrix c = accumulate ? d
                       : row      ? GemmMatrix{const_cast<void*>(row), 0, 0, false}
                                  : GemmMatrix{};
  gemm({dtype, 1, m, n, k, 1.0, c.data ? 1.0 : 0.0, kOp, out_dtype}, a, b, c, d, stream);
}

// A device tensor on the op's stream (an undefined one when empty).
Tensor scratch(DType dtype, const Shape& shape, const Stream& stream) {
  return shape_numel(shape) > 0 ? Tensor(shape, dtype, stream.device, stream) : Tensor();
}

void zero(void* data, std::int64_t bytes, const Stream& stream) {
  if (bytes > 0)
    check(cudaMemsetAsync(data, 0, static_cast<std::size_t>(bytes), native(stream)), kOp);
}

template <typename T>
void run(const FusedLinearCrossEntropyShape& s, DType label_dtype,
         const FusedLinearCrossEntropyArgs& a, const CrossEntropyOptions& o, const Stream& stream) {
  using A = acc_t<T>;
  constexpr bool kNarrow = !std::is_same_v<T, A>;
  const DType dt = s.dtype, at = dtype_of<A>();
  const std::int64_t n = s.rows, h = s.hidden, v = s.vocab;
  const CrossEntropyShape ce{dt, a.loss_dtype, label_dtype, n, v};
  const Tensor verdict = check_labels(kOp, ce, a.labels, o, stream);
  const bool grads = a.grad_x || a.grad_weight || a.grad_bias;
  const std::int64_t chunk = std::min(s.chunk_rows, n);

  const Tensor logits = scratch(at, {chunk * v}, stream),
               lse = scratch(cross_entropy_lse_dtype(at), {n}, stream),
               row_loss = scratch(DType::F64, {n}, stream);
  Tensor row_grad;
  const CrossEntropyUpstream up =
      grads ? read_upstream(ce, a.grad_loss, verdict, o.reduction, row_grad, stream)
            : CrossEntropyUpstream{0.0, nullptr};
  Tensor bias32;
  const void* bias = a.bias;
  if (kNarrow && a.bias) {
    bias32 = scratch(at, {v}, stream);
    copy(TensorView(const_cast<void*>(a.bias), dt, {v}, stream.device), bias32, stream);
    bias = bias32.view().data();
  }
  const Tensor db64 = a.grad_bias ? scratch(DType::F64, {v}, stream) : Tensor();  // accumulator
  double* const db = db64.defined() ? db64.data_ptr<double>() : nullptr;
  if (db) zero(db, v * std::int64_t{sizeof(double)}, stream);
  if (a.grad_weight && n == 0)
    zero(a.grad_weight, v * h * static_cast<std::int64_t>(element_size(a.grad_weight_dtype)),
         stream);

  const T* w = static_cast<const T*>(a.weight);
  A* l = logits.defined() ? logits.data_ptr<A>() : nullptr;
  for (std::int64_t r0 = 0; r0 < n; r0 += chunk) {
    const std::int64_t c = std::min(chunk, n - r0);
    const T* xc = static_cast<const T*>(a.x) + r0 * h;
    matmul(dt, at, c, v, h, row_major(xc, h), transposed(w, h), row_major(l, v), false, bias,
           stream);
    const CrossEntropyRows rows{at, label_dtype, r0, c, v};
    cross_entropy_forward_rows(rows, l, a.labels, lse.view().data(), row_loss.data_ptr<double>(), o,
                               stream);
    if (!grads) continue;
    cross_entropy_backward_rows(rows, l, a.labels, lse.view().data(), up, l, o, stream);
    if (a.grad_bias && v > 0) {
      add_column_sums_kernel<<<ceil_div(v, 256), 256, 0, native(stream)>>>(l, c, v, db);
      check_launch(kOp);
    }
    std::int64_t ldl = v;  // the chunk's logit gradient dl (c, V), in T
    if constexpr (kNarrow) {
      if (v > 0) {
        narrow_rows_kernel<cuda_t<T>>
            <<<static_cast<unsigned>(std::min<std::int64_t>(c, 65535)), 1024, 0, native(stream)>>>(
                l, c, v);
        check_launch(kOp);
      }
      ldl = 2 * v;
    }
    if (a.grad_x)  // grad_x (c, H) = dl (c, V) @ weight (V, H)
      matmul(dt, dt, c, h, v, row_major(l, ldl), row_major(w, h),
             row_major(static_cast<T*>(a.grad_x) + r0 * h, h), false, nullptr, stream);
    if (a.grad_weight)  // grad_weight (V, H) (+)= dl^T (V, c) @ xc (c, H), in its own dtype
      matmul(dt, a.grad_weight_dtype, v, h, c, transposed(l, ldl), row_major(xc, h),
             row_major(a.grad_weight, h), r0 > 0, nullptr, stream);
  }

  if (db) copy(db64, TensorView(a.grad_bias, a.grad_bias_dtype, {v}, stream.device), stream);
  store_loss(ce, row_loss.defined() ? row_loss.data_ptr<double>() : nullptr, verdict, o.reduction,
             a.loss, stream);
}

}  // namespace

void fused_linear_cross_entropy(const FusedLinearCrossEntropyShape& s, DType label_dtype,
                                const FusedLinearCrossEntropyArgs& args,
                                const CrossEntropyOptions& options, const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, kOp,
                 [&](auto tag) { run<decltype(tag)>(s, label_dtype, args, options, stream); });
}

}  // namespace meshfuse::detail::cuda
