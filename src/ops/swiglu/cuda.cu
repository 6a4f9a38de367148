// CUDA SwiGLU on a 2-D grid: x over a row's column vectors, y over rows (a grid-stride loop past
// the grid's 65535 rows), so no thread divides to find its row and column: the 64-bit division
// per item of a flat grid-stride loop held the forward below the copy's rate. Each thread moves 16
// bytes of every operand per item when the rows allow it, else one element.
//
// The 16-bit forward computes silu with the fast exp and division (__expf: 2 + 1.173 |g| ulp,
// __fdividef: 2 ulp; together a relative error below 1.3e-5 over the range where e^-g is finite,
// under a tenth of an f16 ulp before the single rounding) in at most 32 registers, so 16 blocks
// of 128 threads fill an SM (IEEE division's slow path spilled at 32 registers, and at 46 fewer
// blocks fit; docs/kernels/swiglu.md). __fdividef returns 0 for divisors in (2^126, 2^128):
// for g in (-88.7, -87.3) the output is 0 instead of at most |u| * 1.1e-36.
#include <algorithm>

#include "core/cuda/cuda_utils.cuh"
#include "ops/common.h"
#include "ops/swiglu/swiglu_kernels.h"

namespace meshfuse::detail::cuda {
namespace {

template <typename T>
__device__ __forceinline__ T* at(SwigluOperand op, std::int64_t r, std::int64_t c) {
  return static_cast<T*>(op.data) + r * op.row_stride + c * op.col_stride;
}

// N consecutive columns of gate and up starting at column c; for interleaved inputs (kIn = 2)
// one load of 2N elements holds both.
template <typename T, int N, int kIn, typename A>
__device__ __forceinline__ void load_gate_up(SwigluOperand gate, SwigluOperand up, std::int64_t r,
                                             std::int64_t c, A (&g)[N], A (&u)[N]) {
  if constexpr (kIn == 1) {
    const Vec<T, N> gv = *reinterpret_cast<const Vec<T, N>*>(at<T>(gate, r, c));
    const Vec<T, N> uv = *reinterpret_cast<const Vec<T, N>*>(at<T>(up, r, c));
#pragma unroll
    for (int i = 0; i < N; ++i) {
      g[i] = load(gv.v[i]);
      u[i] = load(uv.v[i]);
    }
  } else {
    const Vec<T, 2 * N> x = *reinterpret_cast<const Vec<T, 2 * N>*>(at<T>(gate, r, c));
#pragma unroll
    for (int i = 0; i < N; ++i) {
      g[i] = load(x.v[2 * i]);
      u[i] = load(x.v[2 * i + 1]);
    }
  }
}

// Threads per block, at most (blocks of up to 128 threads measured fastest, see launch_rows).
constexpr int kThreads = 128;

// The arithmetic of f32 rows is double (once_t): each output is then rounded once, where f32
// arithmetic rounds it five times (the exp's own error up to 2 ulp), more than PyTorch's
// F.silu(g) * u. It costs the f32 forward its memory-bound speed (the double exp and division bound
// it on Hopper; the backward, with more bytes per value, stays at the copy's rate):
// docs/kernels/swiglu.md.

// u * silu(g) = u * g / (1 + e^-g), fast for 16-bit outputs (see the top of this file).
template <typename T, typename A>
__device__ __forceinline__ A swiglu_value(A g, A u) {
  if constexpr (sizeof(T) == 2) {
    return __fdividef(u * g, A(1) + __expf(-g));
  } else {
    using M = once_t<T>;
    return static_cast<A>(M(u) * M(g) / (M(1) + exp(-M(g))));
  }
}

template <typename T, int N, int kIn>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 16 : 8)
    forward_kernel(SwigluShape s, SwigluOperand gate, SwigluOperand up, SwigluOperand out) {
  using A = acc_t<T>;
  const std::int64_t c = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) * N;
  if (c >= s.cols) return;
  for (std::int64_t r = blockIdx.y; r < s.rows; r += gridDim.y) {
    A g[N], u[N];
    load_gate_up<T, N, kIn>(gate, up, r, c, g, u);
    Vec<T, N> y;
#pragma unroll
    for (int k = 0; k < N; ++k) y.v[k] = store<T>(swiglu_value<T>(g[k], u[k]));
    *reinterpret_cast<Vec<T, N>*>(at<T>(out, r, c)) = y;
  }
}

template <typename T, int N, int kIn>
__global__ void backward_kernel(SwigluShape s, SwigluOperand dy, SwigluOperand gate,
                                SwigluOperand up, SwigluOperand dgate, SwigluOperand dup) {
  using A = acc_t<T>;
  const std::int64_t c = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) * N;
  if (c >= s.cols) return;
  for (std::int64_t r = blockIdx.y; r < s.rows; r += gridDim.y) {
    A g[N], u[N];
    load_gate_up<T, N, kIn>(gate, up, r, c, g, u);
    const Vec<T, N> d = *reinterpret_cast<const Vec<T, N>*>(at<T>(dy, r, c));
    A dg[N], du[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      using M = once_t<T>;
      const M gm = g[k], sig = M(1) / (M(1) + exp(-gm)), dv = load(d.v[k]);
      du[k] = static_cast<A>(dv * gm * sig);
      dg[k] = static_cast<A>(dv * M(u[k]) * sig * (M(1) + gm * (M(1) - sig)));
    }
    if constexpr (kIn == 1) {
      Vec<T, N> a, b;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        a.v[k] = store<T>(dg[k]);
        b.v[k] = store<T>(du[k]);
      }
      *reinterpret_cast<Vec<T, N>*>(at<T>(dgate, r, c)) = a;
      *reinterpret_cast<Vec<T, N>*>(at<T>(dup, r, c)) = b;
    } else {
      Vec<T, 2 * N> x;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        x.v[2 * k] = store<T>(dg[k]);
        x.v[2 * k + 1] = store<T>(du[k]);
      }
      *reinterpret_cast<Vec<T, 2 * N>*>(at<T>(dgate, r, c)) = x;
    }
  }
}

// 16-byte accesses when every row start of every operand is 16-byte aligned and the width is a
// multiple of the vector (interleaved inputs: half the columns, since each load holds gate and
// up); one element per access otherwise.
template <typename T>
int vector_width(const SwigluShape& s, bool interleaved, std::initializer_list<SwigluOperand> ops) {
  const int n = interleaved ? kVec16<T> / 2 : kVec16<T>;
  if (n <= 1 || s.cols % n != 0) return 1;
  for (const SwigluOperand& op : ops)
    if (!aligned16(op.data) || (op.row_stride * sizeof(T)) % 16 != 0) return 1;
  return n;
}

// The 2-D launch of a kernel moving n elements per thread: a row's vectors over x (blocks of up
// to 128 threads), rows over y. 128-thread blocks measured faster than 256 or 512.
template <typename... P, typename... Args>
void launch_rows(void (*kernel)(P...), const SwigluShape& s, int n, const Stream& stream,
                 Args... args) {
  const std::int64_t per_row = s.cols / n;
  const int threads = static_cast<int>(std::min<std::int64_t>(kThreads, (per_row + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>((per_row + threads - 1) / threads),
                  static_cast<unsigned>(std::min<std::int64_t>(s.rows, 65535)));
  kernel<<<grid, threads, 0, native(stream)>>>(args...);
}

// Calls launch(kernel, n) with the kernel instance of T for vector width n and the layout.
template <typename T, template <typename, int, int> class K, typename L>
void pick(int n, bool interleaved, L&& launch) {
  constexpr int v = kVec16<T>;
  if (n == 1) return interleaved ? launch(K<T, 1, 2>::fn, 1) : launch(K<T, 1, 1>::fn, 1);
  if constexpr (v / 2 > 1)
    if (interleaved) return launch(K<T, v / 2, 2>::fn, v / 2);
  return launch(K<T, v, 1>::fn, v);
}

template <typename T, int N, int kIn>
struct Forward {
  static constexpr auto fn = forward_kernel<T, N, kIn>;
};
template <typename T, int N, int kIn>
struct Backward {
  static constexpr auto fn = backward_kernel<T, N, kIn>;
};

}  // namespace

void swiglu_forward(const SwigluShape& s, SwigluOperand gate, SwigluOperand up, SwigluOperand out,
                    const Stream& stream) {
  if (s.rows * s.cols == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "swiglu", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    const bool interleaved = gate.col_stride == 2;
    pick<T, Forward>(
        vector_width<T>(s, interleaved, {gate, up, out}), interleaved,
        [&](auto kernel, int n) { launch_rows(kernel, s, n, stream, s, gate, up, out); });
  });
  check_launch("swiglu");
}

void swiglu_backward(const SwigluShape& s, SwigluOperand grad_out, SwigluOperand gate,
                     SwigluOperand up, SwigluOperand grad_gate, SwigluOperand grad_up,
                     const Stream& stream) {
  if (s.rows * s.cols == 0) return;
  DeviceGuard guard(stream.device.index);
  dispatch_float(s.dtype, "swiglu_backward", [&](auto tag) {
    using T = cuda_t<decltype(tag)>;
    const bool interleaved = gate.col_stride == 2;
    pick<T, Backward>(vector_width<T>(s, interleaved, {grad_out, gate, up, grad_gate, grad_up}),
                      interleaved, [&](auto kernel, int n) {
                        launch_rows(kernel, s, n, stream, s, grad_out, gate, up, grad_gate,
                                    grad_up);
                      });
  });
  check_launch("swiglu_backward");
}

}  // namespace meshfuse::detail::cuda
