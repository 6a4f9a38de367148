// CPU fused linear cross-entropy: chunks of rows; per chunk the logits in the compute type A
// (fp32, f64 for f64) from the cpu GEMM, the cross-entropy row kernels (the gradient written over
// the logits), then the chunk's share of the three gradients. 16-bit operands are widened to fp32
// (x per chunk, the weight per block of rows) so that every GEMM is the library's fp32 one, which
// yields fp32 logits and takes the logits' fp32 gradient (a 16-bit GEMM would need it rounded to
// the dtype).
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/fused_linear_cross_entropy/fused_linear_cross_entropy_kernels.h"
#include "ops/gemm/gemm_kernels.h"
#include "ops/softmax/softmax_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

// n elements, not initialised (each is written before it is read); null for n = 0.
template <typename U>
std::unique_ptr<U[]> scratch(std::int64_t n) {
  return n > 0 ? std::make_unique_for_overwrite<U[]>(static_cast<std::size_t>(n)) : nullptr;
}

// out[i] = in[i] as U for i < n: widening to fp32, or rounding back once.
template <typename U, typename T>
void convert(const T* in, std::int64_t n, U* out) {
  parallel_if(n >= kParallelMin, [&] {
#pragma omp for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) out[i] = store_as<U>(to_float(in[i]));
  });
}

// out[i] = round(out[i] + p[i]) with the sum in A, or round(p[i]) when !accumulate, for i < n: a
// chunk's product added to a 16-bit running sum, one rounding per chunk.
template <typename T, typename A>
void add_rounded(const A* p, std::int64_t n, T* out, bool accumulate) {
  if (!accumulate) return convert(p, n, out);
  parallel_if(n >= kParallelMin, [&] {
#pragma omp for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) out[i] = store_as<T>(to_float(out[i]) + p[i]);
  });
}

// n elements of src as A: src itself when T is A, else converted into buf.
template <typename A, typename T>
const A* as_acc(const T* src, std::int64_t n, A* buf) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    convert(src, n, buf);
    return buf;
  }
}

// A row-major matrix with leading dim ld, and one stored as its transpose.
GemmMatrix row_major(const void* data, std::int64_t ld) {
  return {const_cast<void*>(data), std::max<std::int64_t>(ld, 1), 0, false};
}
GemmMatrix transposed(const void* data, std::int64_t ld) {
  return {const_cast<void*>(data), std::max<std::int64_t>(ld, 1), 0, true};
}

// d (m, n) = a (m, k) @ b (k, n) [+ d when accumulate] [+ the row `row` broadcast].
template <typename A>
void matmul(std::int64_t m, std::int64_t n, std::int64_t k, GemmMatrix a, GemmMatrix b,
            GemmMatrix d, bool accumulate, const A* row = nullptr) {
  const GemmMatrix c = accumulate ? d
                       : row      ? GemmMatrix{const_cast<A*>(row), 0, 0, false}
                                  : GemmMatrix{};
  gemm_fixed_layout({dtype_of<A>(), 1, m, n, k, 1.0, c.data ? 1.0 : 0.0}, a, b, c, d, Stream{});
}

// acc[j] += sum over the rows of d (rows, cols), each column in row order, in double (exact far
// below the output's rounding): the same sums whatever the chunking and thread count.
template <typename A>
void add_column_sums(const A* d, std::int64_t rows, std::int64_t cols, double* acc) {
  constexpr std::int64_t kCols = 256;  // columns per task, summed as a vector
  parallel_if(rows * cols >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kCols) {
      const std::int64_t w = std::min(kCols, cols - c0);
      for (std::int64_t i = 0; i < rows; ++i) {
        const A* row = d + row_offset(i, cols) + c0;
#pragma omp simd
        for (std::int64_t j = 0; j < w; ++j) acc[c0 + j] += double(row[j]);
      }
    }
  });
}

template <typename T>
void run(std::int64_t block_floats, const FusedLinearCrossEntropyShape& s, DType label_dtype,
         const FusedLinearCrossEntropyArgs& a, const CrossEntropyOptions& o) {
  using A = acc_t<T>;
  constexpr bool kWiden = !std::is_same_v<T, A>;
  const std::int64_t n = s.rows, h = s.hidden, v = s.vocab;
  const CrossEntropyShape ce{s.dtype, a.loss_dtype, label_dtype, n, v};
  const std::int64_t count = check_labels(kFusedLinearCrossEntropy, ce, a.labels, o);
  const FusedLinearCrossEntropyPlan p = plan(s, block_floats);
  const bool grads = a.grad_x || a.grad_weight || a.grad_bias;
  // grad_weight in A (f32 / f64, or f32 for 16-bit weights): the GEMMs accumulate in it.
  A* const dw_acc = a.grad_weight_dtype == dtype_of<A>() ? static_cast<A*>(a.grad_weight) : nullptr;

  const auto logits = scratch<A>(p.logits);
  const auto lse = scratch<lse_t<A>>(p.lse);
  const auto x32 = scratch<A>(p.x_chunk), dx32 = scratch<A>(p.grad_x_chunk),
             w32 = scratch<A>(p.weight_block), b32 = scratch<A>(p.bias);
  std::vector<double> row_loss(static_cast<std::size_t>(p.row_loss)), row_grad;
  std::vector<double> dbias(static_cast<std::size_t>(p.grad_bias), 0.0);
  const CrossEntropyUpstream up = grads
                                      ? read_upstream(ce, a.grad_loss, count, o.reduction, row_grad)
                                      : CrossEntropyUpstream{0.0, nullptr};

  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  const A* bias = a.bias ? as_acc(static_cast<const T*>(a.bias), v, b32.get()) : nullptr;
  const std::int64_t bv = p.weight_block_rows;
  const std::int64_t blocks = std::max<std::int64_t>(1, (v + bv - 1) / bv);
  const auto block_rows = [&](std::int64_t b) { return std::min(bv, v - b * bv); };

  for (std::int64_t r0 = 0; r0 < n; r0 += p.chunk_rows) {
    const std::int64_t c = std::min(p.chunk_rows, n - r0);
    const A* xc = as_acc(x + row_offset(r0, h), c * h, x32.get());
    // logits (c, V) = xc @ weight^T + bias, a block of weight rows (logit columns) at a time.
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t v0 = b * bv, vb = block_rows(b);
      const A* wb = as_acc(w + row_offset(v0, h), vb * h, w32.get());
      matmul<A>(c, vb, h, row_major(xc, h), transposed(wb, h), row_major(logits.get() + v0, v),
                false, bias ? bias + v0 : nullptr);
    }
    const CrossEntropyRows rows{dtype_of<A>(), label_dtype, r0, c, v};
    cross_entropy_forward_rows(rows, logits.get(), a.labels, lse.get(), row_loss.data(), o);
    if (!grads) continue;
    cross_entropy_backward_rows(rows, logits.get(), a.labels, lse.get(), up, logits.get(), o);
    const A* dl = logits.get();  // (c, V): the gradient of the chunk's logits
    if (a.grad_bias) add_column_sums(dl, c, v, dbias.data());
    A* dx = dx32.get();
    if constexpr (!kWiden)
      if (a.grad_x) dx = static_cast<A*>(a.grad_x) + row_offset(r0, h);
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t v0 = b * bv, vb = block_rows(b);
      if (a.grad_x) {  // dx (c, H) += dl[:, block] (c, vb) @ weight[block] (vb, H)
        const A* wb = as_acc(w + row_offset(v0, h), vb * h, w32.get());
        matmul<A>(c, h, vb, row_major(dl + v0, v), row_major(wb, h), row_major(dx, h), b > 0);
      }
      if (!a.grad_weight) continue;
      // grad_weight[block] (vb, H) (+)= dl[:, block]^T (vb, c) @ xc (c, H): accumulated by the
      // GEMM in an A grad_weight; for a 16-bit one the product goes to the weight block's buffer
      // (free again) and is added to the output in fp32, rounded once per chunk.
      const GemmMatrix dlt = transposed(dl + v0, v);
      if (dw_acc) {
        matmul<A>(vb, h, c, dlt, row_major(xc, h), row_major(dw_acc + row_offset(v0, h), h),
                  r0 > 0);
      } else {
        matmul<A>(vb, h, c, dlt, row_major(xc, h), row_major(w32.get(), h), false);
        add_rounded(w32.get(), vb * h, static_cast<T*>(a.grad_weight) + row_offset(v0, h), r0 > 0);
      }
    }
    if constexpr (kWiden)
      if (a.grad_x) convert(dx32.get(), c * h, static_cast<T*>(a.grad_x) + row_offset(r0, h));
  }

  if (a.grad_weight && n == 0)  // all-zero bits are +0 in every float dtype
    std::memset(a.grad_weight, 0,
                static_cast<std::size_t>(v * h) * element_size(a.grad_weight_dtype));
  if (a.grad_bias)
    dispatch_float(a.grad_bias_dtype, kFusedLinearCrossEntropy, [&](auto tag) {
      using B = decltype(tag);
      for (std::int64_t j = 0; j < v; ++j) static_cast<B*>(a.grad_bias)[j] = from_double<B>(dbias[j]);
    });
  store_loss(ce, row_loss, count, o.reduction, a.loss);
}

}  // namespace

FusedLinearCrossEntropyPlan plan(const FusedLinearCrossEntropyShape& s,
                                 std::int64_t weight_block_floats) {
  const bool widen = is_sixteen_bit(s.dtype);
  const bool grads = s.grad_x || s.grad_weight || s.grad_bias;
  const std::int64_t n = s.rows, h = s.hidden, v = s.vocab;
  const std::int64_t chunk = std::min(s.chunk_rows, n);
  const std::int64_t v1 = std::max<std::int64_t>(v, 1);
  FusedLinearCrossEntropyPlan p{};
  p.chunk_rows = chunk;
  p.weight_block_rows =
      widen ? std::clamp<std::int64_t>(weight_block_floats / std::max<std::int64_t>(h, 1), 1, v1)
            : v1;
  p.logits = chunk * v;
  p.lse = n;
  p.row_loss = n;
  p.row_grad = s.reduction == Reduction::None && grads ? n : 0;
  if (widen) {
    p.x_chunk = chunk * h;
    p.grad_x_chunk = s.grad_x ? chunk * h : 0;
    p.weight_block = std::min(p.weight_block_rows, v) * h;
    p.bias = s.bias ? v : 0;
  }
  p.grad_bias = s.grad_bias ? v : 0;
  return p;
}

void fused_linear_cross_entropy_blocked(std::int64_t weight_block_floats,
                                        const FusedLinearCrossEntropyShape& s, DType label_dtype,
                                        const FusedLinearCrossEntropyArgs& args,
                                        const CrossEntropyOptions& options) {
  dispatch_float(s.dtype, kFusedLinearCrossEntropy, [&](auto tag) {
    run<decltype(tag)>(weight_block_floats, s, label_dtype, args, options);
  });
}

void fused_linear_cross_entropy(const FusedLinearCrossEntropyShape& s, DType label_dtype,
                                const FusedLinearCrossEntropyArgs& args,
                                const CrossEntropyOptions& options, const Stream&) {
  fused_linear_cross_entropy_blocked(kWeightBlockFloats, s, label_dtype, args, options);
}

}  // namespace meshfuse::detail::cpu
