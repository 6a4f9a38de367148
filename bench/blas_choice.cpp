// OpenBLAS against oneDNN on the GEMMs of a llama-3.1-8b layer, to choose meshfuse's CPU BLAS.
//
// The GEMM is a linear layer's forward, y = x @ W^T: x (M, K) row-major, W (N, K) row-major (the
// BLAS "NT" case), y (M, N) in the inputs' dtype with fp32 accumulation. The variants:
//   openblas:         cblas_sgemm (f32).
//   openblas-widened: x and W widened to f32, sgemm, y rounded to the dtype. Debian's OpenBLAS
//                     0.3.21 has no 16-bit GEMM (it is built without BUILD_BFLOAT16: no sbgemm).
//   onednn:           one matmul primitive of the dtype (f32, bf16; oneDNN 2.6 has no f16 matmul
//                     on CPUs). Created per call, as a library call would; oneDNN's primitive
//                     cache makes that a look-up.
//   onednn-widened:   as openblas-widened, with oneDNN's f32 matmul.
// The variants of one case run interleaved (a b c a b c ...); "vs first" is the first variant's
// median over this one's. OpenBLAS picks its kernels from the CPUID at load time unless
// OPENBLAS_CORETYPE names them, so the core it chose is printed.
//
// Usage: blas_choice [threads=2] [reps=10] [warmup=10] [M=1024]
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dnnl.hpp>
#include <functional>
#include <string>
#include <vector>

#include "meshfuse/core/tensor.h"
#include "meshfuse/testing.h"

extern "C" char* openblas_get_corename(void);

namespace {

using meshfuse::DType;
using meshfuse::Tensor;
using meshfuse::testing::quantile;

struct Case {
  DType dtype;
  std::int64_t m, n, k;
};

// The operands of one case, and f32 copies for the widening variants.
struct Operands {
  Tensor x, w, y;
  std::vector<float> xf, wf, yf;
};

// y = x @ W^T on f32 data.
using F32Gemm = std::function<void(const Case&, const float*, const float*, float*)>;

template <typename Src, typename Dst>
void convert(const Src* src, Dst* dst, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    dst[i] = meshfuse::from_float<Dst>(meshfuse::to_float(src[i]));
}

void widened(const Case& c, Operands& o, const F32Gemm& gemm) {
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    convert(o.x.data_ptr<T>(), o.xf.data(), o.x.numel());
    convert(o.w.data_ptr<T>(), o.wf.data(), o.w.numel());
    gemm(c, o.xf.data(), o.wf.data(), o.yf.data());
    convert(o.yf.data(), o.y.data_ptr<T>(), o.y.numel());
  };
  if (c.dtype == DType::BF16)
    run(meshfuse::bfloat16{});
  else
    run(meshfuse::float16{});
}

void openblas_sgemm(const Case& c, const float* x, const float* w, float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c.m, c.n, c.k, 1.0f, x, c.k, w, c.k, 0.0f, y,
              c.n);
}

class OneDnn {
 public:
  // y = x @ W^T with x, W and y of `dtype`; returns the implementation oneDNN chose.
  std::string gemm(const Case& c, DType dtype, const void* x, const void* w, void* y) {
    using dnnl::memory;
    const auto dt = dtype == DType::BF16 ? memory::data_type::bf16 : memory::data_type::f32;
    const memory::desc a({c.m, c.k}, dt, memory::dims{c.k, 1});
    const memory::desc b({c.k, c.n}, dt, memory::dims{1, c.k});  // W (N, K) read as (K, N)
    const memory::desc d({c.m, c.n}, dt, memory::dims{c.n, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, d), eng_);
    dnnl::matmul(pd).execute(stream_, {{DNNL_ARG_SRC, memory(a, eng_, const_cast<void*>(x))},
                                       {DNNL_ARG_WEIGHTS, memory(b, eng_, const_cast<void*>(w))},
                                       {DNNL_ARG_DST, memory(d, eng_, y)}});
    stream_.wait();
    return pd.impl_info_str();
  }

 private:
  dnnl::engine eng_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{eng_};
};

struct Variant {
  std::string name;
  std::function<void()> run;
  std::vector<double> seconds;
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 10;
  const int warmup = argc > 3 ? std::atoi(argv[3]) : 10;
  const std::int64_t m = argc > 4 ? std::atoll(argv[4]) : 1024;
  openblas_set_num_threads(threads);
  omp_set_num_threads(threads);
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf(
      "threads %d, reps %d, warmup %d; OpenBLAS core %s (OPENBLAS_CORETYPE=%s); oneDNN %d.%d\n",
      threads, reps, warmup, openblas_get_corename(), coretype ? coretype : "unset",
      dnnl_version()->major, dnnl_version()->minor);
  std::printf("%-5s %-18s %-17s %9s %9s %9s %8s %9s\n", "dtype", "M x N x K", "variant",
              "median ms", "p20 ms", "p80 ms", "TFLOP/s", "vs first");

  OneDnn onednn;
  std::string impl;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    for (std::int64_t n : {4096, 14336}) {
      const Case c{dtype, m, n, 4096};
      Operands o{Tensor({c.m, c.k}, dtype),
                 Tensor({c.n, c.k}, dtype),
                 Tensor({c.m, c.n}, dtype),
                 {},
                 {},
                 {}};
      meshfuse::testing::fill_normal(o.x, 1);
      meshfuse::testing::fill_normal(o.w, 2, 0.0, 0.02);
      const void* x = o.x.view().data();
      const void* w = o.w.view().data();
      void* y = o.y.view().data();
      std::vector<Variant> variants;
      if (dtype == DType::F32) {
        variants.push_back({"openblas",
                            [&] {
                              openblas_sgemm(c, o.x.data_ptr<float>(), o.w.data_ptr<float>(),
                                             o.y.data_ptr<float>());
                            },
                            {}});
        variants.push_back({"onednn", [&] { impl = onednn.gemm(c, dtype, x, w, y); }, {}});
      } else {
        o.xf.resize(o.x.numel());
        o.wf.resize(o.w.numel());
        o.yf.resize(o.y.numel());
        variants.push_back({"openblas-widened", [&] { widened(c, o, openblas_sgemm); }, {}});
        if (dtype == DType::BF16)
          variants.push_back({"onednn", [&] { impl = onednn.gemm(c, dtype, x, w, y); }, {}});
        variants.push_back(
            {"onednn-widened",
             [&] {
               widened(c, o, [&](const Case& c32, const float* xf, const float* wf, float* yf) {
                 impl = onednn.gemm(c32, DType::F32, xf, wf, yf);
               });
             },
             {}});
      }
      for (int i = 0; i < warmup + reps; ++i)
        for (Variant& v : variants) {
          const auto t0 = std::chrono::steady_clock::now();
          v.run();
          const std::chrono::duration<double> t = std::chrono::steady_clock::now() - t0;
          if (i >= warmup) v.seconds.push_back(t.count());
        }
      const double flop = 2.0 * static_cast<double>(c.m * c.n * c.k);
      const double first = quantile(variants[0].seconds, 0.5);
      const std::string shape =
          std::to_string(c.m) + " x " + std::to_string(c.n) + " x " + std::to_string(c.k);
      for (const Variant& v : variants) {
        const double med = quantile(v.seconds, 0.5);
        std::printf("%-5s %-18s %-17s %9.1f %9.1f %9.1f %8.3f %8.2fx\n",
                    std::string(meshfuse::to_string(dtype)).c_str(), shape.c_str(), v.name.c_str(),
                    med * 1e3, quantile(v.seconds, 0.2) * 1e3, quantile(v.seconds, 0.8) * 1e3,
                    flop / med / 1e12, first / med);
      }
      std::fflush(stdout);
    }
  }
  std::printf("oneDNN implementation (last call): %s\n", impl.c_str());
  return 0;
}
