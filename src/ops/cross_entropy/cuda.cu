// CUDA cross-entropy. The forward streams a row's logits once with one block per row (online
// log-sum-exp in fp32; the sum of the logits only with label smoothing, as its add per logit costs
// memory rate; the label's logit loaded at the start), writes lse (lse_t: in double for f32 and
// f64 logits) and the row's loss in double to a scratch buffer, and a single block sums those in
// a fixed order for mean and sum. The exps' units (base 2 or natural) follow the logits' dtype:
// cuda_logsumexp.cuh. The backward reads a row once and writes its gradient, each row split over
// two independent blocks (kBackwardSplit). Both splits were the fastest measured
// (docs/kernels/cross_entropy.md).
//
// Labels: a bad label must raise the op's error (naming the row and the value) with nothing
// written. A one-block check kernel runs first; it writes its verdict (bad row and value, rows not
// ignored) to device memory, where the row kernels read it and write nothing after a bad label,
// the loss reduction reads the count for mean, and to pinned host memory. The row kernels are
// queued behind it at once, and only then does the host wait, for the check's event alone: the
// GPU never idles between the kernels, and the call returns (or throws) while the row kernels run.
// The cost is one small kernel per call and a host wait on the work queued before the op (any op
// that reports a device-side error from the call itself needs that wait). The backward's check
// kernel also writes the upstream gradient per row (scaled by 1 / count for mean), so nothing
// needs the count on the host. Waiting for the check before queuing the row kernels measured
// clearly slower. With LabelCheck::DeviceAssert, and under CUDA graph capture (where nothing may
// wait), the host never reads a verdict: a bad label prints the op's error and traps (PyTorch's
// device-side assert). The forward then has no check kernel: each row block asserts its own
// label (the message names a bad row, not necessarily the first) and the loss reduction counts
// the rows not ignored, two launches as PyTorch's.
#include <vector>

#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cuda_logsumexp.cuh"

namespace meshfuse::detail::cuda {
namespace {

// Blocks per row in the backward (see the file comment).
constexpr int kBackwardSplit = 2;

// Labels of either index dtype.
struct Labels {
  const void* data;
  bool is64;

  __device__ std::int64_t operator[](std::int64_t i) const {
    return is64 ? static_cast<const std::int64_t*>(data)[i]
                : static_cast<const std::int32_t*>(data)[i];
  }
};

// The options in the kernels' types; scale = m in the units of the logits' exps (units_scale). A
// label y is at column y - vocab_start of the logits (outside [0, vocab): in another shard);
// classes is vocab_classes, label smoothing's divisor.
template <typename A>
struct Coefficients {
  A m, scale;
  double eps, z;
  std::int64_t ignore_index, vocab_start, classes;
};

template <typename T>
Coefficients<acc_t<T>> coefficients(const CrossEntropyOptions& o, std::int64_t vocab) {
  using A = acc_t<T>;
  return {static_cast<A>(o.logits_multiplier),
          static_cast<A>(units_scale<T>(o.logits_multiplier)),
          o.label_smoothing,
          o.z_loss_scale,
          o.ignore_index,
          o.vocab_start,
          vocab_classes(o, vocab)};
}

// The verdict of check_kernel: bad != 0 when some label is neither in [0, classes) nor
// ignore_index; then row is the first such row and label its value. count: rows not ignored.
struct LabelStatus {
  long long bad, row, label, count;
};

// The op's name where a kernel can print it (check_kernel's trap).
struct OpName {
  char text[32] = {};
  explicit OpName(std::string_view op) { op.copy(text, sizeof(text) - 1); }
};

// Prints the op's error for labels[row] = label (fail_label's message) and traps: the context is
// then lost, as after PyTorch's device-side assert. Not inlined: the printf's argument buffer
// would take registers from the row loop (spills in the vectorised kernels).
__device__ __noinline__ void assert_label(const char* op, std::int64_t row, std::int64_t label,
                                          std::int64_t classes, std::int64_t ignore_index) {
  printf("%s: labels[%lld] = %lld is outside [0, %lld) and is not ignore_index (%lld)\n", op,
         static_cast<long long>(row), static_cast<long long>(label),
         static_cast<long long>(classes), static_cast<long long>(ignore_index));
  __trap();
}

// The upstream gradient's factor: 1 / count for mean (0 when count is 0, so that every gradient
// is zero rather than NaN), else 1.
__device__ double upstream_scale(bool mean, long long count) {
  return !mean ? 1.0 : count == 0 ? 0.0 : 1.0 / static_cast<double>(count);
}

// One block scans the labels (first bad row, rows not ignored: integer results, order free),
// writes the verdict to `device` and, unless null, `host`, and, when row_grad is given, the
// upstream gradient per row: grad_loss[i] (none) or grad_loss[0] (sum), times upstream_scale, in
// double as the row kernels take it. With `trap` a bad label is a device-side assert
// (assert_label): where the host does not wait for the verdict.
template <typename T>
__global__ void __launch_bounds__(1024)
    check_kernel(Labels labels, std::int64_t rows, std::int64_t classes, std::int64_t ignore_index,
                 LabelStatus* device, LabelStatus* host, bool trap, OpName op, const T* grad_loss,
                 bool per_row, bool mean, double* row_grad) {
  __shared__ long long bad_of[32], count_of[32];
  __shared__ double scale_shared;
  std::int64_t bad = rows;
  long long count = 0;
#pragma unroll 4
  for (std::int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    const std::int64_t y = labels[i];
    if (y == ignore_index) continue;
    if (y < 0 || y >= classes)
      bad = bad < i ? bad : i;
    else
      ++count;
  }
  bad = warp_allreduce(bad, [](std::int64_t a, std::int64_t b) { return a < b ? a : b; });
  count = warp_allreduce(count, [](long long a, long long b) { return a + b; });
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    bad_of[warp] = bad;
    count_of[warp] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) {
      bad = bad < bad_of[w] ? bad : bad_of[w];
      count += count_of[w];
    }
    const LabelStatus st{bad < rows, bad < rows ? bad : 0, bad < rows ? labels[bad] : 0, count};
    *device = st;
    if (host) {
      *host = st;
      __threadfence_system();
    }
    if (trap && st.bad) assert_label(op.text, st.row, st.label, classes, ignore_index);
    scale_shared = upstream_scale(mean, count);
  }
  if (!row_grad) return;
  __syncthreads();
  const double scale = scale_shared;
  for (std::int64_t i = threadIdx.x; i < rows; i += blockDim.x)
    row_grad[i] = scale * static_cast<double>(load(grad_loss[per_row ? i : 0]));
}

// One block per row. Writes nothing when status reports a bad label; with kTrap (no status) a
// bad label is cross_entropy's device-side assert (a template argument: the printf's registers
// and stack frame stay out of the other kernels). kSumX: label smoothing's sum of the logits (an
// add per logit, skipped without smoothing).
template <typename T, int W, bool kSumX, bool kTrap>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    forward_rows_kernel(const T* logits, Labels labels, std::int64_t row_begin, std::int64_t rows,
                        std::int64_t vocab, lse_t<T>* lse, double* row_loss,
                        Coefficients<acc_t<T>> c, const LabelStatus* status) {
  using A = acc_t<T>;
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const std::int64_t g = row_begin + i, y = labels[g];
    if (kTrap && threadIdx.x == 0 && y != c.ignore_index && (y < 0 || y >= c.classes))
      assert_label("cross_entropy", g, y, c.classes, c.ignore_index);
    if (y == c.ignore_index) {
      if (threadIdx.x == 0 && !(status && status->bad)) {
        if (lse) lse[g] = 0;
        row_loss[g] = 0;
      }
      continue;
    }
    const T* x = logits + i * vocab;
    // Loaded first, so that its latency hides behind the row's. A label in another shard counts
    // as 0; a bad label reads nothing out of the row.
    A label_logit = 0;
    if (threadIdx.x == 0) {
      const std::int64_t col = y - c.vocab_start;
      label_logit = col >= 0 && col < vocab   ? load(x[col])
                    : y >= 0 && y < c.classes ? A(0)
                                              : std::numeric_limits<A>::quiet_NaN();
    }
    const RowStats<A> st = block_stats<T>(thread_row_stats<T, W, kSumX>(x, vocab / W, c.scale));
    if (threadIdx.x == 0 && !(status && status->bad)) {
      const lse_t<T> l = natural_lse<T>(st);
      const double nll = double(l) - double(label_logit * c.m);
      double loss = (1 - c.eps) * nll;
      if (c.eps != 0) loss += c.eps * (double(l) - double(st.sum_x * c.m) / double(c.classes));
      if (c.z != 0) loss += c.z * double(l) * double(l);
      if (lse) lse[g] = l;
      row_loss[g] = loss;
    }
  }
}

// A row over `split` consecutive blocks (independent: no statistics to combine), each writing its
// part. Writes nothing when status reports a bad label.
template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<T, 2>)
    backward_rows_kernel(const T* logits, Labels labels, std::int64_t row_begin, std::int64_t rows,
                         std::int64_t vocab, const lse_t<T>* lse, double scale,
                         const double* row_grad, T* grad_logits, Coefficients<acc_t<T>> c,
                         const LabelStatus* status, int split) {
  using A = acc_t<T>;
  using V = Chunk<T, W>;
  const Part part(vocab / W, split);
  const std::int64_t nv = part.count, stride = blockDim.x;
  const A eps = static_cast<A>(c.eps), smooth = eps / static_cast<A>(c.classes), hit = A(1) - eps;
  // Read with the first row's loads, tested only before a store.
  const bool skip = status && status->bad;
  for (std::int64_t i = blockIdx.x / split; i < rows; i += gridDim.x / split) {
    const std::int64_t g = row_begin + i, y = labels[g];
    // grad_logits may be logits itself (stream_row: a thread writes only vectors it has read).
    const V* x = reinterpret_cast<const V*>(logits + i * vocab) + part.begin;
    V* dx = reinterpret_cast<V*>(grad_logits + i * vocab) + part.begin;
    if (y == c.ignore_index) {
      const A zeros[W] = {};
      const V zero = V::from(zeros);
      if (!skip)
        for (std::int64_t j = threadIdx.x; j < nv; j += stride) dx[j] = zero;
      continue;
    }
    // dx_j = cg * (p_j * p_scale - eps / V - [j == y] (1 - eps)), with the factors folded.
    const lse_t<T> l = lse[g];
    const A l_acc = static_cast<A>(l);
    const A cg = static_cast<A>(scale * (row_grad ? row_grad[g] : 1.0)) * c.m;
    // The upstream folds into the factors (times 1 after, exact) unless it is infinite or NaN:
    // then it multiplies after, as folded it would turn the signed difference of two terms into
    // inf - inf.
    const bool folded = isfinite(cg);
    const A c_after = folded ? A(1) : cg, cf = folded ? cg : A(1);
    A p_factor = cf * (c.z != 0 ? A(1) + 2 * static_cast<A>(c.z) * l_acc : A(1));
    // f32 rows shift the exponents by the double lse rounded to f32 and fold e^(l_acc - l), the
    // rounding's factor, into p_factor: p_j carries no rounding of the lse (equal values, the
    // infinities among them, need none).
    if constexpr (!kBase2<T>)
      if (l_acc != l) p_factor = static_cast<A>(p_factor * exp(static_cast<double>(l_acc) - l));
    const A offset = cf * smooth, label_offset = cf * (smooth + hit);
    const A shift_units = kBase2<T> ? l_acc * A(kLog2e) : l_acc;
    // The label's place in the part's vectors (never matched when it is in another shard).
    const std::int64_t y_part = y - c.vocab_start - part.begin * W;
    stream_row(x, nv, [&](const V(&v)[kU], std::int64_t base) {
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        const std::int64_t j = base + k * stride;
        if (j < nv && !skip) {
          // The label's place in this vector, if any.
          const std::int64_t d = y_part - j * W;
          const int label_at = d >= 0 && d < W ? static_cast<int>(d) : -1;
          A out[W];
#pragma unroll
          for (int e = 0; e < W; ++e)
            out[e] = c_after * (exp_units<T>(v[k][e] * c.scale - shift_units) * p_factor -
                                (e == label_at ? label_offset : offset));
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

// One block: each thread sums a fixed stride of rows, then a fixed tree; divided by the count of
// rows not ignored for mean (0 / 0 = NaN for a mean over no rows, as PyTorch): the verdict's, or
// without one counted here from the labels.
template <typename T>
__global__ void __launch_bounds__(1024)
    reduce_rows_kernel(const double* row_loss, std::int64_t rows, bool mean,
                       const LabelStatus* status, Labels labels, std::int64_t ignore_index,
                       T* loss) {
  double sum = 0;
  long long count = 0;
  for (std::int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    sum += row_loss[i];
    if (mean && !status) count += labels[i] != ignore_index;
  }
  const auto add = [](auto a, auto b) { return a + b; };
  sum = block_allreduce(sum, 0.0, add);
  if (mean && !status) count = block_allreduce(count, 0LL, add);
  if (threadIdx.x == 0) {
    if (status) count = status->count;
    loss[0] = store<T>(mean ? sum / static_cast<double>(count) : sum);
  }
}

// read_upstream's row_grad: grad_loss[i] (none) or grad_loss[0] (mean, sum) times upstream_scale.
template <typename T>
__global__ void row_grad_kernel(const T* grad_loss, std::int64_t rows, bool per_row, bool mean,
                                const LabelStatus* status, double* row_grad) {
  const double scale = upstream_scale(mean, status->count);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    row_grad[i] = scale * static_cast<double>(load(grad_loss[per_row ? i : 0]));
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

// Pinned, mapped host memory for this thread's label verdicts, and an event per device; reused
// call after call (each call waits for its check before it returns).
struct HostSide {
  LabelStatus* status = nullptr;
  std::vector<cudaEvent_t> events;
  HostSide() = default;
  HostSide(const HostSide&) = delete;
  HostSide& operator=(const HostSide&) = delete;
  ~HostSide() {  // errors ignored: the runtime may be unloading at thread exit
    if (status) cudaFreeHost(status);
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
  }
};

HostSide& host_side() {
  thread_local HostSide h;
  return h;
}

// Whether the host waits for the device's label check (see the file comment).
bool host_waits(const CrossEntropyOptions& o, const Stream& stream) {
  return o.label_check == LabelCheck::Raise && !capturing(stream);
}

// A label check queued on the stream (see the file comment); the current device must be the
// stream's. verdict() is the check's LabelStatus on the device. wait() waits for the check alone
// and raises the error of a bad label; without host_waits (and for no rows) the host neither
// waits nor reads the verdict: there the kernel traps on a bad label.
class QueuedLabelCheck {
 public:
  QueuedLabelCheck(std::string_view op, const CrossEntropyShape& s, const void* labels,
                   const CrossEntropyOptions& o, const Stream& stream,
                   const void* grad_loss = nullptr, double* row_grad = nullptr)
      : op_(op), classes_(vocab_classes(o, s.vocab)), ignore_index_(o.ignore_index) {
    const bool host_reads = s.rows > 0 && host_waits(o, stream);
    if (host_reads) {
      HostSide& h = host_side();
      if (!h.status) {
        void* p = nullptr;
        check(cudaHostAlloc(&p, sizeof(LabelStatus), cudaHostAllocMapped | cudaHostAllocPortable),
              op);
        h.status = static_cast<LabelStatus*>(p);
      }
      const auto d = static_cast<std::size_t>(stream.device.index);
      if (h.events.size() <= d) h.events.resize(d + 1, nullptr);
      if (!h.events[d]) check(cudaEventCreateWithFlags(&h.events[d], cudaEventDisableTiming), op);
      host_ = h.status;
      event_ = h.events[d];
    }
    verdict_ = Tensor({4}, DType::I64, stream.device, stream);
    dispatch_float(s.loss_dtype, op, [&](auto tag) {  // the grad_loss read by the check
      using T = cuda_t<decltype(tag)>;
      check_kernel<T><<<1, 1024, 0, native(stream)>>>(
          Labels{labels, s.label_dtype == DType::I64}, s.rows, classes_, ignore_index_, device(),
          host_, !host_reads, OpName(op), static_cast<const T*>(grad_loss),
          o.reduction == Reduction::None, o.reduction == Reduction::Mean, row_grad);
    });
    check_launch(op);
    if (event_) check(cudaEventRecord(event_, native(stream)), op);
  }
  QueuedLabelCheck(const QueuedLabelCheck&) = delete;
  QueuedLabelCheck& operator=(const QueuedLabelCheck&) = delete;
  ~QueuedLabelCheck() {
    if (event_ && !waited_) cudaEventSynchronize(event_);  // the host buffer is free again
  }

  const Tensor& verdict() const { return verdict_; }
  LabelStatus* device() const {
    return reinterpret_cast<LabelStatus*>(verdict_.data_ptr<std::int64_t>());
  }

  void wait() {
    if (!event_) return;
    waited_ = true;
    check(cudaEventSynchronize(event_), op_);
    // Written by the device: read through volatile, after the event.
    const volatile LabelStatus* st = host_;
    if (st->bad) fail_label(op_, classes_, st->row, st->label, ignore_index_);
  }

 private:
  std::string_view op_;
  std::int64_t classes_, ignore_index_;
  LabelStatus* host_ = nullptr;
  cudaEvent_t event_ = nullptr;
  Tensor verdict_;
  bool waited_ = false;
};

void forward_rows(const CrossEntropyRows& b, const void* logits, const void* labels, void* lse,
                  double* row_loss, const CrossEntropyOptions& o, const LabelStatus* status,
                  bool trap, const Stream& stream) {
  if (b.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_rows(b, "cross_entropy", {logits}, [&](auto tag, auto width) {
    using T = decltype(tag);
    constexpr int W = decltype(width)::value;
    const bool smooth = o.label_smoothing != 0;
    const auto kernel = trap ? (smooth ? forward_rows_kernel<T, W, true, true>
                                       : forward_rows_kernel<T, W, false, true>)
                             : (smooth ? forward_rows_kernel<T, W, true, false>
                                       : forward_rows_kernel<T, W, false, false>);
    kernel<<<row_blocks(b.rows), row_threads(b.vocab / W, kU), 0, native(stream)>>>(
        static_cast<const T*>(logits), Labels{labels, b.label_dtype == DType::I64}, b.row_begin,
        b.rows, b.vocab, static_cast<lse_t<T>*>(lse), row_loss, coefficients<T>(o, b.vocab),
        status);
  });
  check_launch("cross_entropy");
}

void backward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                   const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                   const CrossEntropyOptions& o, const LabelStatus* status, const Stream& stream) {
  if (b.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_rows(b, "cross_entropy_backward", {logits, grad_logits}, [&](auto tag, auto width) {
    using T = decltype(tag);
    constexpr int W = decltype(width)::value;
    const std::int64_t nv = b.vocab / W;
    const int split =
        static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(kBackwardSplit, nv)));
    const unsigned blocks =
        row_blocks(std::min<std::int64_t>(b.rows, std::int64_t{1} << 27)) * split;
    backward_rows_kernel<T, W>
        <<<blocks, row_threads((nv + split - 1) / split, kU), 0, native(stream)>>>(
            static_cast<const T*>(logits), Labels{labels, b.label_dtype == DType::I64}, b.row_begin,
            b.rows, b.vocab, static_cast<const lse_t<T>*>(lse), upstream.scale, upstream.row_grad,
            static_cast<T*>(grad_logits), coefficients<T>(o, b.vocab), status, split);
  });
  check_launch("cross_entropy_backward");
}

// store_loss (below) with the verdict's count for mean, or without a verdict (status null) the
// count of the labels not ignore_index.
void reduce_loss(const CrossEntropyShape& s, const double* row_loss, const LabelStatus* status,
                 const void* labels, const CrossEntropyOptions& o, void* loss,
                 const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.loss_dtype, "cross_entropy", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    T* out = static_cast<T*>(loss);
    if (o.reduction == Reduction::None) {
      if (s.rows > 0)
        store_rows_kernel<<<grid_size(s.rows, 256), 256, 0, native(stream)>>>(row_loss, s.rows,
                                                                              out);
    } else {
      reduce_rows_kernel<<<1, 1024, 0, native(stream)>>>(
          row_loss, s.rows, o.reduction == Reduction::Mean, status,
          Labels{labels, s.label_dtype == DType::I64}, o.ignore_index, out);
    }
  });
  check_launch("cross_entropy");
}

}  // namespace

Tensor check_labels(std::string_view op, const CrossEntropyShape& s, const void* labels,
                    const CrossEntropyOptions& o, const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  QueuedLabelCheck c(op, s, labels, o, stream);
  c.wait();
  return c.verdict();
}

void store_loss(const CrossEntropyShape& s, const double* row_loss, const Tensor& verdict,
                Reduction reduction, void* loss, const Stream& stream) {
  CrossEntropyOptions o;
  o.reduction = reduction;
  reduce_loss(s, row_loss, reinterpret_cast<const LabelStatus*>(verdict.data_ptr<std::int64_t>()),
              nullptr, o, loss, stream);
}

CrossEntropyUpstream read_upstream(const CrossEntropyShape& s, const void* grad_loss,
                                   const Tensor& verdict, Reduction reduction,
                                   Tensor& row_grad_storage, const Stream& stream) {
  row_grad_storage = Tensor({s.rows}, DType::F64, stream.device, stream);
  if (s.rows > 0) {
    DeviceGuard guard(stream.device.index);
    dispatch_float(s.loss_dtype, "cross_entropy", [&](auto tag) {
      using T = cuda_t<decltype(tag)>;
      row_grad_kernel<<<grid_size(s.rows, 256), 256, 0, native(stream)>>>(
          static_cast<const T*>(grad_loss), s.rows, reduction == Reduction::None,
          reduction == Reduction::Mean,
          reinterpret_cast<const LabelStatus*>(verdict.data_ptr<std::int64_t>()),
          row_grad_storage.data_ptr<double>());
    });
    check_launch("cross_entropy");
  }
  return {1.0, row_grad_storage.data_ptr<double>()};
}

void cross_entropy_forward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                void* lse, double* row_loss, const CrossEntropyOptions& o,
                                const Stream& stream) {
  forward_rows(b, logits, labels, lse, row_loss, o, nullptr, false, stream);
}

void cross_entropy_backward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                 const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                                 const CrossEntropyOptions& o, const Stream& stream) {
  backward_rows(b, logits, labels, lse, upstream, grad_logits, o, nullptr, stream);
}

void cross_entropy_forward(const CrossEntropyShape& s, const void* logits, const void* labels,
                           void* loss, void* lse, const CrossEntropyOptions& o,
                           const Stream& stream) {
  constexpr std::string_view op = "cross_entropy";
  const CrossEntropyRows all{s.dtype, s.label_dtype, 0, s.rows, s.vocab};
  DeviceGuard guard(stream.device.index);
  const Tensor row_loss({s.rows}, DType::F64, stream.device, stream);
  if (!host_waits(o, stream)) {  // no check kernel: the row blocks assert their labels
    forward_rows(all, logits, labels, lse, row_loss.data_ptr<double>(), o, nullptr, true, stream);
    reduce_loss(s, row_loss.data_ptr<double>(), nullptr, labels, o, loss, stream);
    return;
  }
  QueuedLabelCheck check(op, s, labels, o, stream);
  forward_rows(all, logits, labels, lse, row_loss.data_ptr<double>(), o, check.device(), false,
               stream);
  check.wait();
  store_loss(s, row_loss.data_ptr<double>(), check.verdict(), o.reduction, loss, stream);
}

void cross_entropy_backward(const CrossEntropyShape& s, const void* grad_loss, const void* logits,
                            const void* labels, const void* lse, void* grad_logits,
                            const CrossEntropyOptions& o, const Stream& stream) {
  constexpr std::string_view op = "cross_entropy_backward";
  const CrossEntropyRows all{s.dtype, s.label_dtype, 0, s.rows, s.vocab};
  if (s.rows == 0) return;
  DeviceGuard guard(stream.device.index);
  const Tensor row_grad({s.rows}, DType::F64, stream.device, stream);
  QueuedLabelCheck check(op, s, labels, o, stream, grad_loss, row_grad.data_ptr<double>());
  // The check kernel folded 1 / count into row_grad: scale 1 gives the same bits.
  backward_rows(all, logits, labels, lse, {1.0, row_grad.data_ptr<double>()}, grad_logits, o,
                check.device(), stream);
  check.wait();
}

}  // namespace meshfuse::detail::cuda
