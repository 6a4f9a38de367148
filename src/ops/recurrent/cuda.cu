// CUDA RNN / GRU: one block per (head, group of kSeqs sequences), for the whole recurrence.
//
// Why this shape: a step is a (kSeqs x H) @ (H x H) product per head, far too small to fill the
// GPU, and there are thousands of them in a chain. A block keeps its head's weights in shared
// memory for every step (loaded once, reused by its kSeqs sequences), and the state of its
// sequences in shared memory (fp32; f64 for f64) between steps, so a step moves only the token
// rows it reads and writes. The sequences of a block step together; a finished (or empty)
// sequence holds its state. B=16, N=64 gives 128 blocks, about one per SM of an H200.
//
// A product: thread (column pair cp, lane ks) sums its k-slice (k = ks, ks + lanes, ...) for the
// two columns 2cp, 2cp+1 and all kSeqs sequences (one 2-element weight load and kSeqs state loads
// feed 2 kSeqs FMAs), then the `lanes` threads of a pair (adjacent lanes of a warp) add their
// partial sums with a reduce-scatter of xor shuffles (reduce_scatter: V - 1 shuffles for V values,
// not V log2(lanes)); each lane finalises the contiguous values it ends up with. The backward's
// products with W^T read the same weight rows transposed: thread cp owns the rows cp and
// cp + pairs. The weight gradient sum_t u_t^T da_t is accumulated in the same loop (the da rows
// are already loaded): each entry belongs to one thread and grows step by step in a fixed order,
// in shared memory (per-block global memory for the matrices that do not fit: two of the GRU's
// three at H = 128), and the per-block partials are added per weight head in a fixed order
// afterwards: bitwise reproducible, no atomics.
//
// Shared-memory rows are padded (weights: `wstride` elements, a row of word pairs that puts the
// lanes of a warp on distinct banks; gradients: `dwstride`); padding holds zeros. What does not
// fit in shared memory (large H; f32 / f64 GRU weights) lives in global memory with the same
// layout and goes through the cache: slower, the same numbers. H = 64 and H = 128 are compiled
// with constant sizes; other H use the same code with runtime sizes.
//
// The step's critical path is: product -> shuffles -> activation -> shared store -> barrier. Token
// rows come from global memory off that path: predicated loads (load_if, no branch, so nothing
// waits at the load) kept as raw bits until used; with constant sizes they are issued a whole step
// ahead. (Loads in branches whose value was converted inside the branch made every step wait for
// memory once per owned value.)
//
// Broadcast inputs (fewer heads than N) get their gradient per head in an fp32 scratch tensor that
// a second kernel adds up per source head.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/cuda/cuda_utils.cuh"
#include "meshfuse/core/tensor.h"
#include "ops/common.h"
#include "ops/recurrent/recurrent_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

constexpr int kSeqs = 8;  // sequences per block
constexpr int kThreads = 256;

// Lanes that share a column pair: a power of two <= 32, as many as the block has for all pairs.
__host__ __device__ constexpr int lanes_per_pair(int pairs) {
  int lanes = 32;
  while (lanes > 1 && pairs * lanes > kThreads) lanes /= 2;
  return lanes;
}

enum class Op { RnnForward, RnnBackward, GruForward, GruBackward };
constexpr bool is_backward(Op op) { return op == Op::RnnBackward || op == Op::GruBackward; }
constexpr int weight_count(Op op) { return op == Op::RnnForward || op == Op::RnnBackward ? 1 : 3; }
// State arrays of HP x kSeqs values a block keeps (see the kernels).
constexpr int state_buffers(Op op) {
  switch (op) {
    case Op::RnnForward:
      return 2;
    case Op::RnnBackward:
      return 3;
    case Op::GruForward:
      return 4;
    case Op::GruBackward:
      return 9;
  }
  return 0;
}

// Everything a kernel needs; A is the state type (float, double for f64).
template <typename T>
struct Args {
  using A = acc_t<T>;
  std::int64_t batch, seq_len, heads;
  const std::int64_t* cu_seqlens;
  std::int64_t input_heads[3], weight_heads[3];
  int h, pairs, lanes, wstride, dwstride, groups;
  // Placement: shared memory (at the byte offsets) or global memory.
  bool states_shared, weights_shared;
  int dw_shared;  // weight gradients 0 .. dw_shared - 1 grow in shared memory, the others in
                  // dw_partial
  int weights_offset, dw_offset;
  A* states_global;  // blocks x buffers x HP x kSeqs, when !states_shared
  // Weights: the caller's (heads, H, H) when weights_shared, else padded (heads, HP, wstride).
  const T* input[3];
  const T* weight[3];
  const T* input_state;
  T* output;       // forward
  T* final_state;  // forward
  const T* y;      // backward: the forward's output
  const T* grad_output;
  const T* grad_final_state;
  T* grad_input[3];          // written directly when the input has all heads, else
  A* grad_input_scratch[3];  // per head, added up later
  A* dw_partial;             // blocks x weights x HP x HP
  T* grad_input_state;
  A clip;
};

template <typename T>
struct alignas(2 * sizeof(T)) Pair {
  T a, b;
};

// One row of a state array: a value per sequence of the block.
template <typename A>
using Row = Vec<A, kSeqs>;

template <typename A>
__device__ __forceinline__ const Row<A>& row_at(const A* p, int k) {
  return *reinterpret_cast<const Row<A>*>(p + k * kSeqs);
}

template <typename A>
__device__ __forceinline__ A sigmoid(A x) {
  return A(1) / (A(1) + exp(-x));
}

// The f32 GRU's gates (sigmoid, tanh and what is computed from them) in double, unrounded, as on
// the cpu (gate_t there, docs/kernels/recurrent.md): float's expf and tanhf are within 2 ulp, and
// 1 - z^2 and f (1 - f) of rounded gates lose relative accuracy as the gates saturate. The
// kernels keep the gates' pre-activations in shared memory and evaluate the gates where they are
// used; the update h = f h + (1 - f) z is in double too. The backward recomputes its gates from
// the forward's outputs, so its rows need the forward's accuracy: with double gates in the
// backward alone, grad_forget_weight stayed at 1.28x PyTorch's error. Cost on the H200: forward
// 22-33%, backward 9-13% (docs/kernels/recurrent.md). Other dtypes keep acc_t.
template <typename T>
using gate_t = std::conditional_t<std::is_same_v<T, float>, double, acc_t<T>>;
template <typename T>
__device__ __forceinline__ gate_t<T> gate_sigmoid(acc_t<T> x) {
  return sigmoid(static_cast<gate_t<T>>(x));
}
template <typename T>
__device__ __forceinline__ gate_t<T> gate_tanh(acc_t<T> x) {
  return tanh(static_cast<gate_t<T>>(x));
}

// The state-gradient clamp; NaN stays NaN (as in the reference).
template <typename A>
__device__ __forceinline__ A clamp_grad(A x, A clip) {
  return x < -clip ? -clip : (x > clip ? clip : x);
}

// Sizes: constants for kH = 64 / 128, from the arguments otherwise.
template <int kH>
struct Dims {
  int h_, pairs_, lanes_;
  __device__ int h() const { return kH ? kH : h_; }
  __device__ int pairs() const { return kH ? (kH + 1) / 2 : pairs_; }
  __device__ int lanes() const { return kH ? lanes_per_pair((kH + 1) / 2) : lanes_; }
  __device__ int hp() const { return 2 * pairs(); }
};

// The sequences of this block: first row and length; returns the longest length.
struct Seqs {
  std::int64_t first[kSeqs], len[kSeqs], batch_index[kSeqs];
};

template <typename T>
__device__ std::int64_t load_sequences(const Args<T>& a, int group, Seqs& s) {
  if (threadIdx.x < kSeqs) {
    const std::int64_t b = static_cast<std::int64_t>(group) * kSeqs + threadIdx.x;
    std::int64_t first = 0, len = 0;
    if (b < a.batch) {
      if (a.cu_seqlens != nullptr) {
        first = a.cu_seqlens[b];
        len = a.cu_seqlens[b + 1] - first;
      } else {
        first = b * a.seq_len;
        len = a.seq_len;
      }
    }
    s.first[threadIdx.x] = first;
    s.len[threadIdx.x] = len;
    s.batch_index[threadIdx.x] = b;
  }
  __syncthreads();
  std::int64_t steps = 0;
  for (int g = 0; g < kSeqs; ++g) steps = s.len[g] > steps ? s.len[g] : steps;
  return steps;
}

// dst (HP x wstride, zero padded) = src (h x h); all threads of the block (or a grid-stride loop).
template <typename T>
__device__ void pad_weight(T* dst, const T* src, int h, int hp, int wstride, std::int64_t start,
                           std::int64_t step) {
  const T zero = store<T>(acc_t<T>(0));
  for (std::int64_t i = start; i < static_cast<std::int64_t>(hp) * wstride; i += step) {
    const int k = static_cast<int>(i / wstride), j = static_cast<int>(i % wstride);
    dst[i] = k < h && j < h ? src[static_cast<std::int64_t>(k) * h + j] : zero;
  }
}

template <typename T>
__global__ void pad_weights_kernel(const T* src, T* dst, int h, int hp, int wstride) {
  const std::int64_t head = blockIdx.y;
  pad_weight(dst + head * hp * wstride, src + head * h * h, h, hp, wstride,
             blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x,
             static_cast<std::int64_t>(gridDim.x) * blockDim.x);
}

// The block's view of its workspace.
template <typename T, int M>
struct Workspace {
  using A = acc_t<T>;
  const T* w[M];  // HP x wstride each
  A* dw[M];       // HP x dwstride[m] each (backward)
  int dwstride[M];
  A* states;  // buffers x HP x kSeqs
};

// Places the weights of head n (staged into shared memory when they fit), the weight-gradient
// accumulators and the state arrays; zeroes the state arrays and shared accumulators.
template <typename T, int M>
__device__ Workspace<T, M> make_workspace(const Args<T>& a, unsigned char* smem, int n, int buffers,
                                          bool backward) {
  using A = acc_t<T>;
  Workspace<T, M> ws;
  const int hp = 2 * a.pairs;
  const std::int64_t blk = blockIdx.x;
  for (int m = 0; m < M; ++m) {
    const std::int64_t wn = n / (a.heads / a.weight_heads[m]);
    if (a.weights_shared) {
      T* dst = reinterpret_cast<T*>(smem + a.weights_offset) + m * hp * a.wstride;
      pad_weight(dst, a.weight[m] + wn * a.h * a.h, a.h, hp, a.wstride, threadIdx.x, kThreads);
      ws.w[m] = dst;
    } else {
      ws.w[m] = a.weight[m] + wn * hp * a.wstride;
    }
    if (backward) {
      if (m < a.dw_shared) {
        ws.dw[m] = reinterpret_cast<A*>(smem + a.dw_offset) + m * hp * a.dwstride;
        ws.dwstride[m] = a.dwstride;
        for (int i = threadIdx.x; i < hp * a.dwstride; i += kThreads) ws.dw[m][i] = A(0);
      } else {
        ws.dw[m] = a.dw_partial + (blk * M + m) * hp * hp;  // zeroed by the host
        ws.dwstride[m] = hp;
      }
    }
  }
  const int state_size = buffers * hp * kSeqs;
  ws.states = a.states_shared ? reinterpret_cast<A*>(smem) : a.states_global + blk * state_size;
  for (int i = threadIdx.x; i < state_size; i += kThreads) ws.states[i] = A(0);
  return ws;
}

// Products hand each lane of a column pair V = M x kSeqs x 2 partial sums, value v = (m kSeqs + g)
// 2 + e (matrix m, sequence g, column e of the pair); reduce_scatter adds them up over the lanes.

// acc[v] = sum over this lane's k (ks, ks + lanes, ... < h) of v_k[g] * W_m[k][2 cp + e].
template <int M, typename T, typename A>
__device__ __forceinline__ void vec_mat(const T* const (&w)[M], int wstride, const A* v, int h,
                                        int cp, int ks, int lanes, A (&acc)[M * kSeqs * 2]) {
#pragma unroll
  for (int i = 0; i < M * kSeqs * 2; ++i) acc[i] = A(0);
#pragma unroll(M == 1 ? 4 : 2)  // more rows in flight where registers allow
  for (int k = ks; k < h; k += lanes) {
    const Row<A> x = row_at(v, k);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const Pair<T> p = *reinterpret_cast<const Pair<T>*>(w[m] + k * wstride + 2 * cp);
      const A w0 = load(p.a), w1 = load(p.b);
#pragma unroll
      for (int g = 0; g < kSeqs; ++g) {
        acc[(m * kSeqs + g) * 2] += x.v[g] * w0;
        acc[(m * kSeqs + g) * 2 + 1] += x.v[g] * w1;
      }
    }
  }
}

// acc[2 g + e] = sum over m and this lane's column pairs jp (ks, ks + lanes, ...) of
// d_m[j][g] * W_m[r_e][j] for j = 2 jp, 2 jp + 1 and rows r_0 = cp, r_1 = cp + pairs (d @ W^T).
// Also dw_m[r_e][j] += sum_g u[r_e][g] * d_m[j][g] (the weight gradient u^T d).
template <int M, typename T, typename A>
__device__ __forceinline__ void vec_mat_t(const T* const (&w)[M], int wstride,
                                          const A* const (&d)[M], A* const (&dw)[M],
                                          const int (&dwstride)[M], const A* u, int pairs, int cp,
                                          int ks, int lanes, A (&acc)[kSeqs * 2]) {
#pragma unroll
  for (int i = 0; i < kSeqs * 2; ++i) acc[i] = A(0);
  const int r0 = cp, r1 = cp + pairs;
  const Row<A> u0 = row_at(u, r0), u1 = row_at(u, r1);
#pragma unroll 2
  for (int jp = ks; jp < pairs; jp += lanes) {
    const int j = 2 * jp;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const Row<A> d0 = row_at(d[m], j), d1 = row_at(d[m], j + 1);
      const Pair<T> p0 = *reinterpret_cast<const Pair<T>*>(w[m] + r0 * wstride + j);
      const Pair<T> p1 = *reinterpret_cast<const Pair<T>*>(w[m] + r1 * wstride + j);
      const A w00 = load(p0.a), w01 = load(p0.b), w10 = load(p1.a), w11 = load(p1.b);
      A s00 = 0, s01 = 0, s10 = 0, s11 = 0;
#pragma unroll
      for (int g = 0; g < kSeqs; ++g) {
        acc[2 * g] += d0.v[g] * w00 + d1.v[g] * w01;
        acc[2 * g + 1] += d0.v[g] * w10 + d1.v[g] * w11;
        s00 += u0.v[g] * d0.v[g];
        s01 += u0.v[g] * d1.v[g];
        s10 += u1.v[g] * d0.v[g];
        s11 += u1.v[g] * d1.v[g];
      }
      Pair<A>* q0 = reinterpret_cast<Pair<A>*>(dw[m] + r0 * dwstride[m] + j);
      Pair<A>* q1 = reinterpret_cast<Pair<A>*>(dw[m] + r1 * dwstride[m] + j);
      Pair<A> a0 = *q0, a1 = *q1;
      a0.a += s00;
      a0.b += s01;
      a1.a += s10;
      a1.b += s11;
      *q0 = a0;
      *q1 = a1;
    }
  }
}

// One level per value count (compile-time sizes: the values stay in registers).
template <int Live, int V, typename A>
__device__ __forceinline__ void scatter_levels(A (&acc)[V], int& o, int ks) {
  if constexpr (Live > 1) {
    if (o > 0) {
      const bool upper = (ks & o) != 0;
#pragma unroll
      for (int i = 0; i < Live / 2; ++i) {
        const A send = upper ? acc[i] : acc[i + Live / 2];
        const A keep = upper ? acc[i + Live / 2] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      o /= 2;
      scatter_levels<Live / 2>(acc, o, ks);
    }
  }
}
// Adds up the V partial sums of the `lanes` adjacent lanes of a column pair, halving the values a
// lane keeps at each shuffle level (V - 1 shuffles instead of V log2(lanes)): the lane sends one
// half to its partner and adds the partner's copy of the other half. Afterwards acc[0, count) hold
// the sums of values base, base + 1, ... (see Owned). All lanes take part.
template <int V, typename A>
__device__ __forceinline__ void reduce_scatter(A (&acc)[V], int lanes, int ks) {
  int o = lanes / 2;
  scatter_levels<V>(acc, o, ks);
  for (; o > 0; o /= 2) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);  // lanes > V
}

// The values a lane holds after reduce_scatter: base .. base + count - 1; `rep` adjacent lanes hold
// the same ones, and the first of them (owner) writes them.
struct Owned {
  int base, count;
  bool owner;
};
template <int V>
__device__ __forceinline__ Owned owned_values(int lanes, int ks) {
  const int split = lanes < V ? lanes : V, rep = lanes / split, count = V / split;
  return {ks / rep * count, count, ks % rep == 0};
}
// The most values a lane holds: a constant with constant sizes.
template <int kH, int V>
constexpr int max_owned() {
  if constexpr (kH == 0) {
    return V;
  } else {
    constexpr int lanes = lanes_per_pair((kH + 1) / 2);
    return lanes < V ? V / lanes : 1;
  }
}

// Calls f(i, m, g, e) for the values v = base + i this lane holds (i a constant after unrolling).
template <int kOwn, typename F>
__device__ __forceinline__ void for_owned(const Owned& own, F&& f) {
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int v = own.base + i;
    if (i < own.count) f(i, v / (2 * kSeqs), (v / 2) % kSeqs, v & 1);
  }
}

// *p, or zero where !pred, as raw bits: a predicated load with no branch, so that the value can be
// left in flight until it is used (a load in a branch whose value is converted inside the branch
// waits for memory there).
template <typename T>
__device__ __forceinline__ T load_if(const T* p, bool pred) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8);
  T v;
  if constexpr (sizeof(T) == 2) {
    unsigned short b;
    asm("{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n mov.b16 %0, 0;\n @q ld.global.b16 %0, [%1];\n}"
        : "=h"(b)
        : "l"(p), "r"(static_cast<int>(pred)));
    memcpy(&v, &b, sizeof(v));
  } else if constexpr (sizeof(T) == 4) {
    unsigned b;
    asm("{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n mov.b32 %0, 0;\n @q ld.global.b32 %0, [%1];\n}"
        : "=r"(b)
        : "l"(p), "r"(static_cast<int>(pred)));
    memcpy(&v, &b, sizeof(v));
  } else {
    unsigned long long b;
    asm("{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n mov.b64 %0, 0;\n @q ld.global.b64 %0, [%1];\n}"
        : "=l"(b)
        : "l"(p), "r"(static_cast<int>(pred)));
    memcpy(&v, &b, sizeof(v));
  }
  return v;
}

// With constant sizes a thread has one column pair (one pass of for_pairs), so it can load the
// token rows of step t + 1 during step t: their memory latency leaves the step's critical path.
template <int kH>
constexpr bool fetch_ahead() {
  static_assert(kH == 0 || (kH + 1) / 2 * lanes_per_pair((kH + 1) / 2) == kThreads,
                "constant sizes take one pass of for_pairs");
  return kH != 0;
}

// Runs body(cp, valid) over the column pairs in passes of kThreads / lanes pairs; every thread
// takes part in every pass (the shuffles need whole warps).
template <int kH, typename F>
__device__ __forceinline__ void for_pairs(const Dims<kH>& d, F&& body) {
  const int per_pass = kThreads / d.lanes();
  for (int base = 0; base < d.pairs(); base += per_pass) {
    const int cp = base + static_cast<int>(threadIdx.x) / d.lanes();
    // constant sizes: one pass covers the pairs exactly (a constant, so products fully unroll)
    const bool valid = fetch_ahead<kH>() || cp < d.pairs();
    body(valid ? cp : d.pairs() - 1, valid);
  }
}

// Offsets of token rows and states: element (row, head, j) of a tensor of `heads` heads.
__device__ __forceinline__ std::int64_t at(std::int64_t row, std::int64_t heads, std::int64_t head,
                                           int h, int j) {
  return (row * heads + head) * h + j;
}

template <typename T>
__device__ __forceinline__ acc_t<T> load_or_zero(const T* p, std::int64_t i) {
  return p != nullptr ? load(p[i]) : acc_t<T>(0);
}

// Stores the gradient of input m at (row, head n, j): directly, or per head into the scratch.
template <typename T>
__device__ __forceinline__ void store_grad_input(const Args<T>& a, int m, std::int64_t row,
                                                 std::int64_t n, int j, acc_t<T> v) {
  if (a.grad_input_scratch[m] != nullptr)
    a.grad_input_scratch[m][at(row, a.heads, n, a.h, j)] = v;
  else
    a.grad_input[m][at(row, a.heads, n, a.h, j)] = store<T>(v);
}

// The head of input m that head n reads.
template <typename T>
__device__ __forceinline__ std::int64_t input_head(const Args<T>& a, int m, std::int64_t n) {
  return n / (a.heads / a.input_heads[m]);
}

// Element (row, head xh, j) of input m as raw bits (load_if), zero where !on; xh from input_head.
template <typename T>
__device__ __forceinline__ T fetch_input(const Args<T>& a, int m, std::int64_t row, std::int64_t xh,
                                         int j, bool on) {
  return load_if(a.input[m] + at(row, a.input_heads[m], xh, a.h, j), on);
}

// p[i] as raw bits, zero where !on or p is null (an optional tensor).
template <typename T>
__device__ __forceinline__ T fetch_or_zero(const T* p, std::int64_t i, bool on) {
  return load_if(p != nullptr ? p + i : p, on && p != nullptr);
}

template <typename T, int N>
__device__ __forceinline__ void copy(T (&dst)[N], const T (&src)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = src[i];
}

// ------------------------------------------------------------------------------------------------
// RNN forward. States: h[2] (double buffer).
template <typename T, int kH>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Seqs seq;
  const Dims<kH> d{a.h, a.pairs, a.lanes};
  const int h = d.h(), hp = d.hp(), lanes = d.lanes(), ks = threadIdx.x & (lanes - 1);
  const int n = blockIdx.x / a.groups, group = blockIdx.x % a.groups;
  const Workspace<T, 1> ws = make_workspace<T, 1>(a, smem, n, 2, false);
  const std::int64_t xh = input_head(a, 0, n);
  const std::int64_t steps = load_sequences(a, group, seq);  // syncs: workspace ready
  // h[t & 1] holds the state before step t (offsets, not a pointer array: no local memory)
  A* const hbuf = ws.states;
  const int size = hp * kSeqs;
  for (int i = threadIdx.x; i < size; i += kThreads) {
    const int j = i / kSeqs, g = i % kSeqs;
    if (j < h && seq.batch_index[g] < a.batch)
      hbuf[i] = load_or_zero(a.input_state, at(seq.batch_index[g], a.heads, n, h, j));
  }
  __syncthreads();

  constexpr int V = 2 * kSeqs, kOwn = max_owned<kH, V>();
  const Owned own = owned_values<V>(lanes, ks);
  // x_t of the values this lane holds
  auto fetch = [&](std::int64_t t, int cp, bool valid, T(&x)[kOwn]) {
    for_owned<kOwn>(own, [&](int i, int, int g, int e) {
      const int j = 2 * cp + e;
      x[i] =
          fetch_input(a, 0, seq.first[g] + t, xh, j, own.owner && valid && j < h && t < seq.len[g]);
    });
  };
  T ahead[kOwn] = {};
  if constexpr (fetch_ahead<kH>()) fetch(0, threadIdx.x / lanes, true, ahead);

  for (std::int64_t t = 0; t < steps; ++t) {
    const A* cur = hbuf + (t & 1) * size;
    A* next = hbuf + ((t + 1) & 1) * size;
    for_pairs(d, [&](int cp, bool valid) {
      T x[kOwn] = {};
      if constexpr (fetch_ahead<kH>()) {
        copy(x, ahead);
        fetch(t + 1, cp, valid, ahead);
      } else {
        fetch(t, cp, valid, x);
      }
      A acc[V];
      vec_mat<1>(ws.w, a.wstride, cur, valid ? h : 0, cp, ks, lanes, acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn>(own, [&](int i, int, int g, int e) {
        const int j = 2 * cp + e;
        if (!own.owner || !valid || j >= h) return;
        A v = cur[j * kSeqs + g];
        if (t < seq.len[g]) {
          v = tanh(acc[i] + load(x[i]));
          a.output[at(seq.first[g] + t, a.heads, n, h, j)] = store<T>(v);
        }
        next[j * kSeqs + g] = v;
      });
    });
    __syncthreads();
  }

  if (a.final_state == nullptr) return;
  const A* last = hbuf + (steps & 1) * size;
  for (int i = threadIdx.x; i < kSeqs * h; i += kThreads) {
    const int g = i / h, j = i % h;
    if (seq.batch_index[g] < a.batch)
      a.final_state[at(seq.batch_index[g], a.heads, n, h, j)] = store<T>(last[j * kSeqs + g]);
  }
}

// ------------------------------------------------------------------------------------------------
// GRU forward. States: h[2], q = h * r, f.
template <typename T, int kH>
__global__ void __launch_bounds__(kThreads, 1) gru_forward_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Seqs seq;
  const Dims<kH> d{a.h, a.pairs, a.lanes};
  const int h = d.h(), hp = d.hp(), lanes = d.lanes(), ks = threadIdx.x & (lanes - 1);
  const int n = blockIdx.x / a.groups, group = blockIdx.x % a.groups;
  const Workspace<T, 3> ws = make_workspace<T, 3>(a, smem, n, 4, false);
  const std::int64_t xh[3] = {input_head(a, 0, n), input_head(a, 1, n), input_head(a, 2, n)};
  const std::int64_t steps = load_sequences(a, group, seq);
  const int size = hp * kSeqs;
  A* const hbuf = ws.states;  // two buffers, as in rnn_forward_kernel
  A* q = ws.states + 2 * size;
  A* f = ws.states + 3 * size;
  for (int i = threadIdx.x; i < size; i += kThreads) {
    const int j = i / kSeqs, g = i % kSeqs;
    if (j < h && seq.batch_index[g] < a.batch)
      hbuf[i] = load_or_zero(a.input_state, at(seq.batch_index[g], a.heads, n, h, j));
  }
  __syncthreads();
  const T* const w_z[1] = {ws.w[0]};
  const T* const w_fr[2] = {ws.w[1], ws.w[2]};

  // Gates (x_f, x_r: matrix m reads input m + 1) and candidate (x) values of the lane at step t.
  constexpr int V1 = 4 * kSeqs, kOwn1 = max_owned<kH, V1>();
  constexpr int V2 = 2 * kSeqs, kOwn2 = max_owned<kH, V2>();
  const Owned own1 = owned_values<V1>(lanes, ks), own2 = owned_values<V2>(lanes, ks);
  auto fetch_gates = [&](std::int64_t t, int cp, bool valid, T(&x)[kOwn1]) {
    for_owned<kOwn1>(own1, [&](int i, int m, int g, int e) {
      const int j = 2 * cp + e;
      x[i] = fetch_input(a, m + 1, seq.first[g] + t, m == 0 ? xh[1] : xh[2], j,
                         own1.owner && valid && j < h && t < seq.len[g]);
    });
  };
  auto fetch_candidate = [&](std::int64_t t, int cp, bool valid, T(&x)[kOwn2]) {
    for_owned<kOwn2>(own2, [&](int i, int, int g, int e) {
      const int j = 2 * cp + e;
      x[i] = fetch_input(a, 0, seq.first[g] + t, xh[0], j,
                         own2.owner && valid && j < h && t < seq.len[g]);
    });
  };
  T ahead1[kOwn1] = {}, ahead2[kOwn2] = {};
  if constexpr (fetch_ahead<kH>()) {
    fetch_gates(0, threadIdx.x / lanes, true, ahead1);
    fetch_candidate(0, threadIdx.x / lanes, true, ahead2);
  }

  for (std::int64_t t = 0; t < steps; ++t) {
    const A* cur = hbuf + (t & 1) * size;
    A* next = hbuf + ((t + 1) & 1) * size;
    // f = sigmoid(h W_f + x_f), r = sigmoid(h W_r + x_r), q = h * r
    for_pairs(d, [&](int cp, bool valid) {
      T x[kOwn1] = {};
      if constexpr (fetch_ahead<kH>()) {
        copy(x, ahead1);
        fetch_gates(t + 1, cp, valid, ahead1);
      } else {
        fetch_gates(t, cp, valid, x);
      }
      A acc[V1];
      vec_mat<2>(w_fr, a.wstride, cur, valid ? h : 0, cp, ks, lanes, acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn1>(own1, [&](int i, int m, int g, int e) {
        const int j = 2 * cp + e, s = j * kSeqs + g;
        if (!own1.owner || !valid || j >= h) return;
        const A pre = acc[i] + load(x[i]);  // f keeps the pre-activation
        if (m == 0)
          f[s] = pre;
        else
          q[s] = t < seq.len[g] ? cur[s] * static_cast<A>(gate_sigmoid<T>(pre)) : A(0);
      });
    });
    __syncthreads();
    // z = tanh(q W + x), h' = f h + (1 - f) z
    for_pairs(d, [&](int cp, bool valid) {
      T x[kOwn2] = {};
      if constexpr (fetch_ahead<kH>()) {
        copy(x, ahead2);
        fetch_candidate(t + 1, cp, valid, ahead2);
      } else {
        fetch_candidate(t, cp, valid, x);
      }
      A acc[V2];
      vec_mat<1>(w_z, a.wstride, q, valid ? h : 0, cp, ks, lanes, acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn2>(own2, [&](int i, int, int g, int e) {
        const int j = 2 * cp + e, s = j * kSeqs + g;
        if (!own2.owner || !valid || j >= h) return;
        A v = cur[s];
        if (t < seq.len[g]) {
          using G = gate_t<T>;
          const G fs = gate_sigmoid<T>(f[s]), z = gate_tanh<T>(acc[i] + load(x[i]));
          v = static_cast<A>(fs * v + (G(1) - fs) * z);
          a.output[at(seq.first[g] + t, a.heads, n, h, j)] = store<T>(v);
        }
        next[s] = v;
      });
    });
    __syncthreads();
  }

  if (a.final_state == nullptr) return;
  const A* last = hbuf + (steps & 1) * size;
  for (int i = threadIdx.x; i < kSeqs * h; i += kThreads) {
    const int g = i / h, j = i % h;
    if (seq.batch_index[g] < a.batch)
      a.final_state[at(seq.batch_index[g], a.heads, n, h, j)] = store<T>(last[j * kSeqs + g]);
  }
}

// The end of a backward kernel: grad_input_state from the carried gradient, and the block's
// weight-gradient partials when they were accumulated in shared memory.
template <typename T, int M>
__device__ void finish_backward(const Args<T>& a, const Seqs& seq, int n, const acc_t<T>* dh,
                                const Workspace<T, M>& ws) {
  const int h = a.h, hp = 2 * a.pairs;
  if (a.grad_input_state != nullptr)
    for (int i = threadIdx.x; i < kSeqs * h; i += kThreads) {
      const int g = i / h, j = i % h;
      if (seq.batch_index[g] < a.batch)
        a.grad_input_state[at(seq.batch_index[g], a.heads, n, h, j)] = store<T>(dh[j * kSeqs + g]);
    }
  const std::int64_t blk = blockIdx.x;
  for (int m = 0; m < a.dw_shared; ++m) {
    acc_t<T>* dst = a.dw_partial + (blk * M + m) * hp * hp;
    for (int i = threadIdx.x; i < hp * hp; i += kThreads)
      dst[i] = ws.dw[m][(i / hp) * a.dwstride + i % hp];
  }
}

// The state before position p of sequence g as raw bits (load_if), zero where !on: output[p - 1],
// or input_state (zeros) at p = 0.
template <typename T>
__device__ __forceinline__ T fetch_previous_state(const Args<T>& a, const Seqs& seq, int g,
                                                  std::int64_t p, std::int64_t n, int j, bool on) {
  const T* src = p > 0 ? a.y + at(seq.first[g] + p - 1, a.heads, n, a.h, j)
                 : a.input_state != nullptr
                     ? a.input_state + at(seq.batch_index[g], a.heads, n, a.h, j)
                     : nullptr;
  return load_if(src, on && src != nullptr);
}

// ------------------------------------------------------------------------------------------------
// RNN backward. States: da, u (the previous state: the operand of the weight gradient), dh (the
// carried gradient). Step t handles position p = len - 1 - t of each sequence:
//   g = clamp(dh + dy_p), da = g (1 - y_p^2), dW += y_{p-1}^T da, dh = da W^T.
template <typename T, int kH>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Seqs seq;
  const Dims<kH> d{a.h, a.pairs, a.lanes};
  const int h = d.h(), hp = d.hp(), pairs = d.pairs(), lanes = d.lanes();
  const int ks = threadIdx.x & (lanes - 1);
  const int n = blockIdx.x / a.groups, group = blockIdx.x % a.groups;
  const Workspace<T, 1> ws = make_workspace<T, 1>(a, smem, n, 3, true);
  const std::int64_t steps = load_sequences(a, group, seq);
  A* da = ws.states;
  A* u = ws.states + hp * kSeqs;
  A* dh = ws.states + 2 * hp * kSeqs;
  for (int i = threadIdx.x; i < hp * kSeqs; i += kThreads) {
    const int j = i / kSeqs, g = i % kSeqs;
    if (j < h && seq.batch_index[g] < a.batch)
      dh[i] = load_or_zero(a.grad_final_state, at(seq.batch_index[g], a.heads, n, h, j));
  }
  __syncthreads();
  const A* const das[1] = {da};
  A* const dws[1] = {ws.dw[0]};
  constexpr int V = 2 * kSeqs, kOwn = max_owned<kH, V>();
  const Owned own = owned_values<V>(lanes, ks);

  // The elementwise part: item k of this thread is (g, j) = (i / hp, i % hp), i = tid + k kThreads
  // (j fastest: coalesced rows). With constant sizes the next step's loads are issued before this
  // step's product and converted only in the next step.
  constexpr int kItems = kH ? (kH + 1) / 2 * 2 * kSeqs / kThreads : 1;
  constexpr bool kPrefetch = kH != 0 && (kH + 1) / 2 * 2 * kSeqs % kThreads == 0;
  T py[kItems] = {}, pu[kItems] = {}, pdy[kItems] = {};
  auto fetch = [&](std::int64_t t, int i, T& y, T& prev, T& dy) {
    const int g = i / hp, j = i % hp;
    const bool on = j < h && t < seq.len[g];
    const std::int64_t p = seq.len[g] - 1 - t, row = seq.first[g] + p;
    y = load_if(a.y + at(row, a.heads, n, h, j), on);
    prev = fetch_previous_state(a, seq, g, p, n, j, on);
    dy = fetch_or_zero(a.grad_output, at(row, a.heads, n, h, j), on);
  };
  if constexpr (kPrefetch)
#pragma unroll
    for (int k = 0; k < kItems; ++k) fetch(0, threadIdx.x + k * kThreads, py[k], pu[k], pdy[k]);

  for (std::int64_t t = 0; t < steps; ++t) {
    auto elementwise = [&](int i, A y, A prev, A dy) {
      const int g = i / hp, j = i % hp, s = j * kSeqs + g;
      A grad = 0, operand = 0;
      if (j < h && t < seq.len[g]) {
        const std::int64_t row = seq.first[g] + seq.len[g] - 1 - t;
        grad = clamp_grad(dh[s] + dy, a.clip) * (A(1) - y * y);
        operand = prev;
        store_grad_input(a, 0, row, n, j, grad);
      }
      da[s] = grad;
      u[s] = operand;
    };
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < kItems; ++k)
        elementwise(threadIdx.x + k * kThreads, load(py[k]), load(pu[k]), load(pdy[k]));
    } else {
      for (int i = threadIdx.x; i < hp * kSeqs; i += kThreads) {
        T y, prev, dy;
        fetch(t, i, y, prev, dy);
        elementwise(i, load(y), load(prev), load(dy));
      }
    }
    __syncthreads();
    if constexpr (kPrefetch)
#pragma unroll
      for (int k = 0; k < kItems; ++k)
        fetch(t + 1, threadIdx.x + k * kThreads, py[k], pu[k], pdy[k]);
    for_pairs(d, [&](int cp, bool valid) {
      A acc[V];
      vec_mat_t<1>(ws.w, a.wstride, das, dws, ws.dwstride, u, valid ? pairs : 0, cp, ks, lanes,
                   acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn>(own, [&](int i, int, int g, int e) {
        const int j = cp + e * pairs;
        if (own.owner && valid && j < h && t < seq.len[g]) dh[j * kSeqs + g] = acc[i];
      });
    });
    __syncthreads();
  }
  finish_backward<T, 1>(a, seq, n, dh, ws);
}

// ------------------------------------------------------------------------------------------------
// GRU backward. States: u[2] (the previous state, double buffer), f, r, q, da_z, da_f, da_r, dh.
// Step t handles position p = len - 1 - t; with h = u (the previous state) and g = clamp(dh + dy):
//   1. f, r from h (recomputed), q = h r
//   2. z = tanh(q W + x); da_z = g (1 - f)(1 - z^2), da_f = g (h - z) f (1 - f), dh = g f
//   3. dq = da_z W^T; da_r = dq h r (1 - r); dh += dq r; dW += q^T da_z
//   4. dh += da_f W_f^T + da_r W_r^T; dW_f += h^T da_f, dW_r += h^T da_r
template <typename T, int kH>
__global__ void __launch_bounds__(kThreads, 1) gru_backward_kernel(const Args<T> a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Seqs seq;
  const Dims<kH> d{a.h, a.pairs, a.lanes};
  const int h = d.h(), hp = d.hp(), pairs = d.pairs(), lanes = d.lanes();
  const int ks = threadIdx.x & (lanes - 1);
  const int n = blockIdx.x / a.groups, group = blockIdx.x % a.groups;
  const Workspace<T, 3> ws = make_workspace<T, 3>(a, smem, n, 9, true);
  const std::int64_t xh[3] = {input_head(a, 0, n), input_head(a, 1, n), input_head(a, 2, n)};
  const std::int64_t steps = load_sequences(a, group, seq);
  const int size = hp * kSeqs;
  A* const ubuf = ws.states;  // two buffers: u[t & 1] is the previous state of step t
  A* f = ws.states + 2 * size;
  A* r = ws.states + 3 * size;
  A* q = ws.states + 4 * size;
  A* da_z = ws.states + 5 * size;
  A* da_f = ws.states + 6 * size;
  A* da_r = ws.states + 7 * size;
  A* dh = ws.states + 8 * size;

  // The previous state of step t for item i = (g, j) = (i / hp, i % hp) (j fastest: coalesced).
  auto fetch_prev = [&](std::int64_t t, int i) -> T {
    const int g = i / hp, j = i % hp;
    return fetch_previous_state(a, seq, g, seq.len[g] - 1 - t, n, j, j < h && t < seq.len[g]);
  };
  for (int i = threadIdx.x; i < size; i += kThreads) {
    const int g = i / hp, j = i % hp;
    ubuf[j * kSeqs + g] = load(fetch_prev(0, i));
    if (j < h && seq.batch_index[g] < a.batch)
      dh[j * kSeqs + g] =
          load_or_zero(a.grad_final_state, at(seq.batch_index[g], a.heads, n, h, j));
  }
  __syncthreads();
  const T* const w_z[1] = {ws.w[0]};
  const T* const w_fr[2] = {ws.w[1], ws.w[2]};
  const A* const d_z[1] = {da_z};
  const A* const d_fr[2] = {da_f, da_r};
  A* const dw_z[1] = {ws.dw[0]};
  A* const dw_fr[2] = {ws.dw[1], ws.dw[2]};
  const int dws_z[1] = {ws.dwstride[0]};
  const int dws_fr[2] = {ws.dwstride[1], ws.dwstride[2]};
  constexpr int kItems = kH ? (kH + 1) / 2 * 2 * kSeqs / kThreads : 1;
  constexpr bool kPrefetch = kH != 0 && (kH + 1) / 2 * 2 * kSeqs % kThreads == 0;
  T next_prev[kItems] = {};

  // The lane's token-row values of step t: x_f, x_r (gates: matrix m reads input m + 1) and x, dy
  // (candidate), as in gru_forward_kernel.
  constexpr int V1 = 4 * kSeqs, kOwn1 = max_owned<kH, V1>();
  constexpr int V2 = 2 * kSeqs, kOwn2 = max_owned<kH, V2>();
  const Owned own1 = owned_values<V1>(lanes, ks), own2 = owned_values<V2>(lanes, ks);
  auto row_of = [&](int g, std::int64_t t) { return seq.first[g] + seq.len[g] - 1 - t; };
  auto fetch_gates = [&](std::int64_t t, int cp, bool valid, T(&x)[kOwn1]) {
    for_owned<kOwn1>(own1, [&](int i, int m, int g, int e) {
      const int j = 2 * cp + e;
      x[i] = fetch_input(a, m + 1, row_of(g, t), m == 0 ? xh[1] : xh[2], j,
                         own1.owner && valid && j < h && t < seq.len[g]);
    });
  };
  auto fetch_candidate = [&](std::int64_t t, int cp, bool valid, T(&x)[kOwn2], T(&dy)[kOwn2]) {
    for_owned<kOwn2>(own2, [&](int i, int, int g, int e) {
      const int j = 2 * cp + e;
      const bool on = own2.owner && valid && j < h && t < seq.len[g];
      x[i] = fetch_input(a, 0, row_of(g, t), xh[0], j, on);
      dy[i] = fetch_or_zero(a.grad_output, at(row_of(g, t), a.heads, n, h, j), on);
    });
  };
  T ahead_gates[kOwn1] = {}, ahead_x[kOwn2] = {}, ahead_dy[kOwn2] = {};
  if constexpr (fetch_ahead<kH>()) {
    fetch_gates(0, threadIdx.x / lanes, true, ahead_gates);
    fetch_candidate(0, threadIdx.x / lanes, true, ahead_x, ahead_dy);
  }

  for (std::int64_t t = 0; t < steps; ++t) {
    const A* hprev = ubuf + (t & 1) * size;
    A* hnext = ubuf + ((t + 1) & 1) * size;
    if constexpr (kPrefetch)
#pragma unroll
      for (int k = 0; k < kItems; ++k) next_prev[k] = fetch_prev(t + 1, threadIdx.x + k * kThreads);
    // 1. f, r, q
    for_pairs(d, [&](int cp, bool valid) {
      T x[kOwn1] = {};
      if constexpr (fetch_ahead<kH>()) {
        copy(x, ahead_gates);
        fetch_gates(t + 1, cp, valid, ahead_gates);
      } else {
        fetch_gates(t, cp, valid, x);
      }
      A acc[V1];
      vec_mat<2>(w_fr, a.wstride, hprev, valid ? h : 0, cp, ks, lanes, acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn1>(own1, [&](int i, int m, int g, int e) {
        const int j = 2 * cp + e, s = j * kSeqs + g;
        if (!own1.owner || !valid || j >= h) return;
        const A pre = acc[i] + load(x[i]);  // f and r keep the pre-activations
        if (m == 0) {
          f[s] = pre;
        } else {
          r[s] = pre;
          q[s] = t < seq.len[g] ? hprev[s] * static_cast<A>(gate_sigmoid<T>(pre)) : A(0);
        }
      });
    });
    __syncthreads();
    // 2. z, da_z, da_f, dh = g f
    for_pairs(d, [&](int cp, bool valid) {
      T x[kOwn2] = {}, dy[kOwn2] = {};
      if constexpr (fetch_ahead<kH>()) {
        copy(x, ahead_x);
        copy(dy, ahead_dy);
        fetch_candidate(t + 1, cp, valid, ahead_x, ahead_dy);
      } else {
        fetch_candidate(t, cp, valid, x, dy);
      }
      A acc[V2];
      vec_mat<1>(w_z, a.wstride, q, valid ? h : 0, cp, ks, lanes, acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn2>(own2, [&](int i, int, int g, int e) {
        const int j = 2 * cp + e, s = j * kSeqs + g;
        if (!own2.owner || !valid || j >= h) return;
        A dz = 0, df = 0;
        if (t < seq.len[g]) {
          using G = gate_t<T>;
          const G z = gate_tanh<T>(acc[i] + load(x[i])), fi = gate_sigmoid<T>(f[s]);
          const G grad = clamp_grad(dh[s] + load(dy[i]), a.clip);
          dz = static_cast<A>(grad * (G(1) - fi) * (G(1) - z * z));
          df = static_cast<A>(grad * (hprev[s] - z) * fi * (G(1) - fi));
          dh[s] = static_cast<A>(grad * fi);
          store_grad_input(a, 0, row_of(g, t), n, j, dz);
          store_grad_input(a, 1, row_of(g, t), n, j, df);
        }
        da_z[s] = dz;
        da_f[s] = df;
      });
    });
    __syncthreads();
    // 3. dq = da_z W^T, da_r, dh += dq r, dW += q^T da_z
    for_pairs(d, [&](int cp, bool valid) {
      A acc[V2];
      vec_mat_t<1>(w_z, a.wstride, d_z, dw_z, dws_z, q, valid ? pairs : 0, cp, ks, lanes, acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn2>(own2, [&](int i, int, int g, int e) {
        const int j = cp + e * pairs, s = j * kSeqs + g;
        if (!own2.owner || !valid || j >= h) return;
        A dr = 0;
        if (t < seq.len[g]) {
          using G = gate_t<T>;
          const G dq = acc[i], ri = gate_sigmoid<T>(r[s]);
          dr = static_cast<A>(dq * hprev[s] * ri * (G(1) - ri));
          dh[s] = static_cast<A>(dh[s] + dq * ri);
          store_grad_input(a, 2, row_of(g, t), n, j, dr);
        }
        da_r[s] = dr;
      });
    });
    __syncthreads();
    // 4. dh += da_f W_f^T + da_r W_r^T, dW_f += h^T da_f, dW_r += h^T da_r; the next u
    for_pairs(d, [&](int cp, bool valid) {
      A acc[V2];
      vec_mat_t<2>(w_fr, a.wstride, d_fr, dw_fr, dws_fr, hprev, valid ? pairs : 0, cp, ks, lanes,
                   acc);
      reduce_scatter(acc, lanes, ks);
      for_owned<kOwn2>(own2, [&](int i, int, int g, int e) {
        const int j = cp + e * pairs;
        if (own2.owner && valid && j < h && t < seq.len[g]) dh[j * kSeqs + g] += acc[i];
      });
    });
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int i = threadIdx.x + k * kThreads;
        hnext[(i % hp) * kSeqs + i / hp] = load(next_prev[k]);
      }
    } else {
      for (int i = threadIdx.x; i < size; i += kThreads)
        hnext[(i % hp) * kSeqs + i / hp] = load(fetch_prev(t + 1, i));
    }
    __syncthreads();
  }
  finish_backward<T, 3>(a, seq, n, dh, ws);
}

// ------------------------------------------------------------------------------------------------
// Gradient sums in a fixed order.

// grad_weight[w] = sum over the heads n that read weight head w, then the groups, of the partials.
template <typename T>
__global__ void weight_grad_kernel(const acc_t<T>* partial, int mats, int m, int groups, int h,
                                   int hp, std::int64_t heads, std::int64_t weight_heads, T* out) {
  const std::int64_t total = weight_heads * h * h, per = heads / weight_heads;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t w = i / (h * h);
    const int k = static_cast<int>(i % (h * h)) / h, j = static_cast<int>(i % h);
    acc_t<T> sum = 0;
    for (std::int64_t n = w * per; n < (w + 1) * per; ++n)
      for (int grp = 0; grp < groups; ++grp)
        sum += partial[((n * groups + grp) * mats + m) * hp * hp + k * hp + j];
    out[i] = store<T>(sum);
  }
}

// grad_input[row][k] = sum over the heads n that read input head k of the per-head gradients.
template <typename T>
__global__ void input_grad_kernel(const acc_t<T>* scratch, std::int64_t rows, std::int64_t heads,
                                  std::int64_t input_heads, int h, T* out) {
  const std::int64_t total = rows * input_heads * h, per = heads / input_heads;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / (input_heads * h), k = (i / h) % input_heads;
    const int j = static_cast<int>(i % h);
    acc_t<T> sum = 0;
    for (std::int64_t n = k * per; n < (k + 1) * per; ++n) sum += scratch[at(row, heads, n, h, j)];
    out[i] = store<T>(sum);
  }
}

// ------------------------------------------------------------------------------------------------
// Host side.

template <typename T, int kH>
void (*kernel_for(Op op))(Args<T>) {
  switch (op) {
    case Op::RnnForward:
      return rnn_forward_kernel<T, kH>;
    case Op::RnnBackward:
      return rnn_backward_kernel<T, kH>;
    case Op::GruForward:
      return gru_forward_kernel<T, kH>;
    case Op::GruBackward:
      return gru_backward_kernel<T, kH>;
  }
  return nullptr;
}

// Constant-size kernels for H = 64 and 128 (f64 runs the generic one: it is not the fast path).
template <typename T>
void (*pick_kernel(Op op, int h))(Args<T>) {
  if constexpr (!std::is_same_v<T, double>) {
    if (h == 64) return kernel_for<T, 64>(op);
    if (h == 128) return kernel_for<T, 128>(op);
  }
  return kernel_for<T, 0>(op);
}

std::size_t align16(std::size_t bytes) { return (bytes + 15) / 16 * 16; }
int round_up(int x, int m) { return (x + m - 1) / m * m; }

template <typename T>
Args<T> base_args(const RecurrentShape& s) {
  Args<T> a{};
  a.batch = s.batch;
  a.seq_len = s.seq_len;
  a.heads = s.heads;
  a.cu_seqlens = s.cu_seqlens;
  for (int k = 0; k < 3; ++k) {
    a.input_heads[k] = s.input_heads[k];
    a.weight_heads[k] = s.weight_heads[k];
  }
  a.clip = static_cast<acc_t<T>>(INFINITY);
  return a;
}

std::int64_t token_rows(const RecurrentShape& s, const Stream& stream) {
  if (s.cu_seqlens == nullptr) return s.batch * s.seq_len;
  std::int64_t rows = 0;
  check(cudaMemcpyAsync(&rows, s.cu_seqlens + s.batch, sizeof(rows), cudaMemcpyDeviceToHost,
                        native(stream)),
        "rnn: cu_seqlens");
  check(cudaStreamSynchronize(native(stream)), "rnn: cu_seqlens");
  return rows;
}

// Places the workspace, allocates scratch, runs the recurrence and, for the backward, the
// gradient sums. grad_weight: the backward's outputs (M of them).
template <typename T>
void run(Op op, const char* name, const RecurrentShape& s, Args<T>& a, T* const* grad_weight,
         const Stream& stream) {
  using A = acc_t<T>;
  const int mats = weight_count(op);
  const bool backward = is_backward(op);
  const Device device{DeviceType::CUDA, stream.device.index};
  const DType acc_dtype = std::is_same_v<A, double> ? DType::F64 : DType::F32;
  std::vector<Tensor> scratch;
  auto allocate = [&](std::int64_t count, DType dtype) {
    return scratch.emplace_back(Shape{count}, dtype, device, stream).view().data();
  };

  if (s.batch == 0 || s.head_dim == 0) {  // no blocks: only zero weight gradients
    if (backward)
      for (int m = 0; m < mats; ++m)
        check(cudaMemsetAsync(grad_weight[m], 0,
                              s.weight_heads[m] * s.head_dim * s.head_dim * sizeof(T),
                              native(stream)),
              name);
    return;
  }

  a.h = static_cast<int>(s.head_dim);
  a.pairs = (a.h + 1) / 2;
  a.lanes = lanes_per_pair(a.pairs);
  const int hp = 2 * a.pairs, per_warp = 32 / a.lanes;
  // Rows of round_up(pairs, 32) + per_warp element pairs: the pairs that a warp's lanes read
  // (per_warp columns x `lanes` rows) fall on distinct banks.
  a.wstride = 2 * (round_up(a.pairs, 32) + per_warp % 32);
  const int dw_padded = round_up(hp, 32) + (2 * a.lanes) % 32;
  a.groups = static_cast<int>((s.batch + kSeqs - 1) / kSeqs);
  const std::int64_t blocks = a.groups * s.heads;

  int max_shared = 0;
  check(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                               stream.device.index),
        name);
  const std::size_t states = align16(std::size_t(state_buffers(op)) * hp * kSeqs * sizeof(A));
  const std::size_t weights = align16(std::size_t(mats) * hp * a.wstride * sizeof(T));
  const std::size_t dw = align16(std::size_t(hp) * dw_padded * sizeof(A));  // one matrix
  const std::size_t limit = static_cast<std::size_t>(max_shared) - sizeof(Seqs);
  std::size_t shared = 0;
  a.states_shared = states <= limit;
  if (a.states_shared)
    shared = states;
  else
    a.states_global = static_cast<A*>(allocate(blocks * state_buffers(op) * hp * kSeqs, acc_dtype));
  a.weights_shared = shared + weights <= limit;
  if (a.weights_shared) {
    a.weights_offset = static_cast<int>(shared);
    shared += weights;
  } else {
    for (int m = 0; m < mats; ++m) {
      T* padded = static_cast<T*>(allocate(s.weight_heads[m] * hp * a.wstride, s.dtype));
      pad_weights_kernel<T><<<dim3(ceil_div(std::int64_t(hp) * a.wstride, 256),
                                   static_cast<unsigned>(s.weight_heads[m])),
                              256, 0, native(stream)>>>(a.weight[m], padded, a.h, hp, a.wstride);
      check_launch(name);
      a.weight[m] = padded;
    }
  }
  if (backward) {
    a.dw_partial = static_cast<A*>(allocate(blocks * mats * hp * hp, acc_dtype));
    a.dw_shared = static_cast<int>(std::min<std::size_t>(mats, (limit - shared) / dw));
    a.dw_offset = static_cast<int>(shared);
    a.dwstride = dw_padded;
    shared += a.dw_shared * dw;
    if (a.dw_shared < mats)
      check(cudaMemsetAsync(a.dw_partial, 0, blocks * mats * hp * hp * sizeof(A), native(stream)),
            name);
  }
  std::int64_t rows = -1;  // token rows, read only when a broadcast input needs a scratch
  if (backward)
    for (int m = 0; m < mats; ++m)
      if (s.input_heads[m] != s.heads) {
        if (rows < 0) rows = token_rows(s, stream);
        a.grad_input_scratch[m] = static_cast<A*>(allocate(rows * s.heads * s.head_dim, acc_dtype));
      }

  auto* kernel = pick_kernel<T>(op, a.h);
  check(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
        name);
  kernel<<<static_cast<unsigned>(blocks), kThreads, shared, native(stream)>>>(a);
  check_launch(name);
  if (!backward) return;

  for (int m = 0; m < mats; ++m) {
    weight_grad_kernel<T>
        <<<grid_size(s.weight_heads[m] * a.h * a.h, 256), 256, 0, native(stream)>>>(
            a.dw_partial, mats, m, a.groups, a.h, hp, s.heads, s.weight_heads[m], grad_weight[m]);
    check_launch(name);
    if (a.grad_input_scratch[m] != nullptr && rows > 0) {
      input_grad_kernel<T>
          <<<grid_size(rows * s.input_heads[m] * a.h, 256), 256, 0, native(stream)>>>(
              a.grad_input_scratch[m], rows, s.heads, s.input_heads[m], a.h, a.grad_input[m]);
      check_launch(name);
    }
  }
}

}  // namespace

void rnn_forward(const RecurrentShape& s, const void* input, const void* weight,
                 const void* input_state, void* output, void* final_state, const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "rnn", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    Args<T> a = base_args<T>(s);
    a.input[0] = static_cast<const T*>(input);
    a.weight[0] = static_cast<const T*>(weight);
    a.input_state = static_cast<const T*>(input_state);
    a.output = static_cast<T*>(output);
    a.final_state = static_cast<T*>(final_state);
    run<T>(Op::RnnForward, "rnn", s, a, nullptr, stream);
  });
}

void rnn_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const void* weight, const void* input_state, void* grad_input,
                  void* grad_weight, void* grad_input_state, double gradient_clipping,
                  const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "rnn_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    Args<T> a = base_args<T>(s);
    a.weight[0] = static_cast<const T*>(weight);
    a.input_state = static_cast<const T*>(input_state);
    a.y = static_cast<const T*>(output);
    a.grad_output = static_cast<const T*>(grad_output);
    a.grad_final_state = static_cast<const T*>(grad_final_state);
    a.grad_input[0] = static_cast<T*>(grad_input);
    a.grad_input_state = static_cast<T*>(grad_input_state);
    a.clip = static_cast<acc_t<T>>(gradient_clipping);
    T* const dw[1] = {static_cast<T*>(grad_weight)};
    run<T>(Op::RnnBackward, "rnn_backward", s, a, dw, stream);
  });
}

void gru_forward(const RecurrentShape& s, const GruPointers& p, const void* input_state,
                 void* output, void* final_state, const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "gru", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    Args<T> a = base_args<T>(s);
    for (int k = 0; k < 3; ++k) {
      a.input[k] = static_cast<const T*>(p.input[k]);
      a.weight[k] = static_cast<const T*>(p.weight[k]);
    }
    a.input_state = static_cast<const T*>(input_state);
    a.output = static_cast<T*>(output);
    a.final_state = static_cast<T*>(final_state);
    run<T>(Op::GruForward, "gru", s, a, nullptr, stream);
  });
}

void gru_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const GruPointers& p, const void* input_state,
                  const GruGradPointers& grads, void* grad_input_state, double gradient_clipping,
                  const Stream& stream) {
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "gru_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    Args<T> a = base_args<T>(s);
    T* dw[3];
    for (int k = 0; k < 3; ++k) {
      a.input[k] = static_cast<const T*>(p.input[k]);
      a.weight[k] = static_cast<const T*>(p.weight[k]);
      a.grad_input[k] = static_cast<T*>(grads.input[k]);
      dw[k] = static_cast<T*>(grads.weight[k]);
    }
    a.input_state = static_cast<const T*>(input_state);
    a.y = static_cast<const T*>(output);
    a.grad_output = static_cast<const T*>(grad_output);
    a.grad_final_state = static_cast<const T*>(grad_final_state);
    a.grad_input_state = static_cast<T*>(grad_input_state);
    a.clip = static_cast<acc_t<T>>(gradient_clipping);
    run<T>(Op::GruBackward, "gru_backward", s, a, dw, stream);
  });
}

}  // namespace meshfuse::detail::cuda
