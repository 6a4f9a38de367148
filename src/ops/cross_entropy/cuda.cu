// CUDA cross-entropy: one block per row. The forward streams a row's logits once (online
// log-sum-exp in fp32, the sum of the logits for label smoothing, the label's logit loaded at the
// start), writes lse and the row's loss in double to a scratch buffer, and a single block sums
// those in a fixed order for mean and sum. The backward reads a row once and writes its gradient.
// Labels are checked on the device first; the op waits for that check alone.
#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/softmax/cuda_logsumexp.cuh"

namespace meshfuse::detail::cuda {
namespace {

// Labels of either index dtype.
struct Labels {
  const void* data;
  bool is64;

  __device__ std::int64_t operator[](std::int64_t i) const {
    return is64 ? static_cast<const std::int64_t*>(data)[i]
                : static_cast<const std::int32_t*>(data)[i];
  }
};

// The options in the kernels' types; ml = m * log2(e) takes a logit into base 2.
template <typename A>
struct Coefficients {
  A m, ml;
  double eps, z;
  std::int64_t ignore_index;
};

template <typename A>
Coefficients<A> coefficients(const CrossEntropyOptions& o) {
  return {static_cast<A>(o.logits_multiplier), static_cast<A>(o.logits_multiplier * kLog2e),
          o.label_smoothing, o.z_loss_scale, o.ignore_index};
}

// status[0] = rows - (first bad row), 0 when none; status[1] = rows not ignored. Integer atomics
// (one per warp): the result does not depend on their order.
__global__ void check_labels_kernel(Labels labels, std::int64_t rows, std::int64_t vocab,
                                    std::int64_t ignore_index, unsigned long long* status) {
  std::int64_t bad = rows;
  unsigned long long count = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t y = labels[i];
    if (y == ignore_index) continue;
    if (y < 0 || y >= vocab) {
      bad = bad < i ? bad : i;
    } else {
      ++count;
    }
  }
  bad = warp_allreduce(bad, [](std::int64_t a, std::int64_t b) { return a < b ? a : b; });
  count = warp_allreduce(count, [](unsigned long long a, unsigned long long b) { return a + b; });
  if (threadIdx.x % 32 == 0) {
    if (bad < rows) atomicMax(&status[0], static_cast<unsigned long long>(rows - bad));
    if (count > 0) atomicAdd(&status[1], count);
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    forward_rows_kernel(const T* logits, Labels labels, std::int64_t row_begin, std::int64_t rows,
                        std::int64_t vocab, acc_t<T>* lse, double* row_loss,
                        Coefficients<acc_t<T>> c) {
  using A = acc_t<T>;
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const std::int64_t g = row_begin + i, y = labels[g];
    if (y == c.ignore_index) {
      if (threadIdx.x == 0) {
        lse[g] = 0;
        row_loss[g] = 0;
      }
      continue;
    }
    const T* x = logits + i * vocab;
    // Loaded first, so that its latency hides behind the row's. Labels were checked; a bad one
    // still reads nothing out of the row.
    A label_logit = 0;
    if (threadIdx.x == 0)
      label_logit = y >= 0 && y < vocab ? load(x[y]) : std::numeric_limits<A>::quiet_NaN();
    const RowStats<A> st = block_stats(thread_row_stats<T, W, true>(x, vocab / W, c.ml));
    if (threadIdx.x == 0) {
      const A l = natural_lse(st);
      const double nll = double(l) - double(label_logit * c.m);
      double loss = (1 - c.eps) * nll;
      if (c.eps != 0) loss += c.eps * (double(l) - double(st.sum_x * c.m) / double(vocab));
      if (c.z != 0) loss += c.z * double(l) * double(l);
      lse[g] = l;
      row_loss[g] = loss;
    }
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    backward_rows_kernel(const T* logits, Labels labels, std::int64_t row_begin, std::int64_t rows,
                         std::int64_t vocab, const acc_t<T>* lse, double scale,
                         const double* row_grad, T* grad_logits, Coefficients<acc_t<T>> c) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  const std::int64_t nv = vocab / W, stride = blockDim.x;
  const A eps = static_cast<A>(c.eps), smooth = eps / static_cast<A>(vocab), hit = A(1) - eps;
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const std::int64_t g = row_begin + i, y = labels[g];
    // grad_logits may be logits itself (stream_row: a thread writes only vectors it has read).
    const V* x = reinterpret_cast<const V*>(logits + i * vocab);
    V* dx = reinterpret_cast<V*>(grad_logits + i * vocab);
    if (y == c.ignore_index) {
      const A zeros[W] = {};
      const V zero = V::from(zeros);
      for (std::int64_t j = threadIdx.x; j < nv; j += stride) dx[j] = zero;
      continue;
    }
    // dx_j = cg * (p_j * p_scale - eps / V - [j == y] (1 - eps)), with the factors folded.
    const A l = lse[g];
    const A cg = static_cast<A>(scale * (row_grad ? row_grad[g] : 1.0)) * c.m;
    const A p_factor = cg * (c.z != 0 ? A(1) + 2 * static_cast<A>(c.z) * l : A(1));
    const A offset = cg * smooth, label_offset = cg * (smooth + hit);
    const A shift2 = l * A(kLog2e);
    stream_row(x, nv, [&](const V(&v)[kU], std::int64_t base) {
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        const std::int64_t j = base + k * stride;
        if (j < nv) {
          // The label's place in this vector, if any.
          const std::int64_t d = y - j * W;
          const int label_at = d >= 0 && d < W ? static_cast<int>(d) : -1;
          A out[W];
#pragma unroll
          for (int e = 0; e < W; ++e)
            out[e] =
                exp2a(v[k][e] * c.ml - shift2) * p_factor - (e == label_at ? label_offset : offset);
          dx[j] = V::from(out);
        }
      }
    });
  }
}

template <typename T>
__global__ void store_rows_kernel(const double* row_loss, std::int64_t rows, T* loss) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    loss[i] = store<T>(row_loss[i]);
}

// One block: each thread sums a fixed stride of rows, then a fixed tree; 0 / 0 = NaN for a mean
// over no rows, as PyTorch.
template <typename T>
__global__ void __launch_bounds__(1024)
    reduce_rows_kernel(const double* row_loss, std::int64_t rows, double divisor, T* loss) {
  double sum = 0;
  for (std::int64_t i = threadIdx.x; i < rows; i += blockDim.x) sum += row_loss[i];
  sum = block_allreduce(sum, 0.0, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) loss[0] = store<T>(sum / divisor);
}

// Calls f(T{}, W) with the logits' CUDA type and its vector width (or 1).
template <typename F>
void dispatch_rows(const CrossEntropyRows& b, std::string_view op,
                   std::initializer_list<const void*> pointers, F&& f) {
  dispatch_float(b.dtype, op, [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    if (vector_width<T>(b.vocab, pointers) > 1)
      f(T{}, std::integral_constant<int, kVec16<T>>{});
    else
      f(T{}, std::integral_constant<int, 1>{});
  });
}

}  // namespace

std::int64_t check_labels(std::string_view op, const CrossEntropyShape& s, const void* labels,
                          std::int64_t ignore_index, const Stream& stream) {
  if (s.rows == 0) return 0;
  DeviceGuard guard(stream.device.index);
  const Tensor status({2}, DType::I64, stream.device, stream);
  auto* st = status.data_ptr<unsigned long long>();
  check(cudaMemsetAsync(st, 0, 2 * sizeof(unsigned long long), native(stream)), op);
  const Labels l{labels, s.label_dtype == DType::I64};
  check_labels_kernel<<<grid_size(s.rows, 256), 256, 0, native(stream)>>>(l, s.rows, s.vocab,
                                                                          ignore_index, st);
  check_launch(op);
  unsigned long long host[2] = {0, 0};
  check(cudaMemcpyAsync(host, st, sizeof(host), cudaMemcpyDeviceToHost, native(stream)), op);
  check(cudaStreamSynchronize(native(stream)), op);
  if (host[0] != 0) {
    const std::int64_t row = s.rows - static_cast<std::int64_t>(host[0]);
    const bool is64 = s.label_dtype == DType::I64;
    std::int64_t label = 0;
    std::int32_t label32 = 0;
    const char* at = static_cast<const char*>(labels) + row * (is64 ? 8 : 4);
    check(cudaMemcpyAsync(is64 ? static_cast<void*>(&label) : &label32, at, is64 ? 8 : 4,
                          cudaMemcpyDeviceToHost, native(stream)),
          op);
    check(cudaStreamSynchronize(native(stream)), op);
    fail_label(op, s, row, is64 ? label : label32, ignore_index);
  }
  return static_cast<std::int64_t>(host[1]);
}

void store_loss(const CrossEntropyShape& s, const double* row_loss, std::int64_t count,
                Reduction reduction, void* loss, const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "cross_entropy", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    T* out = static_cast<T*>(loss);
    if (reduction == Reduction::None) {
      if (s.rows > 0)
        store_rows_kernel<<<grid_size(s.rows, 256), 256, 0, native(stream)>>>(row_loss, s.rows,
                                                                              out);
    } else {
      const double divisor = reduction == Reduction::Sum ? 1.0 : static_cast<double>(count);
      reduce_rows_kernel<<<1, 1024, 0, native(stream)>>>(row_loss, s.rows, divisor, out);
    }
  });
  check_launch("cross_entropy");
}

CrossEntropyUpstream read_upstream(const CrossEntropyShape& s, const void* grad_loss,
                                   std::int64_t count, Reduction reduction,
                                   Tensor& row_grad_storage, const Stream& stream) {
  row_grad_storage = Tensor({s.rows}, DType::F64, stream.device, stream);
  // Stride 0 broadcasts the scalar of mean and sum to every row.
  const TensorView grad(const_cast<void*>(grad_loss), s.dtype, {s.rows},
                        {reduction == Reduction::None ? 1 : 0}, stream.device);
  meshfuse::copy(grad, row_grad_storage, stream);
  const double scale = reduction != Reduction::Mean ? 1.0
                       : count == 0                 ? 0.0
                                                    : 1.0 / static_cast<double>(count);
  return {scale, row_grad_storage.data_ptr<double>()};
}

void cross_entropy_forward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                void* lse, double* row_loss, const CrossEntropyOptions& o,
                                const Stream& stream) {
  if (b.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_rows(b, "cross_entropy", {logits}, [&](auto tag, auto width) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int W = decltype(width)::value;
    forward_rows_kernel<T, W>
        <<<row_blocks(b.rows), row_threads(b.vocab / W, kU), 0, native(stream)>>>(
            static_cast<const T*>(logits), Labels{labels, b.label_dtype == DType::I64}, b.row_begin,
            b.rows, b.vocab, static_cast<A*>(lse), row_loss, coefficients<A>(o));
  });
  check_launch("cross_entropy");
}

void cross_entropy_backward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                 const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                                 const CrossEntropyOptions& o, const Stream& stream) {
  if (b.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_rows(b, "cross_entropy_backward", {logits, grad_logits}, [&](auto tag, auto width) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int W = decltype(width)::value;
    backward_rows_kernel<T, W>
        <<<row_blocks(b.rows), row_threads(b.vocab / W, kU), 0, native(stream)>>>(
            static_cast<const T*>(logits), Labels{labels, b.label_dtype == DType::I64}, b.row_begin,
            b.rows, b.vocab, static_cast<const A*>(lse), upstream.scale, upstream.row_grad,
            static_cast<T*>(grad_logits), coefficients<A>(o));
  });
  check_launch("cross_entropy_backward");
}

void cross_entropy_forward(const CrossEntropyShape& s, const void* logits, const void* labels,
                           void* loss, void* lse, const CrossEntropyOptions& o,
                           const Stream& stream) {
  const std::int64_t count = check_labels("cross_entropy", s, labels, o.ignore_index, stream);
  const Tensor row_loss({s.rows}, DType::F64, stream.device, stream);
  cross_entropy_forward_rows({s.dtype, s.label_dtype, 0, s.rows, s.vocab}, logits, labels, lse,
                             row_loss.data_ptr<double>(), o, stream);
  store_loss(s, row_loss.data_ptr<double>(), count, o.reduction, loss, stream);
}

void cross_entropy_backward(const CrossEntropyShape& s, const void* grad_loss, const void* logits,
                            const void* labels, const void* lse, void* grad_logits,
                            const CrossEntropyOptions& o, const Stream& stream) {
  const std::int64_t count =
      check_labels("cross_entropy_backward", s, labels, o.ignore_index, stream);
  Tensor row_grad;
  const CrossEntropyUpstream up = read_upstream(s, grad_loss, count, o.reduction, row_grad, stream);
  cross_entropy_backward_rows({s.dtype, s.label_dtype, 0, s.rows, s.vocab}, logits, labels, lse, up,
                              grad_logits, o, stream);
}

}  // namespace meshfuse::detail::cuda
