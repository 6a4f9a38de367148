// CPU SwiGLU: rows split over OpenMP threads. For 16-bit gates, silu and its derivative come
// from tables of their 65536 values (silu_table: one gather in place of the exp and the division,
// faster in both directions); contiguous rows run AVX-512 loops (gathers), strided ones (the
// interleaved layout) and f32/f64 loops vectorised by the compiler. The AVX-512 loops prefetch
// their inputs 2 KB ahead into L1 (prefetch_ahead), which measured faster than prefetching the
// next row while a row's output is written. Figures: docs/kernels/swiglu.md.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/swiglu/swiglu_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

template <typename T>
T* row(SwigluOperand op, std::int64_t r) {
  return static_cast<T*>(op.data) + r * op.row_stride;
}

// silu(g) = g sigmoid(g) = g / (1 + exp(-g)) (Elfwing et al. 2017) and its derivative
// sigmoid(g) (1 + g (1 - sigmoid(g))).
template <typename A>
A silu(A g) {
  return g / (A(1) + vexp(-g));
}
template <typename A>
A silu_grad(A g) {
  const A sig = A(1) / (A(1) + vexp(-g));
  return sig * (A(1) + g * (A(1) - sig));
}

// f (silu or silu_grad) at every 16-bit g, computed in double and rounded once, built on first
// use (about 1 ms), for the loops to take with one gather per element where the exp and the
// division bound them (every loop over 16-bit T uses it, so strided and contiguous inputs give the
// same bits); null for f32 and f64, computed in the loops.
template <typename T, double (*f)(double)>
const Table16<T>* table_of() {
  if constexpr (kSixteenBit<T>) {
    static const Table16<T> table([](float g) { return static_cast<float>(f(g)); });
    return &table;
  } else {
    return nullptr;
  }
}
template <typename T>
const Table16<T>* silu_table() {
  return table_of<T, silu<double>>();
}
template <typename T>
const Table16<T>* silu_grad_table() {
  return table_of<T, silu_grad<double>>();
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The backward of 16-bit contiguous rows from the two tables: du = dy silu(g), dg = dy u silu'(g).
// Both outputs of a block of columns are computed before either is written (an output may share
// its data with an input), and streamed past the last-level cache.
template <typename T>
void backward_rows_from_tables(const SwigluShape& s, SwigluOperand dy, SwigluOperand gate,
                               SwigluOperand up, SwigluOperand dgate, SwigluOperand dup) {
  constexpr std::int64_t kBlock = kStreamOutBlock;  // one block of stream_out_blocks per call
  const bool stream = stream_worthwhile(5 * s.rows * s.cols * std::int64_t{sizeof(T)}, dgate.data,
                                        s.rows * s.cols * std::int64_t{sizeof(T)});
  const Table16<T>& silu = *silu_table<T>();
  const Table16<T>& silu_grad = *silu_grad_table<T>();
#pragma omp parallel
  {
    alignas(64) float dg_block[kBlock];
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* d = row<T>(dy, r);
      const T* g = row<T>(gate, r);
      const T* u = row<T>(up, r);
      for (std::int64_t c0 = 0; c0 < s.cols; c0 += kBlock) {
        const std::int64_t len = std::min(kBlock, s.cols - c0);
        stream_out_blocks(
            row<T>(dup, r) + c0, len, stream, [&](std::int64_t, std::int64_t n, float* du_block) {
              for (std::int64_t c = 0; c < n; c += 16) {
                const std::int64_t j = c0 + c;
                if (j * std::int64_t{sizeof(T)} % 64 == 0) {
                  prefetch_ahead(d + j);
                  prefetch_ahead(g + j);
                  prefetch_ahead(u + j);
                }
                const __mmask16 k = tail_mask(c, n);
                const __m512 dv = load16(d + j, k);
                _mm512_store_ps(du_block + c, _mm512_mul_ps(dv, silu.lookup16(g + j, k)));
                _mm512_store_ps(dg_block + c, _mm512_mul_ps(_mm512_mul_ps(dv, load16(u + j, k)),
                                                            silu_grad.lookup16(g + j, k)));
              }
            });
        stream_out_blocks(row<T>(dgate, r) + c0, len, stream,
                          [&](std::int64_t, std::int64_t n, float* block) {
                            std::copy(dg_block, dg_block + n, block);
                          });
      }
    }
    stream_fence();
  }
}
#endif

// The output is contiguous: written through stream_out, streamed past the last-level cache.
template <typename T, int kIn>
void forward_rows(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out) {
  using A = acc_t<T>;
  const bool stream = stream_worthwhile(3 * s.rows * s.cols * std::int64_t{sizeof(T)}, out.data,
                                        s.rows * s.cols * std::int64_t{sizeof(T)});
  [[maybe_unused]] const Table16<T>* silu_t = silu_table<T>();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* g = row<T>(gate, r);
      const T* u = row<T>(up, r);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      if constexpr (std::is_same_v<A, float> && kIn == 1) {
        // up * silu(gate) of the 16 elements from column c, in the lanes of k.
        const auto product = [&] {
          if constexpr (std::is_same_v<T, float>) {  // bound by the exp and the division
            return [&](std::int64_t c, __mmask16 k) {
              const __m512 gv = load16(g + c, k);
              const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                             vexp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
              return _mm512_mul_ps(load16(u + c, k), _mm512_div_ps(gv, d));
            };
          } else {
            return [&](std::int64_t c, __mmask16 k) {
              return _mm512_mul_ps(load16(u + c, k), silu_t->lookup16(g + c, k));
            };
          }
        }();
        stream_out_blocks(
            row<T>(out, r), s.cols, stream, [&](std::int64_t c0, std::int64_t len, A* buf) {
              for (std::int64_t c = 0; c < len; c += 16) {
                if (c * std::int64_t{sizeof(T)} % 64 == 0) {
                  prefetch_ahead(g + c0 + c);
                  prefetch_ahead(u + c0 + c);
                }
                const __mmask16 k = tail_mask(c, len);
                _mm512_mask_storeu_ps(buf + c, k, product(c0 + c, k));
              }
            });
        continue;
      }
#endif
      stream_out(row<T>(out, r), s.cols, stream, [&](std::int64_t c) {
        const A uv = to_float(u[c * kIn]);
        if constexpr (kSixteenBit<T>)
          return uv * (*silu_t)[g[c * kIn]];
        else
          return uv * silu(g[c * kIn]);
      });
    }
    stream_fence();
  }
}

template <typename T, int kIn, int kOut>
void backward_rows(const SwigluShape& s, SwigluOperand dy, SwigluOperand gate, SwigluOperand up,
                   SwigluOperand dgate, SwigluOperand dup) {
  using A = acc_t<T>;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (kSixteenBit<T> && kIn == 1 && kOut == 1)
    return backward_rows_from_tables<T>(s, dy, gate, up, dgate, dup);
#endif
  [[maybe_unused]] const Table16<T>* silu_t = silu_table<T>();
  [[maybe_unused]] const Table16<T>* grad_t = silu_grad_table<T>();
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const T* d = row<T>(dy, r);
    const T* g = row<T>(gate, r);
    const T* u = row<T>(up, r);
    T* dg = row<T>(dgate, r);
    T* du = row<T>(dup, r);
#pragma omp simd
    for (std::int64_t c = 0; c < s.cols; ++c) {
      // Every input read before either store: an output may share its data with an input.
      const A dv = to_float(d[c]), uv = to_float(u[c * kIn]);
      const T gv = g[c * kIn];
      if constexpr (kSixteenBit<T>) {
        du[c * kOut] = store_as<T>(dv * (*silu_t)[gv]);
        dg[c * kOut] = store_as<T>(dv * uv * (*grad_t)[gv]);
      } else {
        du[c * kOut] = store_as<T>(dv * silu(gv));
        dg[c * kOut] = store_as<T>(dv * uv * silu_grad(gv));
      }
    }
  }
}

}  // namespace

void swiglu_forward(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out,
                    const Stream&) {
  dispatch_float(s.dtype, "swiglu", [&](auto tag) {
    using T = decltype(tag);
    if (gate.col_stride == 1)
      forward_rows<T, 1>(s, gate, up, out);
    else
      forward_rows<T, 2>(s, gate, up, out);
  });
}

void swiglu_backward(const SwigluShape& s, SwigluOperand grad_out, SwigluOperand gate,
                     SwigluOperand up, SwigluOperand grad_gate, SwigluOperand grad_up,
                     const Stream&) {
  dispatch_float(s.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    if (gate.col_stride == 1)
      backward_rows<T, 1, 1>(s, grad_out, gate, up, grad_gate, grad_up);
    else
      backward_rows<T, 2, 2>(s, grad_out, gate, up, grad_gate, grad_up);
  });
}

}  // namespace meshfuse::detail::cpu
