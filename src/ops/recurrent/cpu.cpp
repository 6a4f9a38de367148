// CPU RNN and GRU. The recurrences of the (sequence, head) pairs are independent: OpenMP threads
// take them in static chunks, head-major, so a thread widens each head's weights once (to fp32, 16
// KiB at H = 64, or to double for the f32 rnn's forward; in L1/L2 for the whole sequence) and
// carries the states in fp32 buffers. The forward runs a head's sequences kGroup at a time in
// lockstep, so that a step's products are one matrix product whose weight loads serve several
// rows (add_mat_mat; the rnn's summed in double for f32, see rnn_forward_t); a step reads its
// input rows and writes its output rows from memory.
//
// Backward: a pair walks its sequence in reverse, recomputing the gates from the stored outputs.
// The weight gradient of a pair is a sum of outer products u_t^T da_t over its steps, taken kSteps
// steps at a time (add_outer_products: one load and store of the gradient per kSteps products),
// each such sum in fp32 added to a partial per (block of sequences, head) kept in double for f32
// (fp32 for 16-bit types); the partials are added in a fixed order at the end, so the result does
// not depend on the number of threads. Input gradients of a head serving one input head are stored
// directly; a broadcast input head (serving several heads) takes the sum over its heads, which one
// task walks one after another into an fp32 buffer.
// Compiled once per SIMD target (cpu_simd-inl.h) for the compiler to vectorise the loops for each,
// dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/recurrent/cpu.cpp"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "ops/common.h"
#include "ops/cpu_math.h"
#include "ops/recurrent/recurrent_kernels.h"
#include "ops/recurrent/rows.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {
namespace {

// The register blocks' vector width: AVX-512's, else 32 bytes (two registers where vectors are
// narrower, which measured no slower than one).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif
// Columns of a register block: four vector registers of A.
template <typename A>
constexpr int kBlock = 4 * kVectorBytes / static_cast<int>(sizeof(A));
// Steps whose outer products are added to the weight gradient at once.
constexpr std::int64_t kSteps = 16;
// The most weight-gradient partials per weight (each H x H) of a backward call.
constexpr std::int64_t kMaxPartials = 1024;

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// tanh in float, within 2 ulp. Below |x| = 0.55 an odd polynomial x·P(x²) (least-squares fit of
// tanh(x)/x on [0, 0.55²], relative error 1.5 ulp in float); above, 1 - 2 / (exp(2|x|) + 1),
// whose cancellation costs nothing there (tanh >= 0.5). Both are computed and one is selected, so
// loops vectorise; exp overflowing to inf gives 1, NaN stays NaN.
inline float vtanh(float x) {
  const float ax = std::fabs(x);
  const float u = x * x;
  float p = -0.0062303506f;
  p = p * u + 0.021035718f;
  p = p * u - 0.053841654f;
  p = p * u + 0.13332449f;
  p = p * u - 0.3333331f;
  p = p * u + 1.0f;
  const float big = 1.0f - 2.0f / (vexp(2.0f * ax) + 1.0f);
  return ax < 0.55f ? x * p : std::copysign(big, x);
}
inline double vtanh(double x) { return std::tanh(x); }

template <typename A>
inline A sigmoid(A x) {
  return A(1) / (A(1) + vexp(-x));
}

// exp(x) in double to within 2^-36 relative (x clamped to [-700, 700]: 0 and inf lie far outside
// every float result there), for the gates of the f32 GRU: x = n ln2 + r with |r| <= ln2/2,
// exp(r) by its Taylor series to r^9, times 2^n built in the exponent bits. Branch-free, so
// `#pragma omp simd` loops vectorise (with -fno-trapping-math: CMakeLists.txt); NaN stays NaN.
inline double exp_for_f32(double x) {
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: adding rounds to integer
  x = x < -700.0 ? -700.0 : x;
  x = x > 700.0 ? 700.0 : x;
  const double t = x * 1.4426950408889634 + kRound;
  const double n = t - kRound;
  const double r = x - n * 0.69314718055994531;
  double p = 1.0 / 362880;
  p = p * r + 1.0 / 40320;
  p = p * r + 1.0 / 5040;
  p = p * r + 1.0 / 720;
  p = p * r + 1.0 / 120;
  p = p * r + 1.0 / 24;
  p = p * r + 1.0 / 6;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // n + 1023 in [13, 2033], in t's low bits; shifted into the exponent field it is 2^n.
  const auto bits = std::bit_cast<std::uint64_t>(t) - std::bit_cast<std::uint64_t>(kRound);
  return p * std::bit_cast<double>((bits + 1023) << 52);
}

// The gates (sigmoid, tanh and what is computed from them) of the f32 GRU are kept in double,
// unrounded: the f32 GRU's error was mostly its activations' (its convex update damps the
// rest), where PyTorch's Sleef functions are within 1 ulp and the float formulas above within 2,
// and 1 - z^2 and f (1 - f) of rounded gates lose relative accuracy as the gates saturate
// (docs/kernels/recurrent.md). Other dtypes keep them in A: 16-bit outputs round far above, and
// double gates cost their forwards 10-25%. (The f32 rnn was already more accurate than PyTorch's.)
template <typename T>
using gate_t = std::conditional_t<std::is_same_v<T, float>, double, acc_t<T>>;

// tanh = 1 - 2 / (exp(2|x|) + 1) in double, whose cancellation costs a relative 1e-16 / tanh(|x|),
// under float's rounding above |x| = 1e-6; below, tanh(x) = x to far below it.
template <typename T>
inline gate_t<T> gate_tanh(acc_t<T> x) {
  if constexpr (std::is_same_v<T, float>) {
    const double ax = std::fabs(double(x));
    const double big = 1.0 - 2.0 / (exp_for_f32(2.0 * ax) + 1.0);
    return ax < 1e-6 ? double(x) : std::copysign(big, double(x));
  } else {
    return vtanh(x);
  }
}
template <typename T>
inline gate_t<T> gate_sigmoid(acc_t<T> x) {
  if constexpr (std::is_same_v<T, float>)
    return 1.0 / (1.0 + exp_for_f32(-double(x)));
  else
    return sigmoid(x);
}

// a[r, j0 + c] += (v[r] @ M)[j0 + c] for r < kRows, c < kCols; v and a are rows of h values, M is
// h x h row-major. Each load of a row block of M serves kRows rows (FMA-bound, not load-bound).
// Every column sums M's even and odd rows in two chains (independent FMAs hide the latency), then
// adds them: the same order for every block shape, so a row's result does not depend on the rows
// it is computed with.
template <int kRows, int kCols, typename A>
inline void add_rows_mat_block(const A* v, const A* m, A* a, std::int64_t h, std::int64_t j0) {
  A even[kRows][kCols] = {}, odd[kRows][kCols] = {};
  std::int64_t i = 0;
  for (; i + 2 <= h; i += 2) {
    const A* m0 = m + i * h + j0;
    const A* m1 = m0 + h;
    for (int r = 0; r < kRows; ++r) {
      const A v0 = v[r * h + i], v1 = v[r * h + i + 1];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) {
        even[r][c] += v0 * m0[c];
        odd[r][c] += v1 * m1[c];
      }
    }
  }
  if (i < h)
    for (int r = 0; r < kRows; ++r)
#pragma omp simd
      for (int c = 0; c < kCols; ++c) even[r][c] += v[r * h + i] * m[i * h + j0 + c];
  for (int r = 0; r < kRows; ++r)
#pragma omp simd
    for (int c = 0; c < kCols; ++c) a[r * h + j0 + c] += even[r][c] + odd[r][c];
}

// Columns of a block: four vector registers per row and chain for one row, two for four rows (16
// accumulators either way, leaving registers for the loads).
template <int kRows, typename A>
void add_rows_mat(const A* v, const A* m, A* a, std::int64_t h) {
  constexpr int kCols = kRows == 1 ? kBlock<A> : kBlock<A> / 2;
  std::int64_t j = 0;
  for (; j + kCols <= h; j += kCols) add_rows_mat_block<kRows, kCols>(v, m, a, h, j);
  for (; j + 8 <= h; j += 8) add_rows_mat_block<kRows, 8>(v, m, a, h, j);
  for (; j < h; ++j) add_rows_mat_block<kRows, 1>(v, m, a, h, j);
}

// A += V @ M for `rows` rows of V and A (h values each), four rows at a time.
template <typename A>
void add_mat_mat(const A* v, const A* m, A* a, std::int64_t rows, std::int64_t h) {
  std::int64_t r = 0;
  for (; r + 4 <= rows; r += 4) add_rows_mat<4>(v + r * h, m, a + r * h, h);
  for (; r < rows; ++r) add_rows_mat<1>(v + r * h, m, a + r * h, h);
}

// a += v @ M for one row vector v.
template <typename A>
void add_vec_mat(const A* v, const A* m, A* a, std::int64_t h) {
  add_mat_mat(v, m, a, 1, h);
}

// dw[i0, i0 + kRows) x [j0, j0 + kCols) += sum over k < steps of u_k^T v_k (u, v: steps x h): the
// steps' products summed in A, that sum added to the partial dw in P.
template <int kRows, int kCols, typename A, typename P>
inline void add_outer_block(const A* u, const A* v, std::int64_t steps, P* dw, std::int64_t h,
                            std::int64_t i0, std::int64_t j0) {
  A acc[kRows][kCols] = {};
  for (std::int64_t k = 0; k < steps; ++k) {
    const A* vk = v + k * h + j0;
    for (int r = 0; r < kRows; ++r) {
      const A ur = u[k * h + i0 + r];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) acc[r][c] += ur * vk[c];
    }
  }
  for (int r = 0; r < kRows; ++r)
#pragma omp simd
    for (int c = 0; c < kCols; ++c) dw[(i0 + r) * h + j0 + c] += acc[r][c];
}

template <int kRows, typename A, typename P>
void add_outer_rows(const A* u, const A* v, std::int64_t steps, P* dw, std::int64_t h,
                    std::int64_t i0) {
  std::int64_t j = 0;
  for (; j + kBlock<A> <= h; j += kBlock<A>)
    add_outer_block<kRows, kBlock<A>>(u, v, steps, dw, h, i0, j);
  for (; j + 8 <= h; j += 8) add_outer_block<kRows, 8>(u, v, steps, dw, h, i0, j);
  for (; j < h; ++j) add_outer_block<kRows, 1>(u, v, steps, dw, h, i0, j);
}

// dw += U^T V for the `steps` rows of U and V (steps x h each).
template <typename A, typename P>
void add_outer_products(const A* u, const A* v, std::int64_t steps, P* dw, std::int64_t h) {
  std::int64_t i = 0;
  for (; i + 2 <= h; i += 2) add_outer_rows<2>(u, v, steps, dw, h, i);
  if (i < h) add_outer_rows<1>(u, v, steps, dw, h, i);
}

template <typename A, typename T>
inline void widen(const T* src, A* dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) dst[j] = to_float(src[j]);
}

template <typename T, typename A>
inline void narrow(const A* src, T* dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) dst[j] = store_as<T>(src[j]);
}

// The inputs and weights of a call in RecurrentShape's order (one pair for the RNN, three for the
// GRU: candidate, forget, reset).
template <typename T, int kPairs>
struct Operands {
  const T* input[kPairs];
  const T* weight[kPairs];
};

template <typename T, int kPairs>
Operands<T, kPairs> operands(const void* const* input, const void* const* weight) {
  Operands<T, kPairs> op;
  for (int k = 0; k < kPairs; ++k) {
    op.input[k] = static_cast<const T*>(input[k]);
    op.weight[k] = static_cast<const T*>(weight[k]);
  }
  return op;
}

// Pair k's input row for head n at token `row`.
template <typename T, int kPairs>
const T* input_row(const RecurrentShape& s, const Operands<T, kPairs>& op, int k, std::int64_t row,
                   std::int64_t n) {
  const std::int64_t heads = s.input_heads[k];
  return op.input[k] + (row * heads + source_head(s, heads, n)) * s.head_dim;
}

// A thread's copies of the current head's weights in W (with their transposes for the
// backward, whose products with W^T then run as products with a matrix), widened again only when
// the head changes.
template <typename T, int kPairs, typename W = acc_t<T>>
class HeadWeights {
 public:
  using A = W;
  HeadWeights(std::int64_t h, bool transposed) : h_(h), transposed_(transposed) {
    for (int k = 0; k < kPairs; ++k) {
      w_[k].resize(h * h);
      if (transposed) wt_[k].resize(h * h);
      loaded_[k] = -1;
    }
  }
  void load(const RecurrentShape& s, const Operands<T, kPairs>& op, std::int64_t n) {
    for (int k = 0; k < kPairs; ++k) {
      const std::int64_t head = source_head(s, s.weight_heads[k], n);
      if (head == loaded_[k]) continue;
      loaded_[k] = head;
      widen(op.weight[k] + head * h_ * h_, w_[k].data(), h_ * h_);
      if (!transposed_) continue;
      for (std::int64_t i = 0; i < h_; ++i)
        for (std::int64_t j = 0; j < h_; ++j) wt_[k][j * h_ + i] = w_[k][i * h_ + j];
    }
  }
  const A* w(int k) const { return w_[k].data(); }
  const A* wt(int k) const { return wt_[k].data(); }

 private:
  std::int64_t h_;
  bool transposed_;
  std::vector<A> w_[kPairs], wt_[kPairs];
  std::int64_t loaded_[kPairs];
};

// The state before the first step: input_state's row, or zeros.
template <typename T, typename A>
void initial_state(const RecurrentShape& s, const T* input_state, std::int64_t b, std::int64_t n,
                   A* state) {
  if (input_state != nullptr)
    widen(input_state + (b * s.heads + n) * s.head_dim, state, s.head_dim);
  else
    std::fill(state, state + s.head_dim, A(0));
}

// --- forward -----------------------------------------------------------------------------------

// Sequences a forward task runs together: their step products share each load of the head's
// weights (add_mat_mat).
constexpr std::int64_t kGroup = 8;

// Runs every (sequence, head) recurrence, a head's sequences kGroup at a time, in lockstep.
// step(weights, rows, count, n, state, work) advances the fp32 states of the first `count`
// sequences of the group (count rows of h values) by their steps at token rows rows[0, count);
// work: kWork blocks of kGroup rows of h values of M, the type the step's products are summed in
// (its weights' type).
template <typename T, typename M, int kPairs, int kWork, typename Step>
void forward_pairs(const RecurrentShape& s, const Operands<T, kPairs>& op, const T* input_state,
                   T* output, T* final_state, Step&& step) {
  using A = acc_t<T>;
  const std::int64_t h = s.head_dim, groups = ceil_div(s.batch, kGroup);
  // One task (a head of a small batch, as in decoding) runs on the calling thread: the other
  // threads would only make their buffers.
  parallel_if(s.heads * groups > 1, [&] {
    HeadWeights<T, kPairs, M> weights(h, false);
    std::vector<A> state(kGroup * h);
    std::vector<M> work(kWork * kGroup * h);
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < s.heads * groups; ++task) {
      const std::int64_t n = task / groups, b0 = task % groups * kGroup;
      const std::int64_t count = std::min(kGroup, s.batch - b0);
      weights.load(s, op, n);
      // Longest first: the sequences still running at a step are then a prefix of the group.
      std::int64_t order[kGroup], rows[kGroup];
      SequenceRows seq[kGroup];
      std::iota(order, order + count, b0);
      std::stable_sort(order, order + count, [&](std::int64_t x, std::int64_t y) {
        return sequence_rows(s, x).length > sequence_rows(s, y).length;
      });
      for (std::int64_t i = 0; i < count; ++i) {
        seq[i] = sequence_rows(s, order[i]);
        initial_state(s, input_state, order[i], n, state.data() + i * h);
      }
      std::int64_t running = count;
      for (std::int64_t t = 0;; ++t) {
        while (running > 0 && seq[running - 1].length <= t) --running;
        if (running == 0) break;
        for (std::int64_t i = 0; i < running; ++i) rows[i] = seq[i].first + t;
        // The next step's input rows (N x H elements apart: beyond the hardware prefetcher) load
        // while this step computes.
        for (std::int64_t i = 0; i < running; ++i)
          if (t + 1 < seq[i].length)
            for (int k = 0; k < kPairs; ++k) {
              const char* next = reinterpret_cast<const char*>(input_row(s, op, k, rows[i] + 1, n));
              for (std::int64_t b = 0; b < h * std::int64_t{sizeof(T)}; b += 64)
                __builtin_prefetch(next + b);
            }
        step(weights, rows, running, n, state.data(), work.data());
        for (std::int64_t i = 0; i < running; ++i)
          narrow(state.data() + i * h, output + (rows[i] * s.heads + n) * h, h);
      }
      if (final_state != nullptr)
        for (std::int64_t i = 0; i < count; ++i)
          narrow(state.data() + i * h, final_state + (order[i] * s.heads + n) * h, h);
    }
  });
}

// h = tanh(h @ W + x). The pre-activation h @ W + x is summed in once_t (double for f32: exact
// products, one rounding), so that a step adds little error to the state but tanh's; the fp32
// sums left the f32 final state less accurate than PyTorch's. The states and tanh stay fp32 (all
// in double needs a scalar tanh, far slower). Figures: docs/kernels/recurrent.md.
template <typename T>
void rnn_forward_t(const RecurrentShape& s, const Operands<T, 1>& op, const T* input_state,
                   T* output, T* final_state) {
  using A = acc_t<T>;
  using M = once_t<T>;
  const std::int64_t h = s.head_dim, block = kGroup * h;
  const auto step = [&](const HeadWeights<T, 1, M>& w, const std::int64_t* rows, std::int64_t count,
                        std::int64_t n, A* state, M* work) {
    M *a = work, *v = work + block;
    for (std::int64_t i = 0; i < count; ++i) widen(input_row(s, op, 0, rows[i], n), a + i * h, h);
    widen(state, v, count * h);
    add_mat_mat(v, w.w(0), a, count, h);
#pragma omp simd
    for (std::int64_t j = 0; j < count * h; ++j) state[j] = vtanh(A(a[j]));
  };
  forward_pairs<T, M, 1, 2>(s, op, input_state, output, final_state, step);
}

// f = sigmoid(h @ W_f + x_f), r = sigmoid(h @ W_r + x_r), z = tanh((h * r) @ W + x),
// h = f * h + (1 - f) * z. The products stay in fp32: the GRU's error is its activations' (its
// convex update damps the rest), and double pre-activations did not lower it; the gates and the
// update are in gate_t (docs/kernels/recurrent.md).
template <typename T>
void gru_forward_t(const RecurrentShape& s, const Operands<T, 3>& op, const T* input_state,
                   T* output, T* final_state) {
  using A = acc_t<T>;
  using G = gate_t<T>;
  const std::int64_t h = s.head_dim, block = kGroup * h;
  const auto step = [&](const HeadWeights<T, 3>& w, const std::int64_t* rows, std::int64_t count,
                        std::int64_t n, A* state, A* work) {
    A *f = work, *r = work + block, *q = work + 2 * block, *z = work + 3 * block;
    for (std::int64_t i = 0; i < count; ++i) {
      widen(input_row(s, op, 1, rows[i], n), f + i * h, h);
      widen(input_row(s, op, 2, rows[i], n), r + i * h, h);
      widen(input_row(s, op, 0, rows[i], n), z + i * h, h);
    }
    add_mat_mat(state, w.w(1), f, count, h);
    add_mat_mat(state, w.w(2), r, count, h);
#pragma omp simd
    for (std::int64_t j = 0; j < count * h; ++j)
      q[j] = state[j] * static_cast<A>(gate_sigmoid<T>(r[j]));
    add_mat_mat(q, w.w(0), z, count, h);
#pragma omp simd
    for (std::int64_t j = 0; j < count * h; ++j) {
      const G fj = gate_sigmoid<T>(f[j]);
      state[j] = static_cast<A>(fj * state[j] + (G(1) - fj) * gate_tanh<T>(z[j]));
    }
  };
  forward_pairs<T, A, 3, 4>(s, op, input_state, output, final_state, step);
}

// --- backward ----------------------------------------------------------------------------------

// Pointers of a backward call.
template <typename T, int kPairs>
struct BackwardArgs {
  const T* grad_output;       // nullable
  const T* grad_final_state;  // nullable
  const T* output;
  const T* input_state;  // nullable
  T* grad_input[kPairs];
  T* grad_weight[kPairs];
  T* grad_input_state;  // nullable
  double clip;
};

// One backward step's buffers: the state before the step (prev), after it (y, as stored), the
// clamped gradient of y (g), and what the step writes: per pair k the gradient of its
// pre-activation da[k] (= the input's gradient) and the row u[k] whose outer product with da[k]
// adds to the weight's gradient; carry (the gradient of prev); work: scratch rows.
template <typename A, int kPairs>
struct StepBuffers {
  const A* prev;
  const A* y;
  const A* g;
  A* da[kPairs];
  A* u[kPairs];
  A* carry;
  A* work;
};

// Runs every (sequence, head) recurrence backwards (see the top of the file). Tasks are
// (group of heads, block of sequences); a group holds the heads sharing a broadcast input head.
template <typename T, int kPairs, int kWork, typename Step>
void backward_pairs(const RecurrentShape& s, const Operands<T, kPairs>& op,
                    const BackwardArgs<T, kPairs>& args, Step&& step) {
  using A = acc_t<T>;
  // The weight-gradient partials' type: double for f32, so that the error does not grow with the
  // sequence's length (fp32 partials were less accurate than PyTorch's per-step sums; products
  // in double too cost twice the extra time for little more); fp32 for 16-bit types.
  using P = once_t<T>;
  const std::int64_t h = s.head_dim, heads = s.heads, hh = h * h;
  std::int64_t divisor = 0;
  for (int k = 0; k < kPairs; ++k) divisor = std::gcd(divisor, s.input_heads[k]);
  const std::int64_t group = divisor > 0 ? heads / divisor : 1;
  const A clip = static_cast<A>(args.clip);
  // Weight-gradient partials per (block of sequences, head), each zeroed by the task that fills
  // it. The blocks hold one sequence up to kMaxPartials partials, so that the memory stays bounded
  // (kMaxPartials x H² per weight) and the sums' order depends on B and N only.
  const std::int64_t block = std::max<std::int64_t>(1, ceil_div(s.batch * heads, kMaxPartials));
  const std::int64_t blocks = ceil_div(s.batch, block);
  std::vector<std::unique_ptr<P[]>> partial(kPairs);
  for (auto& p : partial) p.reset(new P[static_cast<std::size_t>(blocks * heads * hh)]);

  parallel_if(heads / group * blocks > 1, [&] {  // one task: the calling thread (as forward_pairs)
    HeadWeights<T, kPairs> weights(h, true);
    std::vector<A> prev(h), y(h), g(h), carry(h), work(kWork * h);
    std::vector<A> u[kPairs], v[kPairs], sums[kPairs];
    std::vector<P> total(h);
    for (int k = 0; k < kPairs; ++k) u[k].resize(kSteps * h), v[k].resize(kSteps * h);
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < heads / group * blocks; ++task) {
      const std::int64_t n0 = task / blocks * group, sb = task % blocks;
      for (int k = 0; k < kPairs; ++k)
        std::fill_n(partial[k].get() + (sb * heads + n0) * hh, group * hh, P(0));
      for (std::int64_t b = sb * block; b < std::min(s.batch, (sb + 1) * block); ++b) {
        const SequenceRows seq = sequence_rows(s, b);
        for (int k = 0; k < kPairs; ++k)
          if (s.input_heads[k] < heads)
            sums[k].assign(seq.length * (group * s.input_heads[k] / heads) * h, A(0));
        for (std::int64_t n = n0; n < n0 + group; ++n) {
          weights.load(s, op, n);
          P* dw[kPairs];
          for (int k = 0; k < kPairs; ++k) dw[k] = partial[k].get() + (sb * heads + n) * hh;
          if (args.grad_final_state != nullptr)
            widen(args.grad_final_state + (b * heads + n) * h, carry.data(), h);
          else
            std::fill(carry.begin(), carry.end(), A(0));
          std::int64_t pending = 0;  // steps whose outer products wait in u and v
          for (std::int64_t t = seq.length - 1; t >= 0; --t) {
            const std::int64_t row = seq.first + t;
            widen(args.output + (row * heads + n) * h, y.data(), h);
            if (t > 0)
              widen(args.output + ((row - 1) * heads + n) * h, prev.data(), h);
            else
              initial_state(s, args.input_state, b, n, prev.data());
            if (args.grad_output != nullptr)
              widen(args.grad_output + (row * heads + n) * h, g.data(), h);
            else
              std::fill(g.begin(), g.end(), A(0));
#pragma omp simd
            for (std::int64_t j = 0; j < h; ++j) {
              const A gj = g[j] + carry[j];
              g[j] = gj < -clip ? -clip : (gj > clip ? clip : gj);
            }
            StepBuffers<A, kPairs> buf{prev.data(), y.data(),     g.data(),   {},
                                       {},          carry.data(), work.data()};
            for (int k = 0; k < kPairs; ++k) {
              buf.da[k] = v[k].data() + pending * h;
              buf.u[k] = u[k].data() + pending * h;
            }
            step(weights, row, n, buf);
            for (int k = 0; k < kPairs; ++k) {
              const std::int64_t nx = s.input_heads[k];
              if (nx == heads) {
                narrow(buf.da[k], args.grad_input[k] + (row * heads + n) * h, h);
              } else {
                const std::int64_t local = source_head(s, nx, n) - source_head(s, nx, n0);
                A* sum = sums[k].data() + (t * (group * nx / heads) + local) * h;
#pragma omp simd
                for (std::int64_t j = 0; j < h; ++j) sum[j] += buf.da[k][j];
              }
            }
            if (++pending == kSteps || t == 0) {
              for (int k = 0; k < kPairs; ++k)
                add_outer_products(u[k].data(), v[k].data(), pending, dw[k], h);
              pending = 0;
            }
          }
          if (args.grad_input_state != nullptr)
            narrow(carry.data(), args.grad_input_state + (b * heads + n) * h, h);
        }
        for (int k = 0; k < kPairs; ++k) {
          const std::int64_t nx = s.input_heads[k];
          if (nx == heads) continue;
          const std::int64_t count = group * nx / heads, first = source_head(s, nx, n0);
          for (std::int64_t t = 0; t < seq.length; ++t)
            narrow(sums[k].data() + t * count * h,
                   args.grad_input[k] + ((seq.first + t) * nx + first) * h, count * h);
        }
      }
    }

    // grad_weight[k][w] = sum over the blocks of sequences, then over the heads n that w serves,
    // of the partials: one weight row per iteration.
    for (int k = 0; k < kPairs; ++k) {
      const std::int64_t nw = s.weight_heads[k], served = heads / nw;
#pragma omp for schedule(static)
      for (std::int64_t wr = 0; wr < nw * h; ++wr) {
        const std::int64_t w = wr / h, i = wr % h;
        P* acc = total.data();
        std::fill(acc, acc + h, P(0));
        for (std::int64_t sb = 0; sb < blocks; ++sb)
          for (std::int64_t n = w * served; n < (w + 1) * served; ++n) {
            const P* p = partial[k].get() + (sb * heads + n) * hh + i * h;
#pragma omp simd
            for (std::int64_t j = 0; j < h; ++j) acc[j] += p[j];
          }
        narrow(acc, args.grad_weight[k] + wr * h, h);
      }
    }
  });
}

// da = g (1 - y^2), dW += prev^T da, carry = da @ W^T
template <typename T>
void rnn_backward_t(const RecurrentShape& s, const Operands<T, 1>& op,
                    const BackwardArgs<T, 1>& args) {
  using A = acc_t<T>;
  const std::int64_t h = s.head_dim;
  const auto step = [&](const HeadWeights<T, 1>& w, std::int64_t, std::int64_t,
                        const StepBuffers<A, 1>& b) {
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) {
      b.da[0][j] = b.g[j] * (A(1) - b.y[j] * b.y[j]);
      b.u[0][j] = b.prev[j];
      b.carry[j] = A(0);
    }
    add_vec_mat(b.da[0], w.wt(0), b.carry, h);
  };
  backward_pairs<T, 1, 0>(s, op, args, step);
}

// With f, r, q = prev * r and z recomputed from prev:
//   da_z = g (1 - f)(1 - z^2),        dW   += q^T da_z,    dq = da_z @ W^T
//   da_f = g (prev - z) f (1 - f),     dW_f += prev^T da_f
//   da_r = dq prev r (1 - r),          dW_r += prev^T da_r
//   carry = g f + dq r + da_f @ W_f^T + da_r @ W_r^T
template <typename T>
void gru_backward_t(const RecurrentShape& s, const Operands<T, 3>& op,
                    const BackwardArgs<T, 3>& args) {
  using A = acc_t<T>;
  using G = gate_t<T>;
  const std::int64_t h = s.head_dim;
  const auto step = [&](const HeadWeights<T, 3>& w, std::int64_t row, std::int64_t n,
                        const StepBuffers<A, 3>& b) {
    A *f = b.work, *r = b.work + h, *z = b.work + 2 * h, *dq = b.work + 3 * h;
    A* q = b.u[0];
    widen(input_row(s, op, 1, row, n), f, h);
    widen(input_row(s, op, 2, row, n), r, h);
    widen(input_row(s, op, 0, row, n), z, h);
    add_vec_mat(b.prev, w.w(1), f, h);
    add_vec_mat(b.prev, w.w(2), r, h);
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) q[j] = b.prev[j] * static_cast<A>(gate_sigmoid<T>(r[j]));
    add_vec_mat(q, w.w(0), z, h);
    // The factors in gate_t from the gates (recomputed: f and r hold pre-activations), each
    // rounded once.
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) {
      const G fj = gate_sigmoid<T>(f[j]), zj = gate_tanh<T>(z[j]), g = b.g[j];
      b.da[0][j] = static_cast<A>(g * (G(1) - fj) * (G(1) - zj * zj));
      b.da[1][j] = static_cast<A>(g * (b.prev[j] - zj) * fj * (G(1) - fj));
      dq[j] = A(0);
    }
    add_vec_mat(b.da[0], w.wt(0), dq, h);
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) {
      const G fj = gate_sigmoid<T>(f[j]), rj = gate_sigmoid<T>(r[j]), dqj = dq[j];
      b.da[2][j] = static_cast<A>(dqj * b.prev[j] * rj * (G(1) - rj));
      b.carry[j] = static_cast<A>(b.g[j] * fj + dqj * rj);
      b.u[1][j] = b.u[2][j] = b.prev[j];
    }
    add_vec_mat(b.da[1], w.wt(1), b.carry, h);
    add_vec_mat(b.da[2], w.wt(2), b.carry, h);
  };
  backward_pairs<T, 3, 4>(s, op, args, step);
}

}  // namespace

void rnn_forward(const RecurrentShape& s, const void* input, const void* weight,
                 const void* input_state, void* output, void* final_state) {
  dispatch_float(s.dtype, "rnn", [&](auto tag) {
    using T = decltype(tag);
    rnn_forward_t<T>(s, operands<T, 1>(&input, &weight), static_cast<const T*>(input_state),
                     static_cast<T*>(output), static_cast<T*>(final_state));
  });
}

void rnn_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const void* weight, const void* input_state, void* grad_input,
                  void* grad_weight, void* grad_input_state, double gradient_clipping) {
  dispatch_float(s.dtype, "rnn_backward", [&](auto tag) {
    using T = decltype(tag);
    const void* no_input = nullptr;  // the RNN's backward needs only the outputs
    const BackwardArgs<T, 1> args{
        static_cast<const T*>(grad_output), static_cast<const T*>(grad_final_state),
        static_cast<const T*>(output),      static_cast<const T*>(input_state),
        {static_cast<T*>(grad_input)},      {static_cast<T*>(grad_weight)},
        static_cast<T*>(grad_input_state),  gradient_clipping};
    rnn_backward_t<T>(s, operands<T, 1>(&no_input, &weight), args);
  });
}

void gru_forward(const RecurrentShape& s, const GruPointers& p, const void* input_state,
                 void* output, void* final_state) {
  dispatch_float(s.dtype, "gru", [&](auto tag) {
    using T = decltype(tag);
    gru_forward_t<T>(s, operands<T, 3>(p.input, p.weight), static_cast<const T*>(input_state),
                     static_cast<T*>(output), static_cast<T*>(final_state));
  });
}

void gru_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const GruPointers& p, const void* input_state,
                  const GruGradPointers& grads, void* grad_input_state, double gradient_clipping) {
  dispatch_float(s.dtype, "gru_backward", [&](auto tag) {
    using T = decltype(tag);
    BackwardArgs<T, 3> args{static_cast<const T*>(grad_output),
                            static_cast<const T*>(grad_final_state),
                            static_cast<const T*>(output),
                            static_cast<const T*>(input_state),
                            {},
                            {},
                            static_cast<T*>(grad_input_state),
                            gradient_clipping};
    for (int k = 0; k < 3; ++k) {
      args.grad_input[k] = static_cast<T*>(grads.input[k]);
      args.grad_weight[k] = static_cast<T*>(grads.weight[k]);
    }
    gru_backward_t<T>(s, operands<T, 3>(p.input, p.weight), args);
  });
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace meshfuse::detail::cpu {

HWY_EXPORT(rnn_forward);
HWY_EXPORT(rnn_backward);
HWY_EXPORT(gru_forward);
HWY_EXPORT(gru_backward);

void rnn_forward(const RecurrentShape& s, const void* input, const void* weight,
                 const void* input_state, void* output, void* final_state, const Stream&) {
  HWY_DYNAMIC_DISPATCH(rnn_forward)(s, input, weight, input_state, output, final_state);
}

void rnn_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const void* weight, const void* input_state, void* grad_input,
                  void* grad_weight, void* grad_input_state, double gradient_clipping,
                  const Stream&) {
  HWY_DYNAMIC_DISPATCH(rnn_backward)
  (s, grad_output, grad_final_state, output, weight, input_state, grad_input, grad_weight,
   grad_input_state, gradient_clipping);
}

void gru_forward(const RecurrentShape& s, const GruPointers& p, const void* input_state,
                 void* output, void* final_state, const Stream&) {
  HWY_DYNAMIC_DISPATCH(gru_forward)(s, p, input_state, output, final_state);
}

void gru_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const GruPointers& p, const void* input_state,
                  const GruGradPointers& grads, void* grad_input_state, double gradient_clipping,
                  const Stream&) {
  HWY_DYNAMIC_DISPATCH(gru_backward)
  (s, grad_output, grad_final_state, output, p, input_state, grads, grad_input_state,
   gradient_clipping);
}

}  // namespace meshfuse::detail::cpu
#endif
