// CPU GEMM. f32, bf16 and f16 run on one sgemm (MKL's where installed, else oneDNN's, on Arm64
// OpenBLAS's: see sgemm) with both operands row-major (16-bit ones widened to f32 block by block:
// fp32 products and accumulation, rounded once; gemm_row_major says why); f64 runs on OpenBLAS's
// dgemm. Why these libraries (bench/blas_choice.cpp, on x86-64): MKL's sums are PyTorch's
// (cpu_blas.h); oneDNN's f32 GEMMs need no hint of the CPU, where OpenBLAS picks generic kernels
// unless OPENBLAS_CORETYPE is set; oneDNN's native bf16 matmul is slower than widening to f32;
// neither library has an f16 GEMM, and oneDNN has no f64. Figures: docs/kernels/gemm.md.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <dnnl.hpp>
#include <limits>
#include <type_traits>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/gemm/cpu_blas.h"
#include "ops/gemm/cpu_pack.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

// Floats per prepared operand block (32 MiB): bounds the scratch of a GEMM (row_major).
constexpr std::int64_t kBlockFloats = std::int64_t{1} << 23;

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

// The (rows, cols) matrix x as an f32 memory descriptor; with parts > 1, the equal slices of
// its dim k_dim (0: rows, 1: cols) as a batch of `parts` matrices.
dnnl::memory::desc f32_desc(const GemmMatrix& x, std::int64_t rows, std::int64_t cols,
                            std::int64_t parts = 1, int k_dim = 0) {
  using dnnl::memory;
  const memory::dims strides = x.transposed ? memory::dims{1, x.ld} : memory::dims{x.ld, 1};
  if (parts == 1) return {{rows, cols}, memory::data_type::f32, strides};
  const std::int64_t slice = (k_dim ? cols : rows) / parts;
  return {{parts, k_dim ? rows : slice, k_dim ? slice : cols},
          memory::data_type::f32,
          {slice * strides[k_dim], strides[0], strides[1]}};
}

// d = alpha * a @ b (+ beta * d when beta != 0) for one (m, n, k) f32 matrix product; with
// parts > 1 (dividing k), d is (parts, m, n): the products of K's slices, each from zero.
void f32_matmul(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta,
                const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& d,
                std::int64_t parts = 1) {
  try {
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const dnnl::memory::desc ad = f32_desc(a, m, k, parts, 1), bd = f32_desc(b, k, n, parts, 0),
                             dd = parts == 1 ? f32_desc(d, m, n)
                                             : dnnl::memory::desc({parts, m, n},
                                                                  dnnl::memory::data_type::f32,
                                                                  {m * d.ld, d.ld, 1});
    // Created per call: oneDNN's primitive cache turns a repeated shape into a look-up.
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, dd), attr, engine());
    dnnl::stream stream(engine());
    dnnl::matmul(pd).execute(stream, {{DNNL_ARG_SRC, dnnl::memory(ad, engine(), a.data)},
                                      {DNNL_ARG_WEIGHTS, dnnl::memory(bd, engine(), b.data)},
                                      {DNNL_ARG_DST, dnnl::memory(dd, engine(), d.data)}});
    stream.wait();
  } catch (const dnnl::error& e) {
    fail(ErrorCode::Internal, "gemm: oneDNN matmul ({} x {} x {}{}) failed: {}", m, n, k,
         parts > 1 ? fmt::format(" in {} slices of K", parts) : "", e.what());
  }
}

#if defined(__aarch64__)
// OpenBLAS takes its sizes and leading dims as blasint: past its range the call is Unsupported.
void check_blas_sizes(std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda,
                      std::int64_t ldb, std::int64_t ldd) {
  constexpr std::int64_t kMax = std::numeric_limits<blasint>::max();
  MESHFUSE_CHECK(std::max({m, n, k, lda, ldb, ldd}) <= kMax, ErrorCode::Unsupported,
                 "gemm: sizes and leading dims must fit OpenBLAS's {}-bit int, got m={} n={} k={} "
                 "lda={} ldb={} ldd={}",
                 8 * sizeof(blasint), m, n, k, lda, ldb, ldd);
}
#endif
blasint blas_int(std::int64_t v) { return static_cast<blasint>(v); }

// d (m x n) = alpha * a (m x k) @ b (k x n) + beta * d, every matrix row-major. On x86-64 MKL's
// sgemm when it is installed, else oneDNN's (cpu_blas.h). On Arm64 OpenBLAS's sgemm: oneDNN has no
// sgemm kernel for Arm (Debian's arm64 build runs dnnl_sgemm on its reference ref_gemm<float>), and
// that one accumulates long runs of K in one float: at k = 2^15 it was off by up to 15 eps *
// sum|a*b| (Gemm.GemmLargerThanOneScratchBlock... failed under qemu), where OpenBLAS's blocked
// kernels, like oneDNN's x86-64 ones, stay under 1.
void sgemm(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* d,
           std::int64_t ldd) {
#if defined(__aarch64__)
  check_blas_sizes(m, n, k, lda, ldb, ldd);
  const auto i = blas_int;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i(m), i(n), i(k), alpha, a, i(lda), b,
              i(ldb), beta, d, i(ldd));
#else
  if (const MklSgemm mkl = mkl_sgemm()) {
    return mkl(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta,
               d, ldd);
  }
  const dnnl_status_t status = dnnl_sgemm('N', 'N', m, n, k, alpha, a, lda, b, ldb, beta, d, ldd);
  MESHFUSE_CHECK(status == dnnl_success, ErrorCode::Internal,
                 "gemm: oneDNN sgemm ({} x {} x {}) failed with status {}", m, n, k,
                 static_cast<int>(status));
#endif
}

// d = beta * c, or zeros without c: the whole GEMM when alpha = 0 or k = 0. O: C and D's type.
template <typename O>
void scale_c(const GemmProblem& p, const GemmMatrix& c, const GemmMatrix& d, bool add_c) {
  using A = acc_t<O>;
  parallel_if(p.batch * p.m * p.n >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < p.batch * p.m; ++row) {
      const std::int64_t l = row / p.m, i = row % p.m;
      O* out = item<O>(d, l) + i * d.ld;
      for (std::int64_t j = 0; j < p.n; ++j)
        out[j] = store_as<O>(add_c ? A(p.beta) * A(to_float(at<O>(c, l, i, j))) : A(0));
    }
  });
}

// D = C before a BLAS call that scales D by beta in place (c may broadcast a row).
template <typename T>
void copy_c(const GemmProblem& p, const GemmMatrix& c, const GemmMatrix& d) {
  if (c.data == d.data) return;
  parallel_if(p.batch * p.m * p.n >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < p.batch * p.m; ++row) {
      const std::int64_t l = row / p.m, i = row % p.m;
      T* out = item<T>(d, l) + i * d.ld;
      for (std::int64_t j = 0; j < p.n; ++j) out[j] = at<T>(c, l, i, j);
    }
  });
}

// Scratch buffer `slot` (0..2) of at least n floats, kept per thread across calls: a fresh 16-96
// MiB allocation per GEMM is fresh pages from the kernel every time (mmap, or the heap trimmed
// after the free), and faulting them in costs a noticeable part of a linear.
float* scratch(int slot, std::int64_t n) {
  thread_local Tensor buffers[3];  // 64-byte aligned, for pack_f32's streaming stores
  Tensor& b = buffers[slot];
  if (!b.defined() || b.numel() < n) {
    b = Tensor();                 // release the old block before taking the larger one
    b = Tensor({n}, DType::F32);  // not zeroed: written before read
  }
  return b.data_ptr<float>();
}

// Rows [r0, r0 + rows) x cols [c0, c0 + cols) of batch item l of x as a row-major f32 block with
// leading dim cols: in place when x is f32 and laid out as the copy would be, else widened and/or
// transposed into scratch `slot`. Blocks past the L2 caches go out with streaming stores (they
// measured faster); each thread fences them before sgemm's threads read them.
template <typename T>
const float* row_major(const GemmMatrix& x, std::int64_t l, std::int64_t r0, std::int64_t rows,
                       std::int64_t c0, std::int64_t cols, int slot) {
  const T* base = item<T>(x, l);
  // In place only when sgemm would see what a copy gives it: ld = cols, 64-byte aligned (oneDNN
  // picks its kernels by leading dims, among others).
  if constexpr (std::is_same_v<T, float>) {
    const float* in_place = base + r0 * x.ld + c0;
    if (!x.transposed && x.ld == cols && reinterpret_cast<std::uintptr_t>(in_place) % 64 == 0)
      return in_place;
  }
  float* const out = scratch(slot, rows * cols);
  const bool stream =
      output_write(rows * cols * static_cast<std::int64_t>(sizeof(T) + 4), out, rows * cols * 4)
          .stream;
  pack_f32(dtype_of<T>(), base, x.ld, x.transposed, r0, rows, c0, cols, out, stream);
  return out;
}

// f32, bf16 and f16 GEMMs: per (row block, column block) of D, A's and B's blocks as row-major f32
// (row_major), one sgemm ('N', 'N') of the plain product, then D = round(alpha * product + beta *
// C) with one fma: alpha and C meet the accumulated sum once, as in cuBLAS and the reference (BLAS
// scales its packed operands by alpha and adds beta * C into its partial sums, which rounds the
// result several times; with beta = 1 too, since every partial sum after C then rounds at C's
// size). An f32 GEMM with alpha = 1 and no C writes D inside sgemm. A row block of A is
// prepared once, B once per row block. The blocks, their leading dims and their alignment depend on
// m, n and k alone, never on how A and B are stored, so a transposed view gives bitwise its
// contiguous copy's result: sgemm's sums follow its transpose flags, and so, at some shapes, do
// those of oneDNN's matmul primitive (f32 20 x 1504 x 1100), which ran here before (its rates, and
// this loop's: docs/kernels/gemm.md). O is C and D's type: T, or float for an f32 output of 16-bit
// operands.
template <typename T, typename O>
void gemm_row_major(const GemmProblem& p, const GemmMatrix& a, const GemmMatrix& b,
                    const GemmMatrix& c, const GemmMatrix& d, bool add_c) {
  const bool direct = std::is_same_v<O, float> && p.alpha == 1.0 && !add_c;
  const std::int64_t block = std::max<std::int64_t>(256, kBlockFloats / p.k);
  const std::int64_t mb = std::min(p.m, block), nb = std::min(p.n, block);
  float* const ds = direct ? nullptr : scratch(2, mb * nb);
  const float alpha = static_cast<float>(p.alpha), beta = static_cast<float>(p.beta);
  for (std::int64_t l = 0; l < p.batch; ++l)
    for (std::int64_t i0 = 0; i0 < p.m; i0 += mb) {
      const std::int64_t mi = std::min(mb, p.m - i0);
      const float* const ab = row_major<T>(a, l, i0, mi, 0, p.k, 0);
      for (std::int64_t j0 = 0; j0 < p.n; j0 += nb) {
        const std::int64_t nj = std::min(nb, p.n - j0);
        const float* const bb = row_major<T>(b, l, 0, p.k, j0, nj, 1);
        if (direct) {
          sgemm(mi, nj, p.k, 1.0f, ab, p.k, bb, nj, 0.0f, item<float>(d, l) + i0 * d.ld + j0, d.ld);
          continue;
        }
        sgemm(mi, nj, p.k, 1.0f, ab, p.k, bb, nj, 0.0f, ds, nj);
        parallel_if(mi * nj >= kParallelMin, [&] {
#pragma omp for schedule(static)
          for (std::int64_t i = 0; i < mi; ++i) {
            O* out = item<O>(d, l) + (i0 + i) * d.ld + j0;  // may be C itself: read before written
            for (std::int64_t j = 0; j < nj; ++j) {
              const float cv = add_c ? beta * to_float(at<O>(c, l, i0 + i, j0 + j)) : 0.0f;
              out[j] = store_as<O>(std::fma(alpha, ds[i * nj + j], cv));
            }
          }
        });
      }
    }
}

// Batch item l of x (rows x cols) as a row-major matrix whose leading dim fits OpenBLAS's int: x
// itself, or a copy into `copy` (cols wide) where x's leading dim does not fit.
GemmMatrix blas_operand(const GemmMatrix& x, std::int64_t l, std::int64_t rows, std::int64_t cols,
                        Tensor& copy) {
  if (x.ld <= std::numeric_limits<blasint>::max())
    return {item<double>(x, l), x.ld, 0, x.transposed};
  if (!copy.defined()) copy = Tensor({rows * cols}, DType::F64);
  double* const out = copy.data_ptr<double>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[r * cols + c] = at<double>(x, l, r, c);
  return {out, cols, 0, false};
}

// f64 through OpenBLAS: the plain product (into D, or into a scratch product when alpha != 1 or C
// is added), then D = alpha * product + beta * C with one fma, for the reason given above. An
// operand whose leading dim is past OpenBLAS's int (a view of rows 2^31 elements apart) is copied
// first: its sizes fit, or the call is Unsupported.
void gemm_f64(const GemmProblem& p, const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& c,
              const GemmMatrix& d, bool add_c) {
  MESHFUSE_CHECK(std::max({p.m, p.n, p.k}) <= std::numeric_limits<blasint>::max(),
                 ErrorCode::Unsupported,
                 "gemm: f64 sizes must fit OpenBLAS's {}-bit int, got m={} n={} k={}",
                 8 * sizeof(blasint), p.m, p.n, p.k);
  const auto op = [](const GemmMatrix& x) { return x.transposed ? CblasTrans : CblasNoTrans; };
  const auto i = blas_int;
  const bool direct = p.alpha == 1.0 && !add_c;  // D is contiguous: its ld, n, fits
  Tensor product = direct ? Tensor() : Tensor({p.m * p.n}, DType::F64), a_copy, b_copy;
  for (std::int64_t l = 0; l < p.batch; ++l) {
    double* const out = direct ? item<double>(d, l) : product.data_ptr<double>();
    const GemmMatrix ab = blas_operand(a, l, p.m, p.k, a_copy),
                     bb = blas_operand(b, l, p.k, p.n, b_copy);
    cblas_dgemm(CblasRowMajor, op(ab), op(bb), i(p.m), i(p.n), i(p.k), 1.0,
                static_cast<const double*>(ab.data), i(ab.ld), static_cast<const double*>(bb.data),
                i(bb.ld), 0.0, out, direct ? i(d.ld) : i(p.n));
    if (direct) continue;
    parallel_if(p.m * p.n >= kParallelMin, [&] {
#pragma omp for schedule(static)
      for (std::int64_t r = 0; r < p.m; ++r) {
        double* const row = item<double>(d, l) + r * d.ld;  // may be C itself: read before written
        for (std::int64_t j = 0; j < p.n; ++j) {
          const double cv = add_c ? p.beta * at<double>(c, l, r, j) : 0.0;
          row[j] = std::fma(p.alpha, out[r * p.n + j], cv);
        }
      }
    });
  }
}

// In double for every dtype: the sum is exact to far below the output's rounding whatever the row
// count (an fp32 sum in row order drifts further from it than PyTorch's cascade sum), and the pass
// is bound by memory.
template <typename T, bool kTransposed>
void column_sum_t(std::int64_t rows, std::int64_t cols, const GemmMatrix& x, T* out) {
  constexpr std::int64_t kCols = 256;  // columns per thread task, summed as a vector
  const T* base = static_cast<const T*>(x.data);
  const std::int64_t rs = kTransposed ? 1 : x.ld, cs = kTransposed ? x.ld : 1;
  parallel_if(rows * cols >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kCols) {
      const std::int64_t w = std::min(kCols, cols - c0);
      double acc[kCols] = {};
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* row = base + r * rs + c0 * cs;
#pragma omp simd
        for (std::int64_t j = 0; j < w; ++j) acc[j] += double(to_float(row[j * cs]));
      }
      for (std::int64_t j = 0; j < w; ++j) out[c0 + j] = from_double<T>(acc[j]);
    }
  });
}

}  // namespace

void gemm(const GemmProblem& p, GemmMatrix a, GemmMatrix b, GemmMatrix c, GemmMatrix d,
          const Stream&) {
  if (p.batch == 0 || p.m == 0 || p.n == 0) return;
  const bool add_c = c.data != nullptr && p.beta != 0;
  dispatch_gemm(p, [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    if (p.alpha == 0 || p.k == 0) {  // BLAS: A and B are not read
      scale_c<O>(p, c, d, add_c);
    } else if constexpr (std::is_same_v<T, double>) {
      gemm_f64(p, a, b, c, d, add_c);
    } else {
      gemm_row_major<T, O>(p, a, b, c, d, add_c);
    }
  });
}

// oneDNN's matmul sums K in one chain per output, whose rounding error grows with K; from this K
// on, fused linear cross-entropy's products add a pairwise level above it (f32_matmul_split_k).
constexpr std::int64_t kSplitK = 1024;

// A GemmMatrix whose rows start `rows` on and whose columns start `cols` on.
GemmMatrix shifted(const GemmMatrix& x, std::int64_t rows, std::int64_t cols) {
  return {static_cast<float*>(x.data) + offset(x, 0, rows, cols), x.ld, 0, x.transposed};
}

// d = a @ b (+ d when add) with the two halves of K each summed from zero and added once (an odd
// K's last product added with them): the error of a chain of K / 2
// (docs/kernels/fused_linear_cross_entropy.md). The halves are one batch of two products (one
// primitive call: a call per strided half picked slower kernels), written to scratch a tile at a
// time: at most 2^22 floats, at least 1024 columns wide where n has them (narrower tiles re-read
// a once per tile).
void f32_matmul_split_k(std::int64_t m, std::int64_t n, std::int64_t k, bool add,
                        const GemmMatrix& a, const GemmMatrix& b, const GemmMatrix& d) {
  constexpr std::int64_t kTileFloats = std::int64_t{1} << 22;
  const std::int64_t k2 = k - k % 2;
  const std::int64_t w = std::min(n, std::max<std::int64_t>(1024, kTileFloats / (2 * m)));
  const std::int64_t rows = std::clamp<std::int64_t>(kTileFloats / (2 * w), 1, m);
  float* const halves = scratch(0, 2 * rows * w);
  for (std::int64_t i0 = 0; i0 < m; i0 += rows)
    for (std::int64_t j0 = 0; j0 < n; j0 += w) {
      const std::int64_t mi = std::min(rows, m - i0), wj = std::min(w, n - j0);
      const GemmMatrix ta = shifted(a, i0, 0), tb = shifted(b, 0, j0), td = shifted(d, i0, j0);
      f32_matmul(mi, wj, k2, 1.0f, 0.0f, ta, tb, {halves, wj, 0, false}, 2);
      parallel_if(mi * wj >= kParallelMin, [&] {
#pragma omp for schedule(static)
        for (std::int64_t i = 0; i < mi; ++i) {
          float* out = static_cast<float*>(td.data) + i * td.ld;
          const float* h0 = halves + i * wj;
          const float* h1 = h0 + mi * wj;
          if (k2 == k) {
#pragma omp simd
            for (std::int64_t j = 0; j < wj; ++j)
              out[j] = add ? out[j] + (h0[j] + h1[j]) : h0[j] + h1[j];
          } else {
            const float a_last = at<float>(ta, 0, i, k - 1);
            for (std::int64_t j = 0; j < wj; ++j) {
              const float sum = (h0[j] + h1[j]) + a_last * at<float>(tb, 0, k - 1, j);
              out[j] = add ? out[j] + sum : sum;
            }
          }
        }
      });
    }
}

void gemm_fixed_layout(const GemmProblem& p, GemmMatrix a, GemmMatrix b, GemmMatrix c, GemmMatrix d,
                       const Stream& stream) {
  if (p.dtype != DType::F32 || p.batch == 0 || p.m == 0 || p.n == 0 || p.alpha == 0 || p.k == 0)
    return gemm(p, a, b, c, d, stream);
  const bool add_c = c.data != nullptr && p.beta != 0;
  if (add_c) copy_c<float>(p, c, d);
  const auto alpha = static_cast<float>(p.alpha), beta = add_c ? static_cast<float>(p.beta) : 0.0f;
  for (std::int64_t l = 0; l < p.batch; ++l) {
    const GemmMatrix al{item<float>(a, l), a.ld, 0, a.transposed},
        bl{item<float>(b, l), b.ld, 0, b.transposed}, dl{item<float>(d, l), d.ld, 0, false};
    if (p.k >= kSplitK && alpha == 1.0f && (beta == 0.0f || beta == 1.0f))
      f32_matmul_split_k(p.m, p.n, p.k, beta != 0.0f, al, bl, dl);
    else
      f32_matmul(p.m, p.n, p.k, alpha, beta, al, bl, dl);
  }
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
