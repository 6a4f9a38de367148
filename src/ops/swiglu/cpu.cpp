// CPU SwiGLU: rows split over OpenMP threads. For 16-bit gates, silu and its derivative come
// from tables of their 65536 values (silu_table: one gather in place of the exp and the division,
// faster in both directions); contiguous 16-bit rows and every f32 row run Highway loops (gathers;
// double lanes for f32), strided 16-bit ones (the interleaved layout) and f64 loops vectorised by
// the compiler. The Highway loops prefetch their inputs 2 KB ahead into L1 (PrefetchAhead), which
// measured faster than prefetching the next row while a row's output is written. Compiled once per
// SIMD target (cpu_simd-inl.h), dispatched at run time. Figures: docs/kernels/swiglu.md.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/swiglu/cpu.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/cpu_simd-inl.h"
#include "ops/swiglu/swiglu_kernels.h"

// The tables are built once, outside the per-target code: every target reads the same ones.
#ifndef MESHFUSE_OPS_SWIGLU_TABLES_
#define MESHFUSE_OPS_SWIGLU_TABLES_
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

// A table's entries: silu (the forward's) and the bits of (silu, silu') (the backward's: both
// from one 64-bit gather), computed in double and rounded once.
float silu_entry(float g) { return static_cast<float>(silu<double>(g)); }
std::uint64_t silu_and_grad_entry(float g) {
  return std::bit_cast<std::uint64_t>(
      FloatPair{static_cast<float>(silu<double>(g)), static_cast<float>(silu_grad<double>(g))});
}

// The table of entry(g) at every 16-bit g, built on first use (about 1 ms), for the loops to take
// with one gather per element where the exp and the division bound them (every loop over 16-bit T
// uses them, so strided and contiguous inputs give the same bits); null for f32 and f64, computed
// in the loops.
template <typename T, auto entry>
const Table16<T, std::invoke_result_t<decltype(entry), float>>* table_of() {
  if constexpr (kSixteenBit<T>) {
    static const Table16<T, std::invoke_result_t<decltype(entry), float>> table(entry);
    return &table;
  } else {
    return nullptr;
  }
}
template <typename T>
const Table16<T>* silu_table() {
  return table_of<T, silu_entry>();
}
template <typename T>
const Table16<T, std::uint64_t>* silu_and_grad_table() {
  return table_of<T, silu_and_grad_entry>();
}

}  // namespace
}  // namespace meshfuse::detail::cpu
#endif  // MESHFUSE_OPS_SWIGLU_TABLES_

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace {

#if HWY_TARGET != HWY_SCALAR
// f32 rows compute in double lanes, so that each output is rounded once, as the CUDA kernel's: f32
// lanes round it five times and more (the exp alone up to 2 ulp), which left the output and grad_up
// less accurate than PyTorch's F.silu(g) * u (docs/kernels/swiglu.md).
using DH = hn::Half<DF>;
using DD = hn::Rebind<double, DH>;
using VD = hn::Vec<DD>;

// e^x for x in [-708, 706] to a relative 2^-41, where rounding the f32 outputs once needs about
// 2^-36 (Highway's Exp, to an ulp of double, bound the f32 forward at twice its time without the
// exp: docs/kernels/swiglu.md). x = n ln2 + r by fdlibm's two-part ln2, n found by adding 1.5 * 2^52
// (whose low bits then hold it, as VExp does in f32); e^r by Taylor to degree 10 (|r| <= ln2/2:
// remainder below 2^-41); 2^n into the exponent field. NaN gives NaN.
HWY_INLINE VD ExpNear(DD dd, VD x) {
  const hn::RebindToSigned<DD> di;
  const VD shifter = hn::Set(dd, 0x1.8p52);
  const VD t = hn::MulAdd(x, hn::Set(dd, 1.4426950408889634), shifter);
  const VD n = hn::Sub(t, shifter);
  VD r = hn::NegMulAdd(n, hn::Set(dd, 6.93147180369123816490e-01), x);
  r = hn::NegMulAdd(n, hn::Set(dd, 1.90821492927058770002e-10), r);
  VD p = hn::Set(dd, 1.0 / 3628800);
  for (const double c : {1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24,
                         1.0 / 6, 0.5, 1.0, 1.0})
    p = hn::MulAdd(p, r, hn::Set(dd, c));
  const auto n_bits = hn::Sub(hn::BitCast(di, t), hn::BitCast(di, shifter));
  return hn::Mul(p, hn::BitCast(dd, hn::ShiftLeft<52>(hn::Add(n_bits, hn::Set(di, 1023)))));
}

// sigmoid(g) = 1 / (1 + e^-g). Past -g = 706 it is 0: e^g underflows every output to 0 but for
// g = -inf, where silu(-inf) = -inf * 0 is NaN, as the reference and PyTorch give; below -g = -708
// e^-g is 0 to double precision. Compares keep a NaN g NaN.
HWY_INLINE VD Sigmoid(DD dd, VD g) {
  const VD x = hn::Neg(g), high = hn::Set(dd, 706.0), low = hn::Set(dd, -708.0);
  const VD one = hn::Set(dd, 1.0);
  const auto past = hn::Gt(x, high);
  const VD e = ExpNear(dd, hn::IfThenElse(hn::Lt(x, low), low, hn::IfThenElse(past, high, x)));
  return hn::IfThenZeroElse(past, hn::Div(one, hn::Add(one, e)));
}

// f of the lower and of the upper half of the lanes of a and b (promoted to double); the two
// results rounded to f32 and joined.
template <class F>
HWY_INLINE VF InDouble(DF d, VF a, VF b, F f) {
  const DH dh;
  const DD dd;
  const auto half = [&](auto part) {
    return hn::DemoteTo(dh, f(hn::PromoteTo(dd, part(a)), hn::PromoteTo(dd, part(b))));
  };
  return hn::Combine(d, half([&](VF v) { return hn::UpperHalf(dh, v); }),
                     half([&](VF v) { return hn::LowerHalf(dh, v); }));
}

// k < Lanes(d) (or all) elements of a row with column stride kIn from p as floats, the other lanes
// 0: strided (interleaved) rows through a buffer, so that both layouts give the same bits.
template <int kIn>
HWY_INLINE VF LoadStrided(DF d, const float* p, std::size_t k) {
  if constexpr (kIn == 1) {
    return k >= hn::Lanes(d) ? hn::LoadU(d, p) : LoadFTail(d, p, k);
  } else {
    HWY_ALIGN float buf[kMaxLanes] = {};
    for (std::size_t i = 0; i < std::min(k, hn::Lanes(d)); ++i) buf[i] = p[i * kIn];
    return hn::Load(d, buf);
  }
}

// The f32 backward of rows whose inputs have column stride kIn and outputs kOut: du = dy silu(g),
// dg = dy u silu'(g), in double (above). A vector's inputs are all read before its outputs are
// stored: an output may share its data with an input.
template <int kIn, int kOut>
void backward_rows_f32(const SwigluShape& s, SwigluOperand dy, SwigluOperand gate,
                       SwigluOperand up, SwigluOperand dgate, SwigluOperand dup) {
  parallel_if(s.rows * s.cols >= kParallelMin, [&] {
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const DF d;
      const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
      const float* dyr = row<float>(dy, r);
      const float* g = row<float>(gate, r);
      const float* u = row<float>(up, r);
      float* dg = row<float>(dgate, r);
      float* du = row<float>(dup, r);
      for (std::int64_t c = 0; c < s.cols; c += lanes) {
        const auto k = static_cast<std::size_t>(s.cols - c);
        const VF gv = LoadStrided<kIn>(d, g + c * kIn, k), uv = LoadStrided<kIn>(d, u + c * kIn, k),
                 dv = LoadStrided<1>(d, dyr + c, k);
        // Each half of the lanes in double, one sigmoid for both gradients, stored to a and b.
        HWY_ALIGN float a[kMaxLanes], b[kMaxLanes];
        const DH dh;
        const DD dd;
        const auto half = [&](auto part, std::size_t offset) {
          const VD gd = hn::PromoteTo(dd, part(gv)), ud = hn::PromoteTo(dd, part(uv)),
                   dyd = hn::PromoteTo(dd, part(dv));
          const VD one = hn::Set(dd, 1.0), sig = Sigmoid(dd, gd);
          const VD dgd =
              hn::Mul(hn::Mul(hn::Mul(dyd, ud), sig), hn::MulAdd(gd, hn::Sub(one, sig), one));
          hn::Store(hn::DemoteTo(dh, dgd), dh, a + offset);
          hn::Store(hn::DemoteTo(dh, hn::Mul(hn::Mul(dyd, gd), sig)), dh, b + offset);
        };
        half([&](VF v) { return hn::LowerHalf(dh, v); }, 0);
        half([&](VF v) { return hn::UpperHalf(dh, v); }, hn::Lanes(dh));
        if (kOut == 1 && c + lanes <= s.cols) {
          hn::StoreU(hn::Load(d, a), d, dg + c);
          hn::StoreU(hn::Load(d, b), d, du + c);
          continue;
        }
        for (std::int64_t i = 0; i < std::min<std::int64_t>(lanes, s.cols - c); ++i) {
          dg[(c + i) * kOut] = a[i];
          du[(c + i) * kOut] = b[i];
        }
      }
    }
  });
}

// The backward of 16-bit contiguous rows from the two tables: du = dy silu(g), dg = dy u silu'(g).
// Both outputs of a block of columns are computed before either is written (an output may share
// its data with an input), and streamed past the last-level cache.
template <typename T>
void backward_rows_from_tables(const SwigluShape& s, SwigluOperand dy, SwigluOperand gate,
                               SwigluOperand up, SwigluOperand dgate, SwigluOperand dup) {
  constexpr std::int64_t kBlock = kStreamOutBlock;  // one block of StreamOutBlocks per call
  // An output's bytes from its first row's start to its last row's end (strided when packed).
  const auto extent = [&](const SwigluOperand& o) {
    return ((s.rows - 1) * o.row_stride + s.cols) * std::int64_t{sizeof(T)};
  };
  const OutputWrite w =
      output_write(5 * s.rows * s.cols * std::int64_t{sizeof(T)}, dgate.data, extent(dgate));
  advise_second_output(w, dup.data, extent(dup));
  const bool stream = w.stream;
  const Table16<T, std::uint64_t>& table = *silu_and_grad_table<T>();
  parallel_if(s.rows * s.cols >= kParallelMin, [&] {
    populate_rows(w, dgate.data, s.rows, dgate.row_stride * std::int64_t{sizeof(T)},
                  s.cols * std::int64_t{sizeof(T)});
    populate_rows(w, dup.data, s.rows, dup.row_stride * std::int64_t{sizeof(T)},
                  s.cols * std::int64_t{sizeof(T)});
    HWY_ALIGN float dg_block[kBlock];
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* d = row<T>(dy, r);
      const T* g = row<T>(gate, r);
      const T* u = row<T>(up, r);
      for (std::int64_t c0 = 0; c0 < s.cols; c0 += kBlock) {
        const std::int64_t len = std::min(kBlock, s.cols - c0);
        StreamOutBlocks(row<T>(dup, r) + c0, len, stream,
                        [&](std::int64_t, std::int64_t n, float* du_block) {
                          const DF df;
                          const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
                          for (std::int64_t c = 0; c < n; c += lanes) {
                            const std::int64_t j = c0 + c;
                            if (j * std::int64_t{sizeof(T)} % 64 == 0) {
                              PrefetchAhead(d + j);
                              PrefetchAhead(g + j);
                              PrefetchAhead(u + j);
                            }
                            const bool full = c + lanes <= n;
                            const auto k = static_cast<std::size_t>(n - c);
                            const VF dv = full ? LoadF(df, d + j) : LoadFTail(df, d + j, k);
                            const VF uv = full ? LoadF(df, u + j) : LoadFTail(df, u + j, k);
                            LookupPair(df, table, g + j, k, [&](VF silu, VF silu_grad) {
                              hn::Store(hn::Mul(dv, silu), df, du_block + c);
                              hn::Store(hn::Mul(hn::Mul(dv, uv), silu_grad), df, dg_block + c);
                            });
                          }
                        });
        StreamOutBlocks(row<T>(dgate, r) + c0, len, stream,
                        [&](std::int64_t, std::int64_t n, float* block) {
                          std::copy(dg_block, dg_block + n, block);
                        });
      }
    }
    hwy::FlushStream();
  });
}
#endif

// The output is contiguous: written through StreamOut, streamed past the last-level cache.
template <typename T, int kIn>
void forward_rows(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out) {
  using A = acc_t<T>;
  const OutputWrite w = output_write(3 * s.rows * s.cols * std::int64_t{sizeof(T)}, out.data,
                                     s.rows * s.cols * std::int64_t{sizeof(T)});
  const bool stream = w.stream;
  [[maybe_unused]] const Table16<T>* silu_t = silu_table<T>();
  parallel_if(s.rows * s.cols >= kParallelMin, [&] {
    populate_rows(w, out.data, s.rows, out.row_stride * std::int64_t{sizeof(T)},
                  s.cols * std::int64_t{sizeof(T)});
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* g = row<T>(gate, r);
      const T* u = row<T>(up, r);
#if HWY_TARGET != HWY_SCALAR
      if constexpr (std::is_same_v<T, float> || (std::is_same_v<A, float> && kIn == 1)) {
        const DF d;
        const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
        // up * silu(gate) of the elements from column c (k of them, fewer than a vector at the
        // row's end; the other lanes are not stored in the output).
        const auto product = [&](std::int64_t c, std::size_t k) {
          if constexpr (std::is_same_v<T, float>) {  // in double (above)
            const VF gv = LoadStrided<kIn>(d, g + c * kIn, k);
            const VF uv = LoadStrided<kIn>(d, u + c * kIn, k);
            return InDouble(d, gv, uv, [](VD gd, VD ud) {
              return hn::Mul(hn::Mul(ud, gd), Sigmoid(DD(), gd));
            });
          } else {
            const bool full = k >= static_cast<std::size_t>(lanes);
            const VF uv = full ? LoadF(d, u + c) : LoadFTail(d, u + c, k);
            return hn::Mul(uv, Lookup(d, *silu_t, g + c, k));
          }
        };
        StreamOutBlocks(
            row<T>(out, r), s.cols, stream, [&](std::int64_t c0, std::int64_t len, A* buf) {
              for (std::int64_t c = 0; c < len; c += lanes) {
                if (c * std::int64_t{sizeof(T)} % 64 == 0) {
                  PrefetchAhead(g + c0 + c);
                  PrefetchAhead(u + c0 + c);
                }
                hn::Store(product(c0 + c, static_cast<std::size_t>(len - c)), d, buf + c);
              }
            });
        continue;
      }
#endif
      StreamOut(row<T>(out, r), s.cols, stream, [&](std::int64_t c) {
        const A uv = to_float(u[c * kIn]);
        if constexpr (kSixteenBit<T>)
          return uv * (*silu_t)[g[c * kIn]];
        else  // f32 (HWY_SCALAR) and f64: in double, rounded once
          return static_cast<A>(double(uv) * silu(double(g[c * kIn])));
      });
    }
    hwy::FlushStream();
  });
}

template <typename T, int kIn, int kOut>
void backward_rows(const SwigluShape& s, SwigluOperand dy, SwigluOperand gate, SwigluOperand up,
                   SwigluOperand dgate, SwigluOperand dup) {
  using A = acc_t<T>;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kSixteenBit<T> && kIn == 1 && kOut == 1)
    return backward_rows_from_tables<T>(s, dy, gate, up, dgate, dup);
  if constexpr (std::is_same_v<T, float>)
    return backward_rows_f32<kIn, kOut>(s, dy, gate, up, dgate, dup);
#endif
  [[maybe_unused]] const Table16<T, std::uint64_t>* table = silu_and_grad_table<T>();
  parallel_if(s.rows * s.cols >= kParallelMin, [&] {
#pragma omp for schedule(static)
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
          const auto silu_and_grad = std::bit_cast<FloatPair>((*table)[gv]);
          du[c * kOut] = store_as<T>(dv * silu_and_grad.first);
          dg[c * kOut] = store_as<T>(dv * uv * silu_and_grad.second);
        } else {  // f32 (HWY_SCALAR) and f64: in double, rounded once
          const double gd = gv;
          du[c * kOut] = static_cast<T>(double(dv) * silu(gd));
          dg[c * kOut] = static_cast<T>(double(dv) * double(uv) * silu_grad(gd));
        }
      }
    }
  });
}

}  // namespace

void SwigluForward(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out) {
  dispatch_float(s.dtype, "swiglu", [&](auto tag) {
    using T = decltype(tag);
    if (gate.col_stride == 1)
      forward_rows<T, 1>(s, gate, up, out);
    else
      forward_rows<T, 2>(s, gate, up, out);
  });
}

void SwigluBackward(const SwigluShape& s, SwigluOperand grad_out, SwigluOperand gate,
                    SwigluOperand up, SwigluOperand grad_gate, SwigluOperand grad_up) {
  dispatch_float(s.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    if (gate.col_stride == 1)
      backward_rows<T, 1, 1>(s, grad_out, gate, up, grad_gate, grad_up);
    else
      backward_rows<T, 2, 2>(s, grad_out, gate, up, grad_gate, grad_up);
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(SwigluForward);
HWY_EXPORT(SwigluBackward);

void swiglu_forward(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out,
                    const Stream&) {
  HWY_DYNAMIC_DISPATCH(SwigluForward)(s, gate, up, out);
}

void swiglu_backward(const SwigluShape& s, SwigluOperand grad_out, SwigluOperand gate,
                     SwigluOperand up, SwigluOperand grad_gate, SwigluOperand grad_up,
                     const Stream&) {
  HWY_DYNAMIC_DISPATCH(SwigluBackward)(s, grad_out, gate, up, grad_gate, grad_up);
}

}  // namespace meshfuse::detail::cpu
#endif
