// CPU cross-entropy: rows split over OpenMP threads, each row in Highway vectors. The forward
// reads each row twice (max, then exp-sum, the next row's max fused into this row's exp-sum: see
// cpu_logsumexp-inl.h), the backward reads it and writes the gradient in one pass. f32 rows keep
// the lse in double from the forward's sum to the backward's exps (backward_rows). Compiled once
// per SIMD target (cpu_simd-inl.h), dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cross_entropy/cpu.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "ops/common.h"
#include "ops/cpu_logsumexp-inl.h"
#include "ops/cpu_math.h"
#include "ops/cpu_simd-inl.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/softmax/softmax_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace {

template <typename T, typename L>
void forward_rows(const CrossEntropyRows& b, const T* logits, const L* labels, lse_t<T>* lse,
                  double* row_loss, const CrossEntropyOptions& o) {
  using A = acc_t<T>;
  const A m = static_cast<A>(o.logits_multiplier);
  const double eps = o.label_smoothing, z = o.z_loss_scale;
  const auto classes = static_cast<double>(vocab_classes(o, b.vocab));
  parallel_if(b.rows * b.vocab >= kParallelMin, [&] {
    const auto row = [&](std::int64_t i) { return logits + row_offset(i, b.vocab); };
    const auto [begin, end] = thread_rows(b.rows);
    RowMax<A> st = begin < end ? row_max(row(begin), b.vocab, m) : RowMax<A>{};
    for (std::int64_t i = begin; i < end; ++i) {
      const RowMax<A> cur = st;
      const std::int64_t g = b.row_begin + i, y = labels[g];
      const T* next = row(i + 1 < end ? i + 1 : i);  // the last row reads itself (unused)
      if (y == o.ignore_index) {
        if (i + 1 < end) st = row_max(next, b.vocab, m);
        if (lse) lse[g] = 0;
        row_loss[g] = 0;
        continue;
      }
      const A shift = exp_shift(cur.max);
      // sum_v (the smoothing term's sum of logits) only when label smoothing needs it.
      const auto sum_exp = [&](auto sum_v) {
        return row_sum_exp_next_max<false, decltype(sum_v)::value>(row(i), next, b.vocab, m, shift,
                                                                   static_cast<A*>(nullptr));
      };
      const auto [sum, next_st] = eps != 0 ? sum_exp(std::true_type{}) : sum_exp(std::false_type{});
      st = next_st;
      // f32 and f64 rows: in double from a double sum (exp_sum_t), for the backward's lse_t.
      const lse_t<T> l = lse_t<T>(shift) + std::log(sum);
      // The label's logit, 0 when it is in another shard.
      const std::int64_t col = y - o.vocab_start;
      const A v_label = col >= 0 && col < b.vocab ? A(to_float(row(i)[col])) * m : A(0);
      const double nll = double(l) - double(v_label);
      double loss = (1 - eps) * nll;
      if (eps != 0) loss += eps * (double(l) - double(cur.sum_v) / classes);
      if (z != 0) loss += z * double(l) * double(l);
      if (lse) lse[g] = l;
      row_loss[g] = loss;
    }
  });
}

template <typename T, typename L>
void backward_rows(const CrossEntropyRows& b, const T* logits, const L* labels, const lse_t<T>* lse,
                   CrossEntropyUpstream up, T* grad_logits, const CrossEntropyOptions& o) {
  using A = acc_t<T>;
  const A m = static_cast<A>(o.logits_multiplier);
  const A eps = static_cast<A>(o.label_smoothing), z = static_cast<A>(o.z_loss_scale);
  const auto classes = static_cast<double>(vocab_classes(o, b.vocab));
  const A smooth = eps / static_cast<A>(classes);
  // The gradient is as large as the logits: streamed past the last-level cache.
  const std::int64_t row_bytes = b.vocab * std::int64_t{sizeof(T)};
  const OutputWrite w = output_write(2 * b.rows * row_bytes, grad_logits, b.rows * row_bytes);
  const bool stream = w.stream;
  parallel_if(b.rows * b.vocab >= kParallelMin, [&] {
    populate_rows(w, grad_logits, b.rows, row_bytes, row_bytes);
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < b.rows; ++i) {
      const std::int64_t g = b.row_begin + i;
      const std::int64_t y = labels[g];
      const T* x = logits + row_offset(i, b.vocab);
      T* dx = grad_logits + row_offset(i, b.vocab);
      if (y == o.ignore_index) {
#pragma omp simd
        for (std::int64_t j = 0; j < b.vocab; ++j) dx[j] = store_as<T>(A(0));
        continue;
      }
      const lse_t<T> l = lse[g];
      const double row_grad = up.scale * (up.row_grad ? up.row_grad[g] : 1.0);
      // The label's column; outside [0, vocab) it is in another shard: no one-hot term here.
      const std::int64_t col = y - o.vocab_start;
      const bool here = col >= 0 && col < b.vocab;
      // dx_j = c (p_j p_scale - smooth - [j = label] (1 - eps)) with p_j = e^(m x_j - l), computed
      // from e_j = e^(m x_j - shift) as c (e_j pf - off). The label's gradient is computed before
      // the loop: grad_logits may alias logits.
      A shift, c = 1, pf, off, label_grad = 0;
      if constexpr (kSixteenBit<T>) {
        // In float: errors far below their gradient's rounding.
        shift = l;
        c = static_cast<A>(row_grad) * m;
        pf = z != 0 ? A(1) + 2 * z * l : A(1);
        off = smooth;
        if (here) label_grad = c * (vexp(A(to_float(x[col])) * m - l) * pf - smooth - (A(1) - eps));
      } else {
        // f32 rows shift by the double lse rounded to f32 and fold e^(shift - l), the rounding's
        // factor, into pf, so that p_j carries no rounding of the lse (in f32, up to 2^-21 of an
        // lse of 10 to 20, relative to every p_j); equal values (f64 rows, infinities) need no
        // fold. Each factor is computed in double and rounded once. The upstream folds into pf
        // and off too (c = 1, exact) unless it is infinite or NaN: then c carries it, as folded
        // it would turn the signed difference of two terms into inf - inf.
        shift = static_cast<A>(l);
        const double cd = row_grad * o.logits_multiplier;
        const bool folded = std::isfinite(cd);
        const double cf = folded ? cd : 1.0;
        c = folded ? A(1) : static_cast<A>(cd);
        const double p_scale = o.z_loss_scale != 0 ? 1 + 2 * o.z_loss_scale * l : 1.0;
        const double fold = double(shift) != l ? std::exp(double(shift) - l) : 1.0;
        const double smooth_d = o.label_smoothing / classes;
        pf = static_cast<A>(cf * p_scale * fold);
        off = static_cast<A>(cf * smooth_d);
        if (here) {
          const double p = std::exp(double(to_float(x[col])) * double(m) - l);
          label_grad = static_cast<A>(cd * (p * p_scale - smooth_d - (1 - o.label_smoothing)));
        }
      }
#if HWY_TARGET != HWY_SCALAR
      if constexpr (std::is_same_v<A, float>) {  // bound by the exp: VExp (cpu_simd-inl.h)
        StreamOutBlocks(dx, b.vocab, stream, [&](std::int64_t j0, std::int64_t len, A* buf) {
          const DF d;
          const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
          const VF vm = hn::Set(d, m), vshift = hn::Set(d, shift);
          const VF vc = hn::Set(d, c), vpf = hn::Set(d, pf), voff = hn::Set(d, off);
          for (std::int64_t j = 0; j < len; j += lanes) {
            const T* xj = x + j0 + j;
            const VF v = j + lanes <= len ? LoadF(d, xj) : LoadFTail(d, xj, len - j);
            const VF e = VExp(d, hn::MulSub(v, vm, vshift));
            const VF g = hn::MulSub(e, vpf, voff);
            hn::Store(hn::Mul(vc, g), d, buf + j);  // buf: whole vectors
          }
        });
      } else
#endif
        StreamOut(dx, b.vocab, stream, [&](std::int64_t j) {
          return c * (vexp(A(to_float(x[j])) * m - shift) * pf - off);
        });
      if (here) dx[col] = store_as<T>(label_grad);
    }
    hwy::FlushStream();
  });
}

// Calls f(T*, L*) with the block's logits and labels typed.
template <typename F>
void dispatch_rows(const CrossEntropyRows& b, std::string_view op, F&& f) {
  dispatch_float(b.dtype, op, [&](auto tag) {
    dispatch_index(b.label_dtype, op, [&](auto ltag) { f(tag, ltag); });
  });
}

}  // namespace

void CrossEntropyForwardRows(const CrossEntropyRows& b, const void* logits, const void* labels,
                             void* lse, double* row_loss, const CrossEntropyOptions& o) {
  dispatch_rows(b, "cross_entropy", [&](auto tag, auto ltag) {
    using T = decltype(tag);
    using L = decltype(ltag);
    forward_rows(b, static_cast<const T*>(logits), static_cast<const L*>(labels),
                 static_cast<lse_t<T>*>(lse), row_loss, o);
  });
}

void CrossEntropyBackwardRows(const CrossEntropyRows& b, const void* logits, const void* labels,
                              const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                              const CrossEntropyOptions& o) {
  dispatch_rows(b, "cross_entropy_backward", [&](auto tag, auto ltag) {
    using T = decltype(tag);
    using L = decltype(ltag);
    backward_rows(b, static_cast<const T*>(logits), static_cast<const L*>(labels),
                  static_cast<const lse_t<T>*>(lse), upstream, static_cast<T*>(grad_logits), o);
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(CrossEntropyForwardRows);
HWY_EXPORT(CrossEntropyBackwardRows);

void cross_entropy_forward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                void* lse, double* row_loss, const CrossEntropyOptions& o) {
  HWY_DYNAMIC_DISPATCH(CrossEntropyForwardRows)(b, logits, labels, lse, row_loss, o);
}

void cross_entropy_backward_rows(const CrossEntropyRows& b, const void* logits, const void* labels,
                                 const void* lse, CrossEntropyUpstream upstream, void* grad_logits,
                                 const CrossEntropyOptions& o) {
  HWY_DYNAMIC_DISPATCH(CrossEntropyBackwardRows)(b, logits, labels, lse, upstream, grad_logits, o);
}

void cross_entropy_forward(const CrossEntropyShape& s, const void* logits, const void* labels,
                           void* loss, void* lse, const CrossEntropyOptions& o, const Stream&) {
  const std::int64_t count = check_labels("cross_entropy", s, labels, o);
  std::vector<double> row_loss(static_cast<std::size_t>(s.rows));
  cross_entropy_forward_rows({s.dtype, s.label_dtype, 0, s.rows, s.vocab}, logits, labels, lse,
                             row_loss.data(), o);
  store_loss(s, row_loss, count, o.reduction, loss);
}

void cross_entropy_backward(const CrossEntropyShape& s, const void* grad_loss, const void* logits,
                            const void* labels, const void* lse, void* grad_logits,
                            const CrossEntropyOptions& o, const Stream&) {
  const std::int64_t count = check_labels("cross_entropy_backward", s, labels, o);
  std::vector<double> row_grad;
  const CrossEntropyUpstream up = read_upstream(s, grad_loss, count, o.reduction, row_grad);
  cross_entropy_backward_rows({s.dtype, s.label_dtype, 0, s.rows, s.vocab}, logits, labels, lse, up,
                              grad_logits, o);
}

}  // namespace meshfuse::detail::cpu
#endif
