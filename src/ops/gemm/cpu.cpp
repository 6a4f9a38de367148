// CPU GEMM. f32 runs on oneDNN's matmul; bf16 and f16 are widened to f32 block by block and run
// on the same matmul (fp32 products and accumulation, rounded once); f64 runs on OpenBLAS's dgemm.
// Why (bench/blas_choice.cpp, 2 threads, M=1024 K=4096): oneDNN's f32 matmul equals OpenBLAS's
// sgemm where OpenBLAS is told the CPU (OPENBLAS_CORETYPE=SkylakeX) and is 3-5x faster than the
// kernels OpenBLAS 0.3.21 picks by itself on this CPU (Prescott); oneDNN's native bf16 matmul
// (avx512_core_bf16) is slower than widening to its f32 matmul; neither library has an f16 GEMM
// here, and oneDNN has no f64.
#include <cblas.h>

#include <algorithm>
#include <dnnl.hpp>
#include <limits>
#include <memory>
#include <type_traits>

#include "ops/common.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

// Floats per widened operand block (32 MiB): bounds the scratch of a 16-bit GEMM.
constexpr std::int64_t kBlockFloats = std::int64_t{1} << 23;
// Element-wise passes smaller than this stay on the calling thread: waking the OpenMP team costs
// more than the pass (and far more when the cores are busy).
constexpr std::int64_t kParallelMin = std::int64_t{1} << 15;

template <typename T>
T* item(const GemmMatrix& x, std::int64_t l) {
  return static_cast<T*>(x.data) + l * x.batch_stride;
}

template <typename T>
T at(const GemmMatrix& x, std::int64_t l, std::int64_t r, std::int64_t c) {
  return static_cast<const T*>(x.data)[offset(x, l, r, c)];
}

const dnnl::engine& engine() {
  static const dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

dnnl::memory::desc f32_desc(const GemmMatrix& x, std::int64_t rows, std::int64_t cols) {
  using dnnl::memory;
  return {{rows, cols},
          memory::data_type::f32,
          x.transposed ? memory::dims{1, x.ld} : memory::dims{x.ld, 1}};
}

// d = alpha * a @ b (+ beta * d when beta != 0) for one (m, n, k) f32 matrix product.
void f32_matmul(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta,
                const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& d) {
  try {
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const dnnl::memory::desc ad = f32_desc(a, m, k), bd = f32_desc(b, k, n), dd = f32_desc(d, m, n);
    // Created per call: oneDNN's primitive cache turns a repeated shape into a look-up.
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, dd), attr, engine());
    dnnl::stream stream(engine());
    dnnl::matmul(pd).execute(stream, {{DNNL_ARG_SRC, dnnl::memory(ad, engine(), a.data)},
                                      {DNNL_ARG_WEIGHTS, dnnl::memory(bd, engine(), b.data)},
                                      {DNNL_ARG_DST, dnnl::memory(dd, engine(), d.data)}});
    stream.wait();
  } catch (const dnnl::error& e) {
    fail(ErrorCode::Internal, "gemm: oneDNN matmul ({} x {} x {}) failed: {}", m, n, k, e.what());
  }
}

// d = beta * c, or zeros without c: the whole GEMM when alpha = 0 or k = 0.
template <typename T>
void scale_c(const GemmProblem& p, const GemmMatrix& c, const GemmMatrix& d, bool add_c) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static) if (p.batch * p.m * p.n >= kParallelMin)
  for (std::int64_t row = 0; row < p.batch * p.m; ++row) {
    const std::int64_t l = row / p.m, i = row % p.m;
    T* out = item<T>(d, l) + i * d.ld;
    for (std::int64_t j = 0; j < p.n; ++j)
      out[j] = store_as<T>(add_c ? A(p.beta) * A(to_float(at<T>(c, l, i, j))) : A(0));
  }
}

// D = C before a BLAS call that scales D by beta in place (c may broadcast a row).
template <typename T>
void copy_c(const GemmProblem& p, const GemmMatrix& c, const GemmMatrix& d) {
  if (c.data == d.data) return;
#pragma omp parallel for schedule(static) if (p.batch * p.m * p.n >= kParallelMin)
  for (std::int64_t row = 0; row < p.batch * p.m; ++row) {
    const std::int64_t l = row / p.m, i = row % p.m;
    T* out = item<T>(d, l) + i * d.ld;
    for (std::int64_t j = 0; j < p.n; ++j) out[j] = at<T>(c, l, i, j);
  }
}

void gemm_f32(const GemmProblem& p, const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& d,
              bool add_c) {
  for (std::int64_t l = 0; l < p.batch; ++l) {
    const GemmMatrix al{item<float>(a, l), a.ld, 0, a.transposed},
        bl{item<float>(b, l), b.ld, 0, b.transposed}, dl{item<float>(d, l), d.ld, 0, false};
    f32_matmul(p.m, p.n, p.k, static_cast<float>(p.alpha),
               add_c ? static_cast<float>(p.beta) : 0.0f, al, bl, dl);
  }
}

// Scratch buffer `slot` (0..2) of at least n floats, kept per thread across calls: a fresh 16-96
// MiB allocation per GEMM is fresh pages from the kernel every time (mmap, or the heap trimmed
// after the free), and faulting them in cost 5-10% of a llama-3.2-1b linear on 2 cores.
float* scratch(int slot, std::int64_t n) {
  struct Buffer {
    std::unique_ptr<float[]> data;
    std::int64_t size = 0;
  };
  thread_local Buffer buffers[3];
  Buffer& b = buffers[slot];
  if (b.size < n) {
    b.data.reset();  // release the old block before taking the larger one
    b.data = std::make_unique_for_overwrite<float[]>(n);  // not zeroed: written before read
    b.size = n;
  }
  return b.data.get();
}

// Rows [r0, r0 + rows) x cols [c0, c0 + cols) of batch item l of x, widened to f32 into `out` in
// x's storage orientation.
template <typename T>
GemmMatrix widen(const GemmMatrix& x, std::int64_t l, std::int64_t r0, std::int64_t rows,
                 std::int64_t c0, std::int64_t cols, float* out) {
  const T* base = item<T>(x, l);
  const std::int64_t sr = x.transposed ? cols : rows, sc = x.transposed ? rows : cols;
  const std::int64_t sr0 = x.transposed ? c0 : r0, sc0 = x.transposed ? r0 : c0;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (std::int64_t i = 0; i < sr; ++i) {
    const T* src = base + (sr0 + i) * x.ld + sc0;
#pragma omp simd
    for (std::int64_t j = 0; j < sc; ++j) out[i * sc + j] = to_float(src[j]);
  }
  return {out, std::max<std::int64_t>(sc, 1), 0, x.transposed};
}

// 16-bit GEMM: per (row block, column block) of D, widen the blocks of A and B, multiply in f32,
// then D = round(product + beta * C). A row block of A is widened once, B once per row block.
template <typename T>
void gemm_widened(const GemmProblem& p, const GemmMatrix& a, const GemmMatrix& b,
                  const GemmMatrix& c, const GemmMatrix& d, bool add_c) {
  const std::int64_t block = std::max<std::int64_t>(256, kBlockFloats / p.k);
  const std::int64_t mb = std::min(p.m, block), nb = std::min(p.n, block);
  float* const as = scratch(0, mb * p.k);
  float* const bs = scratch(1, p.k * nb);
  float* const ds = scratch(2, mb * nb);
  for (std::int64_t l = 0; l < p.batch; ++l)
    for (std::int64_t i0 = 0; i0 < p.m; i0 += mb) {
      const std::int64_t mi = std::min(mb, p.m - i0);
      const GemmMatrix ab = widen<T>(a, l, i0, mi, 0, p.k, as);
      for (std::int64_t j0 = 0; j0 < p.n; j0 += nb) {
        const std::int64_t nj = std::min(nb, p.n - j0);
        const GemmMatrix bb = widen<T>(b, l, 0, p.k, j0, nj, bs);
        f32_matmul(mi, nj, p.k, static_cast<float>(p.alpha), 0.0f, ab, bb,
                   {ds, nj, 0, false});
        const float beta = static_cast<float>(p.beta);
#pragma omp parallel for schedule(static) if (mi * nj >= kParallelMin)
        for (std::int64_t i = 0; i < mi; ++i) {
          T* out = item<T>(d, l) + (i0 + i) * d.ld + j0;
          for (std::int64_t j = 0; j < nj; ++j) {
            const float cv = add_c ? beta * to_float(at<T>(c, l, i0 + i, j0 + j)) : 0.0f;
            out[j] = store_as<T>(ds[i * nj + j] + cv);
          }
        }
      }
    }
}

void gemm_f64(const GemmProblem& p, const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& d,
              bool add_c) {
  constexpr std::int64_t kMax = std::numeric_limits<blasint>::max();
  MESHFUSE_CHECK(std::max({p.m, p.n, p.k, a.ld, b.ld, d.ld}) <= kMax, ErrorCode::Unsupported,
                 "gemm: f64 sizes and leading dims must fit OpenBLAS's {}-bit int, got m={} n={} "
                 "k={} lda={} ldb={} ldd={}",
                 8 * sizeof(blasint), p.m, p.n, p.k, a.ld, b.ld, d.ld);
  const auto op = [](const GemmMatrix& x) { return x.transposed ? CblasTrans : CblasNoTrans; };
  const auto i = [](std::int64_t v) { return static_cast<blasint>(v); };
  for (std::int64_t l = 0; l < p.batch; ++l)
    cblas_dgemm(CblasRowMajor, op(a), op(b), i(p.m), i(p.n), i(p.k), p.alpha, item<double>(a, l),
                i(a.ld), item<double>(b, l), i(b.ld), add_c ? p.beta : 0.0, item<double>(d, l),
                i(d.ld));
}

template <typename T, bool kTransposed>
void column_sum_t(std::int64_t rows, std::int64_t cols, const GemmMatrix& x, T* out) {
  using A = acc_t<T>;
  constexpr std::int64_t kCols = 256;  // columns per thread task, summed as a vector
  const T* base = static_cast<const T*>(x.data);
  const std::int64_t rs = kTransposed ? 1 : x.ld, cs = kTransposed ? x.ld : 1;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (std::int64_t c0 = 0; c0 < cols; c0 += kCols) {
    const std::int64_t w = std::min(kCols, cols - c0);
    A acc[kCols] = {};
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* row = base + r * rs + c0 * cs;
#pragma omp simd
      for (std::int64_t j = 0; j < w; ++j) acc[j] += A(to_float(row[j * cs]));
    }
    for (std::int64_t j = 0; j < w; ++j) out[c0 + j] = store_as<T>(acc[j]);
  }
}

}  // namespace

void gemm(const GemmProblem& p, GemmMatrix a, GemmMatrix b, GemmMatrix c, GemmMatrix d,
          const Stream&) {
  if (p.batch == 0 || p.m == 0 || p.n == 0) return;
  const bool add_c = c.data != nullptr && p.beta != 0;
  dispatch_float(p.dtype, p.op, [&](auto tag) {
    using T = decltype(tag);
    if (p.alpha == 0 || p.k == 0) {  // BLAS: A and B are not read
      scale_c<T>(p, c, d, add_c);
    } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      if (add_c) copy_c<T>(p, c, d);
      if constexpr (std::is_same_v<T, float>)
        gemm_f32(p, a, b, d, add_c);
      else
        gemm_f64(p, a, b, d, add_c);
    } else {
      gemm_widened<T>(p, a, b, c, d, add_c);
    }
  });
}

void column_sum(DType dtype, std::int64_t rows, std::int64_t cols, GemmMatrix x, void* out,
                const Stream&) {
  dispatch_float(dtype, "linear_backward", [&](auto tag) {
    using T = decltype(tag);
    if (x.transposed)
      column_sum_t<T, true>(rows, cols, x, static_cast<T*>(out));
    else
      column_sum_t<T, false>(rows, cols, x, static_cast<T*>(out));
  });
}

}  // namespace meshfuse::detail::cpu
