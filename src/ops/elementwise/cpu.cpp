// CPU elementwise ops: OpenMP threads over the output, every loop left to the compiler's
// vectoriser (no intrinsics): contiguous inputs run one unit-stride loop; strided ones run chunks
// of the output in runs along the merged layout's innermost dimension. The fma is std::fma, never
// a contraction the compiler may or may not make: a vfmadd on targets with FMA, the exact libm fma
// elsewhere, so every target gives the same bits. Compiled once per SIMD target (cpu_simd-inl.h),
// dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/elementwise/cpu.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/common.h"
#include "ops/cpu_simd-inl.h"
#include "ops/elementwise/elementwise_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace {

// Elements per unit of work of the strided loop: big enough to amortise finding a run's start.
constexpr std::int64_t kChunk = 4096;

template <typename T>
const T* typed(const ElementwiseInput& in) {
  return static_cast<const T*>(in.data);
}

#if MESHFUSE_HWY_F16_HARDWARE && HWY_TARGET != HWY_SCALAR
// GCC (12) leaves loops over _Float16 conversions scalar where the CPU lacks AVX512-FP16, at a
// third of the bf16 rate; so contiguous f16 is converted a vector at a time by Highway (F16C's
// vcvtph2ps and vcvtps2ph, round to nearest even: the bits of to_float and to_float16) into fp32
// blocks, computed by a loop the compiler vectorises, and converted back.
constexpr std::int64_t kF16Block = 512;

void widen(const float16* p, std::int64_t n, float* x) {
  const DF d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t j = 0;
  for (; j + lanes <= n; j += lanes) hn::Store(LoadF(d, p + j), d, x + j);
  for (; j < n; ++j) x[j] = to_float(p[j]);
}

void narrow(const float* y, std::int64_t n, float16* p) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t j = 0;
  for (; j + lanes <= n; j += lanes)
    hn::StoreU(hn::DemoteTo(dh, hn::Load(d, y + j)), dh, reinterpret_cast<hwy::float16_t*>(p + j));
  for (; j < n; ++j) p[j] = to_float16(y[j]);
}

template <int K, typename F>
void linear_f16(const float16* const* in, float16* out, std::int64_t n, F f) {
  const std::int64_t blocks = (n + kF16Block - 1) / kF16Block;
  parallel_if(n >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t block = 0; block < blocks; ++block) {
      const std::int64_t i = block * kF16Block, len = std::min(kF16Block, n - i);
      HWY_ALIGN float x[K][kF16Block];
      HWY_ALIGN float y[kF16Block];
      for (int k = 0; k < K; ++k) widen(in[k] + i, len, x[k]);  // all read before out is written
#pragma omp simd
      for (std::int64_t c = 0; c < len; ++c) {
        if constexpr (K == 1)
          y[c] = f(x[0][c]);
        else
          y[c] = f(x[0][c], x[1][c]);
      }
      narrow(y, len, out + i);
    }
  });
}
#endif

// out[i] = f(inputs at i) for every i; K inputs (1 or 2), f on the compute type.
template <typename T, int K, typename F>
void apply(const ElementwiseShape& s, const ElementwiseInput (&in)[K], T* out, F f) {
  bool linear = true;
  for (const ElementwiseInput& x : in) linear = linear && x.linear;
  if (linear) {
    const std::int64_t n = s.numel;
    const T* a = typed<T>(in[0]);
    const T* b = typed<T>(in[K - 1]);
#if MESHFUSE_HWY_F16_HARDWARE && HWY_TARGET != HWY_SCALAR
    if constexpr (std::is_same_v<T, float16>) {
      const float16* p[K];
      for (int k = 0; k < K; ++k) p[k] = typed<T>(in[k]);
      return linear_f16<K>(p, out, n, f);
    }
#endif
    // Element i is read before it is written, so out may be a (or b) itself.
    parallel_if(n >= kParallelMin, [&] {
#pragma omp for simd schedule(static)
      for (std::int64_t i = 0; i < n; ++i) {
        if constexpr (K == 1)
          out[i] = store_as<T>(f(to_float(a[i])));
        else
          out[i] = store_as<T>(f(to_float(a[i]), to_float(b[i])));
      }
    });
    return;
  }
  // Chunks of the row-major order, each walked in runs along the innermost dimension (a run
  // ends with its row or its chunk): each run's start is found from its index (a division per
  // dimension), then it steps by the inputs' innermost strides, unit strides vectorised.
  const int last = s.dims - 1;
  const std::int64_t cols = s.sizes[last];
  const std::int64_t chunks = (s.numel + kChunk - 1) / kChunk;
  std::int64_t step[K];
  bool unit = true;
  for (int k = 0; k < K; ++k) {
    step[k] = in[k].strides[last];
    unit = unit && step[k] == 1;
  }
  parallel_if(s.numel >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
      const std::int64_t end = std::min(s.numel, (chunk + 1) * kChunk);
      for (std::int64_t i = chunk * kChunk; i < end;) {
        const std::int64_t len = std::min(end, (i / cols + 1) * cols) - i;
        const T* p[K];
        for (int k = 0; k < K; ++k) p[k] = typed<T>(in[k]) + element_offset(s, in[k], i);
        T* o = out + i;
        if (unit) {
#pragma omp simd
          for (std::int64_t c = 0; c < len; ++c) {
            if constexpr (K == 1)
              o[c] = store_as<T>(f(to_float(p[0][c])));
            else
              o[c] = store_as<T>(f(to_float(p[0][c]), to_float(p[1][c])));
          }
        } else {
          for (std::int64_t c = 0; c < len; ++c) {
            if constexpr (K == 1)
              o[c] = store_as<T>(f(to_float(p[0][c * step[0]])));
            else
              o[c] = store_as<T>(f(to_float(p[0][c * step[0]]), to_float(p[1][c * step[1]])));
          }
        }
        i += len;
      }
    }
  });
}

}  // namespace

void ElementwiseAdd(const ElementwiseShape& s, ElementwiseInput a, ElementwiseInput b, void* out,
                    double alpha) {
  if (s.numel == 0) return;
  dispatch_float(s.dtype, "add", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A al = static_cast<A>(alpha);
    const ElementwiseInput in[2] = {a, b};
    apply<T, 2>(s, in, static_cast<T*>(out), [al](A x, A y) { return std::fma(al, y, x); });
  });
}

void ElementwiseMul(const ElementwiseShape& s, ElementwiseInput a, void* out, double scalar) {
  if (s.numel == 0) return;
  dispatch_float(s.dtype, "mul", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A sc = static_cast<A>(scalar);
    const ElementwiseInput in[1] = {a};
    apply<T, 1>(s, in, static_cast<T*>(out), [sc](A x) { return x * sc; });
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(ElementwiseAdd);
HWY_EXPORT(ElementwiseMul);

void elementwise_add(const ElementwiseShape& s, ElementwiseInput a, ElementwiseInput b, void* out,
                     double alpha, const Stream&) {
  HWY_DYNAMIC_DISPATCH(ElementwiseAdd)(s, a, b, out, alpha);
}

void elementwise_mul(const ElementwiseShape& s, ElementwiseInput a, void* out, double scalar,
                     const Stream&) {
  HWY_DYNAMIC_DISPATCH(ElementwiseMul)(s, a, out, scalar);
}

}  // namespace meshfuse::detail::cpu
#endif
