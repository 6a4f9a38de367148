// CUDA GEMM through cuBLASLt, and a deterministic column sum for the bias gradient.
//
// Row-major meshfuse matrices are the transposes of column-major ones, so D = op(A) op(B) runs as
// cuBLASLt's D^T = op(B)^T op(A)^T: B is cuBLASLt's A, A its B, with op flags for the transposed
// storages and the GemmMatrix ld as the leading dimension. bmm is one strided-batched call (a batch
// stride of 0 broadcasts A or B).
//
// Numerics: CUBLAS_COMPUTE_32F for f32, bf16 and f16 (fp32 multiply-add and accumulation; f32 does
// not use TF32, which needs CUBLAS_COMPUTE_32F_FAST_TF32, so f32 results keep fp32 accuracy), and
// CUBLAS_COMPUTE_64F for f64. Split-K algorithms are limited to the reduction schemes NONE and
// COMPUTE_TYPE: partial sums stay in fp32 and the output is rounded once, in a fixed order
// (INPLACE and OUTPUT_TYPE add partials in the output type). GemmProblem::out_dtype f32 with bf16 /
// f16 operands sets C and D to f32 (a combination cuBLASLt supports with CUBLAS_COMPUTE_32F).
//
// Determinism: cuBLASLt is bitwise reproducible for a given algorithm, shape and GPU. The algorithm
// comes from cublasLtMatmulAlgoGetHeuristic (the path PyTorch takes, with the same 32 MiB workspace
// limit, cuBLAS's recommendation for Hopper) and is cached per problem key (shapes, layouts, batch
// strides, pointer alignments, epilogue, device) for the life of the process, so one key always
// runs one algorithm, and repeated calls skip the heuristic.
//
// Resources: one cuBLASLt handle per device, created on first use under a mutex and shared by all
// threads (cuBLASLt handles are thread-safe); never destroyed, as the CUDA runtime may already be
// gone at exit. The workspace a chosen algorithm needs is a meshfuse Tensor allocated on the
// caller's stream (stream-ordered, so concurrent streams never share one), only when it is > 0.
//
// Edges without cuBLASLt: alpha = 0 or K = 0 give D = beta * C (zeros without C) in a small kernel
// that reads neither A nor B; M, N or batch = 0 return at once. C is handed to cuBLASLt in its own
// layout; linear's bias row (ld = 0, beta = 1) goes through the bias epilogue; a C that cuBLASLt
// cannot take (a broadcast or transposed one, or one it declines) is copied into D first, which
// then serves as C in place.
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "core/cuda/cuda_utils.cuh"
#include "core/shared_library.h"
#include "ops/common.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

// ---- small kernels ---------------------------------------------------------------------------

// D = s * C, or zeros when c.data is null; C in any GemmMatrix layout (broadcast included).
template <typename T>
__global__ void scale_kernel(std::int64_t batch, std::int64_t m, std::int64_t n, GemmMatrix c,
                             acc_t<T> s, GemmMatrix d) {
  using A = acc_t<T>;
  const std::int64_t total = batch * m * n;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t l = i / (m * n), r = i / n % m, col = i % n;
    const A v = c.data ? s * load(static_cast<const T*>(c.data)[offset(c, l, r, col)]) : A(0);
    static_cast<T*>(d.data)[offset(d, l, r, col)] = store<T>(v);
  }
}

void scale(const GemmProblem& p, const GemmMatrix& c, double s, const GemmMatrix& d,
           const Stream& stream) {
  dispatch_float(p.out(), p.op, [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    scale_kernel<T><<<grid_size(p.batch * p.m * p.n, 256), 256, 0, native(stream)>>>(
        p.batch, p.m, p.n, c, static_cast<acc_t<T>>(s), d);
  });
  check_launch(p.op);
}

// Column sums in two passes with a fixed order: block (x, y) sums columns [32x, 32x + 32) over
// row block y, each of its 8 lanes every 8th row, the lanes in order; then one thread per column
// adds the row blocks in order. Both layouts sum in this same order (transposed storage reads
// with a stride, a rare layout for grad_out). The sums are double, as on the cpu backend: exact
// to far below the output's rounding, at no cost in a pass bound by memory.
constexpr int kSumCols = 32, kSumLanes = 8;

template <typename T>
__global__ void column_partials_kernel(GemmMatrix x, std::int64_t rows, std::int64_t cols,
                                       std::int64_t per_block, double* partials) {
  using A = double;
  __shared__ A lanes[kSumLanes][kSumCols];
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(kSumCols) + threadIdx.x;
  const std::int64_t r0 = blockIdx.y * per_block;
  const std::int64_t r1 = r0 + per_block < rows ? r0 + per_block : rows;
  A acc = 0;
  if (j < cols)
    for (std::int64_t i = r0 + threadIdx.y; i < r1; i += kSumLanes)
      acc += load(static_cast<const T*>(x.data)[offset(x, 0, i, j)]);
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  A sum = 0;
  for (int y = 0; y < kSumLanes; ++y) sum += lanes[y][threadIdx.x];
  partials[blockIdx.y * cols + j] = sum;
}

template <typename T>
__global__ void column_total_kernel(const double* partials, std::int64_t blocks,
                                    std::int64_t cols, T* out) {
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  double sum = 0;
  for (std::int64_t b = 0; b < blocks; ++b) sum += partials[b * cols + j];
  out[j] = store<T>(sum);
}

// Row blocks of the column sum: a function of the row count only (the bits depend on it). Blocks
// of up to 64 rows, at most 256 of them (then longer): with 32-column tiles, enough blocks to fill
// the GPU at llama widths, and partials of a few percent of the input.
std::int64_t column_sum_blocks(std::int64_t rows) {
  return std::min<std::int64_t>((rows + 63) / 64, 256);
}

// ---- cuBLASLt ----------------------------------------------------------------------------------

// cuBLASLt, opened at its first use instead of linked (core/shared_library.h says why);
// MESHFUSE_CUBLASLT_LIBRARY names another file.
struct LtApi {
  std::string path;  // as opened
  std::size_t version;
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtGetStatusName) GetStatusName;
  decltype(&::cublasLtGetStatusString) GetStatusString;
  decltype(&::cublasLtMatmul) Matmul;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&::cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute;
};

// The API, loading the library at the first call; a failed load throws naming `op` and is tried
// again by the next call.
const LtApi& lt(std::string_view op) {
  static const LtApi api = [&] {
    const SharedLibrary lib(std::string(op) + ": cuBLASLt", "MESHFUSE_CUBLASLT_LIBRARY",
                            "libcublasLt.so." MESHFUSE_CUDA_MAJOR, MESHFUSE_CUBLASLT_BUILD_LIBRARY,
                            "install the CUDA toolkit's cuBLAS");
    LtApi a{};
    a.path = lib.path();
    const auto bind = [&](auto& fn, const char* name) {
      lib.bind(fn, name, "the cuBLAS of CUDA " MESHFUSE_CUDA_MAJOR);
    };
    decltype(&::cublasLtGetVersion) get_version = nullptr;
    bind(get_version, "cublasLtGetVersion");
    a.version = get_version();  // major * 10000 + minor * 100 + patch
    if (std::to_string(a.version / 10000) != MESHFUSE_CUDA_MAJOR)
      throw Error(ErrorCode::BackendUnavailable,
                  std::string(op) + ": cuBLASLt: " + a.path + " is version " +
                      std::to_string(a.version) +
                      ", but this build of meshfuse needs the cuBLAS of CUDA " MESHFUSE_CUDA_MAJOR);
    bind(a.Create, "cublasLtCreate");
    bind(a.GetStatusName, "cublasLtGetStatusName");
    bind(a.GetStatusString, "cublasLtGetStatusString");
    bind(a.Matmul, "cublasLtMatmul");
    bind(a.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind(a.MatmulDescCreate, "cublasLtMatmulDescCreate");
    bind(a.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
    bind(a.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
    bind(a.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
    bind(a.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
    bind(a.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
    bind(a.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
    bind(a.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
    bind(a.MatrixLayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute");
    return a;
  }();
  return api;
}

// The largest workspace offered to the heuristic.
constexpr std::uint64_t kMaxWorkspace = std::uint64_t{32} << 20;

std::string problem_str(const GemmProblem& p) {
  return std::string(to_string(p.dtype)) +
         (p.out() != p.dtype ? std::string(" -> ") + std::string(to_string(p.out())) : "") +
         " batch=" + std::to_string(p.batch) + " m=" + std::to_string(p.m) +
         " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k);
}

ErrorCode error_code(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return ErrorCode::OutOfMemory;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return ErrorCode::Unsupported;
    default:
      return ErrorCode::Internal;
  }
}

// Throws Error naming the op, the cuBLASLt call, its status and the problem.
void check_lt(cublasStatus_t status, const GemmProblem& p, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw Error(error_code(status), std::string(p.op) + ": " + call + " failed with " +
                                      lt(p.op).GetStatusName(status) + " (" +
                                      lt(p.op).GetStatusString(status) + ") for " + problem_str(p));
}

// The cuBLASLt handle of the current device `device`, created on first use.
cublasLtHandle_t lt_handle(int device, const GemmProblem& p) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;  // never destroyed (see the file comment)
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = handles.find(device);
  if (found != handles.end()) return found->second;
  cublasLtHandle_t handle = nullptr;
  check_lt(lt(p.op).Create(&handle), p, "cublasLtCreate");
  return handles.emplace(device, handle).first->second;
}

// A cuBLASLt descriptor destroyed with its owner.
template <typename H, auto LtApi::*kDestroy>
class Owned {
 public:
  Owned() = default;
  ~Owned() {
    if (h_) (lt("cuBLASLt").*kDestroy)(h_);  // loaded by the create
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  H* out() { return &h_; }
  H get() const { return h_; }

 private:
  H h_ = nullptr;
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, &LtApi::MatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, &LtApi::MatrixLayoutDestroy>;
using Preference = Owned<cublasLtMatmulPreference_t, &LtApi::MatmulPreferenceDestroy>;

// A matrix as cuBLASLt sees it: column-major storage of rows x cols with leading dimension ld,
// read through `op`.
struct LtMatrix {
  const void* data;
  cublasOperation_t op;
  std::int64_t rows, cols, ld, batch_stride;
};

// cuBLASLt's view of X^T for a (r x c) GemmMatrix X: row-major storage is X^T column-major (op N);
// transposed storage is X column-major, turned into X^T by op T.
LtMatrix transposed_of(const GemmMatrix& x, std::int64_t r, std::int64_t c) {
  if (x.transposed) return {x.data, CUBLAS_OP_T, r, c, x.ld, x.batch_stride};
  return {x.data, CUBLAS_OP_N, c, r, x.ld, x.batch_stride};
}

// One cublasLtMatmul: D^T = alpha * op(a) op(b) + beta * C^T (+ bias), with a = B^T, b = A^T.
struct LtCall {
  const GemmProblem& p;
  LtMatrix a, b, c, d;
  const void* bias;  // linear's bias, added by the epilogue, or null
  double beta;       // 0: C is not read
};

// What every batch item's address is a multiple of (bytes, up to 256): the heuristic must only
// pick algorithms that work at this alignment.
std::uint32_t alignment(const void* data, std::int64_t batch_stride_bytes) {
  const std::uint64_t bits =
      reinterpret_cast<std::uintptr_t>(data) | static_cast<std::uint64_t>(batch_stride_bytes) | 256;
  return static_cast<std::uint32_t>(bits & (~bits + 1));
}

cudaDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return CUDA_R_64F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

template <typename D, typename A, typename V>
void set(D desc, A attribute, const V& value, cublasStatus_t (*setter)(D, A, const void*, size_t),
         const GemmProblem& p, const char* call) {
  check_lt(setter(desc, attribute, &value, sizeof(value)), p, call);
}

void make_layout(Layout& layout, cudaDataType_t type, const LtMatrix& x, const GemmProblem& p) {
  check_lt(lt(p.op).MatrixLayoutCreate(layout.out(), type, x.rows, x.cols, x.ld), p,
           "cublasLtMatrixLayoutCreate");
  if (p.batch == 1) return;
  const auto count = static_cast<std::int32_t>(p.batch);
  set(layout.get(), CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count, lt(p.op).MatrixLayoutSetAttribute, p,
      "cublasLtMatrixLayoutSetAttribute");
  set(layout.get(), CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, x.batch_stride,
      lt(p.op).MatrixLayoutSetAttribute, p, "cublasLtMatrixLayoutSetAttribute");
}

// The heuristic's choice for one problem key; status is not SUCCESS when it found none.
struct Choice {
  cublasStatus_t status;
  cublasLtMatmulAlgo_t algo;
  std::size_t workspace;
};

using ChoiceKey = std::array<std::int64_t, 25>;

// The cached choice for `key`, or `choose()` stored under it. The first choice stored wins, so a
// key always maps to one algorithm even when threads race to choose.
template <typename F>
Choice cached_choice(const ChoiceKey& key, F&& choose) {
  static std::mutex mutex;
  static std::map<ChoiceKey, Choice> cache;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = cache.find(key);
    if (found != cache.end()) return found->second;
  }
  const Choice choice = choose();  // outside the lock: the heuristic takes a while
  const std::lock_guard<std::mutex> lock(mutex);
  return cache.emplace(key, choice).first->second;
}

// Queues the call on `stream`. When cuBLASLt has no algorithm for it: returns false, having
// queued nothing, if `may_decline`; throws otherwise.
bool lt_matmul(const LtCall& call, const Stream& stream, bool may_decline) {
  const GemmProblem& p = call.p;
  if (p.batch > INT32_MAX)
    throw Error(ErrorCode::Unsupported, std::string(p.op) + ": cuBLASLt takes at most 2^31 - 1 " +
                                            "batch items, got " + problem_str(p));
  const int device = stream.device.index;
  const cublasLtHandle_t handle = lt_handle(device, p);
  const bool f64 = p.dtype == DType::F64;
  const cudaDataType_t type = data_type(p.dtype), out_type = data_type(p.out());
  const std::int64_t esize = static_cast<std::int64_t>(element_size(p.dtype)),
                     out_esize = static_cast<std::int64_t>(element_size(p.out()));

  MatmulDesc desc;
  check_lt(lt(p.op).MatmulDescCreate(desc.out(), f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                                     f64 ? CUDA_R_64F : CUDA_R_32F),
           p, "cublasLtMatmulDescCreate");
  const auto set_desc = [&](cublasLtMatmulDescAttributes_t attribute, const auto& value) {
    set(desc.get(), attribute, value, lt(p.op).MatmulDescSetAttribute, p,
        "cublasLtMatmulDescSetAttribute");
  };
  set_desc(CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(call.a.op));
  set_desc(CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(call.b.op));
  if (call.bias) {
    set_desc(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<std::uint32_t>(CUBLASLT_EPILOGUE_BIAS));
    set_desc(CUBLASLT_MATMUL_DESC_BIAS_POINTER, call.bias);
  }
  Layout la, lb, lc, ld;
  make_layout(la, type, call.a, p);
  make_layout(lb, type, call.b, p);
  make_layout(lc, out_type, call.c, p);
  make_layout(ld, out_type, call.d, p);

  const auto align = [&](const LtMatrix& x, std::int64_t size) {
    return alignment(x.data, p.batch > 1 ? x.batch_stride * size : 0);
  };
  const std::uint32_t aligns[] = {align(call.a, esize), align(call.b, esize),
                                  align(call.c, out_esize), align(call.d, out_esize)};
  const auto stride = [&](const LtMatrix& x) { return p.batch > 1 ? x.batch_stride : 0; };
  const ChoiceKey key = {device,         static_cast<std::int64_t>(p.dtype),
                         static_cast<std::int64_t>(p.out()),
                         call.a.op,      call.b.op,
                         call.a.rows,    call.a.cols,
                         call.a.ld,      call.b.rows,
                         call.b.cols,    call.b.ld,
                         call.c.ld,      call.d.rows,
                         call.d.cols,    call.d.ld,
                         p.batch,        stride(call.a),
                         stride(call.b), stride(call.c),
                         stride(call.d), aligns[0],
                         aligns[1],      aligns[2],
                         aligns[3],      call.bias ? alignment(call.bias, 0) : 0};
  const Choice choice = cached_choice(key, [&] {
    Preference pref;
    check_lt(lt(p.op).MatmulPreferenceCreate(pref.out()), p, "cublasLtMatmulPreferenceCreate");
    const auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
      set(pref.get(), attribute, value, lt(p.op).MatmulPreferenceSetAttribute, p,
          "cublasLtMatmulPreferenceSetAttribute");
    };
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, kMaxWorkspace);
    set_pref(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
             static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE |
                                        CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aligns[0]);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, aligns[1]);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, aligns[2]);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, aligns[3]);
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    cublasStatus_t status = lt(p.op).MatmulAlgoGetHeuristic(
        handle, desc.get(), la.get(), lb.get(), lc.get(), ld.get(), pref.get(), 1, &result, &count);
    if (status == CUBLAS_STATUS_SUCCESS && count == 0) status = CUBLAS_STATUS_NOT_SUPPORTED;
    return Choice{status, result.algo, result.workspaceSize};
  });
  if (choice.status != CUBLAS_STATUS_SUCCESS) {
    if (may_decline) return false;
    check_lt(choice.status, p, "cublasLtMatmulAlgoGetHeuristic");
  }

  const Tensor workspace = choice.workspace == 0
                               ? Tensor()
                               : Tensor({static_cast<std::int64_t>(choice.workspace)}, DType::U8,
                                        Device{DeviceType::CUDA, device}, stream);
  const float alpha32 = static_cast<float>(p.alpha), beta32 = static_cast<float>(call.beta);
  const void* alpha = f64 ? static_cast<const void*>(&p.alpha) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&call.beta) : &beta32;
  check_lt(lt(p.op).Matmul(handle, desc.get(), alpha, call.a.data, la.get(), call.b.data, lb.get(),
                           beta, call.c.data, lc.get(), const_cast<void*>(call.d.data), ld.get(),
                           &choice.algo, workspace.defined() ? workspace.view().data() : nullptr,
                           choice.workspace, native(stream)),
           p, "cublasLtMatmul");
  return true;
}

// cuBLASLt's heuristic answers CUBLAS_STATUS_NOT_SUPPORTED for a leading dimension past int32
// (seen on an H200, CUDA 13): such an (r x c) operand is first gathered densely into `scratch`
// on the stream (a strided device copy with 64-bit offsets).
GemmMatrix dense_if_ld_too_large(const GemmProblem& p, GemmMatrix x, std::int64_t r,
                                 std::int64_t c, Tensor& scratch, const Stream& stream) {
  if (x.ld <= INT32_MAX) return x;
  const std::int64_t rows = x.transposed ? c : r, cols = x.transposed ? r : c;  // as stored
  const TensorView src(x.data, p.dtype, {p.batch, rows, cols}, {x.batch_stride, x.ld, 1},
                       stream.device);
  scratch = Tensor(src.shape(), p.dtype, stream.device, stream);
  copy(src, scratch, stream);
  return {scratch.view().data(), cols, rows * cols, x.transposed};
}

}  // namespace

void gemm(const GemmProblem& p, GemmMatrix a, GemmMatrix b, GemmMatrix c, GemmMatrix d,
          const Stream& stream) {
  if (p.batch == 0 || p.m == 0 || p.n == 0) return;
  DeviceGuard guard(stream.device.index);
  const bool add_c = c.data != nullptr && p.beta != 0;
  if (p.alpha == 0 || p.k == 0) return scale(p, add_c ? c : GemmMatrix{}, p.beta, d, stream);
  Tensor a_dense, b_dense;
  a = dense_if_ld_too_large(p, a, p.m, p.k, a_dense, stream);
  b = dense_if_ld_too_large(p, b, p.k, p.n, b_dense, stream);
  const LtMatrix dt = transposed_of(d, p.m, p.n);
  LtCall call{p, transposed_of(b, p.k, p.n), transposed_of(a, p.m, p.k), dt, dt, nullptr, 0.0};
  if (add_c && c.data != d.data) {
    LtCall direct = call;
    direct.beta = p.beta;
    bool direct_ok = false;
    if (c.ld == 0 && p.beta == 1) {  // linear's bias row
      direct.bias = c.data;
      direct.beta = 0;
      direct_ok = true;
    } else if (c.ld > 0 && !c.transposed && (p.batch == 1 || c.batch_stride != 0)) {
      direct.c = transposed_of(c, p.m, p.n);
      direct_ok = true;
    }
    if (direct_ok && lt_matmul(direct, stream, true)) return;
    scale(p, c, 1.0, d, stream);  // D = C, read in place below
  }
  call.beta = add_c ? p.beta : 0.0;
  lt_matmul(call, stream, false);
}

void column_sum(DType dtype, std::int64_t rows, std::int64_t cols, GemmMatrix x, void* out,
                const Stream& stream) {
  if (cols == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(dtype, "linear_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    const std::int64_t blocks = column_sum_blocks(rows);
    // The partial rows: scratch on the stream, ordered with the kernels that use it.
    Tensor partials;
    if (blocks > 0) {
      partials = Tensor({blocks, cols}, DType::F64,
                        Device{DeviceType::CUDA, stream.device.index}, stream);
      const dim3 grid(ceil_div(cols, kSumCols), static_cast<unsigned>(blocks));
      column_partials_kernel<T><<<grid, dim3(kSumCols, kSumLanes), 0, native(stream)>>>(
          x, rows, cols, (rows + blocks - 1) / blocks, partials.data_ptr<double>());
    }
    column_total_kernel<T><<<ceil_div(cols, 256), 256, 0, native(stream)>>>(
        blocks > 0 ? partials.data_ptr<double>() : nullptr, blocks, cols, static_cast<T*>(out));
  });
  check_launch("linear_backward");
}

std::string cublaslt_library() {
  const LtApi& api = lt("cublaslt_library");
  return "cuBLASLt " + std::to_string(api.version / 10000) + "." +
         std::to_string(api.version / 100 % 100) + "." + std::to_string(api.version % 100) + " (" +
         api.path + ")";
}

}  // namespace meshfuse::detail::cuda
