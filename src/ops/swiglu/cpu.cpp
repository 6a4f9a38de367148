// CPU SwiGLU: rows split over OpenMP threads; the inner loop is unit-stride (or stride 2 for the
// interleaved layout) and vectorised by the compiler. The AVX-512 forward takes silu of a 16-bit
// gate from a table (silu_table: bf16, llama-3.1-8b shapes, alternating CLI runs: 70-72% of copy
// bandwidth against 61-62% with the exp and division) and prefetches its inputs 2 KB ahead into
// L1 (prefetch_ahead: 60-61% against 55-56%; 4 KB ahead the same, into L2 58-60%); prefetching
// the next row's gate and up instead, while a row's output is written (as the multi-pass kernels
// do), measured slower: 48% against 58%.
#include <cmath>
#include <cstdint>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/swiglu/swiglu_kernels.h"

namespace meshfuse::detail::cpu {
namespace {

template <typename T>
T* row(SwigluOperand op, std::int64_t r) {
  return static_cast<T*>(op.data) + r * op.row_stride;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// silu(g) = g / (1 + exp(-g)) (Elfwing et al. 2017) at every 16-bit g, built on first use: the
// forward becomes a gather and a multiply per element, where the exp and the division bound it.
template <typename T>
const Table16<T>& silu_table() {
  static const Table16<T> table([](__m512 g) {
    return _mm512_div_ps(
        g, _mm512_add_ps(_mm512_set1_ps(1.0f), vexp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  });
  return table;
}
#endif

// The output is contiguous: written through stream_out, streamed past the last-level cache.
template <typename T, int kIn>
void forward_rows(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out) {
  using A = acc_t<T>;
  const bool stream = stream_worthwhile(3 * s.rows * s.cols * std::int64_t{sizeof(T)}, out.data,
                                        s.rows * s.cols * std::int64_t{sizeof(T)});
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
              return _mm512_div_ps(_mm512_mul_ps(load16(u + c, k), gv), d);
            };
          } else {
            return [&, &silu = silu_table<T>()](std::int64_t c, __mmask16 k) {
              return _mm512_mul_ps(load16(u + c, k), silu.lookup16(g + c, k));
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
        const A gv = to_float(g[c * kIn]);
        return A(to_float(u[c * kIn])) * gv / (A(1) + vexp(-gv));
      });
    }
    stream_fence();
  }
}

template <typename T, int kIn, int kOut>
void backward_rows(const SwigluShape& s, SwigluOperand dy, SwigluOperand gate, SwigluOperand up,
                   SwigluOperand dgate, SwigluOperand dup) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const T* d = row<T>(dy, r);
    const T* g = row<T>(gate, r);
    const T* u = row<T>(up, r);
    T* dg = row<T>(dgate, r);
    T* du = row<T>(dup, r);
#pragma omp simd
    for (std::int64_t c = 0; c < s.cols; ++c) {
      const A dv = to_float(d[c]);
      const A gv = to_float(g[c * kIn]);
      const A sig = A(1) / (A(1) + vexp(-gv));
      du[c * kOut] = store_as<T>(dv * gv * sig);
      dg[c * kOut] = store_as<T>(dv * A(to_float(u[c * kIn])) * sig * (A(1) + gv * (A(1) - sig)));
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
