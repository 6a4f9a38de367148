// The reduction kernel of the local backend on CUDA tensors: one thread per group of elements
// reads every rank's buffer (its own device's memory, or a peer's through peer access) and writes
// the reduced value once. The sources are combined in team order by every thread, so the result
// does not depend on the launch and equals reduce_buffers' on the CPU.
#include "core/cuda/cuda_utils.cuh"
#include "distributed/combine.h"
#include "distributed/local_reduce.h"

namespace meshfuse::detail {
namespace {

template <typename T>
struct Sources {
  const T* p[kMaxLocalReduceSources];
  int count;
};

// The type values are combined in: fp32 for 16-bit floats, the dtype's own otherwise.
template <typename T>
struct Compute {
  using type = T;
  __device__ static T in(T x) { return x; }
  __device__ static T out(T x) { return x; }
};
template <>
struct Compute<__half> {
  using type = float;
  __device__ static float in(__half x) { return cuda::load(x); }
  __device__ static __half out(float x) { return cuda::store<__half>(x); }
};
template <>
struct Compute<__nv_bfloat16> {
  using type = float;
  __device__ static float in(__nv_bfloat16 x) { return cuda::load(x); }
  __device__ static __nv_bfloat16 out(float x) { return cuda::store<__nv_bfloat16>(x); }
};

template <typename T, ReduceOp Op>
__device__ T reduce_one(const Sources<T>& in, std::int64_t i) {
  using C = typename Compute<T>::type;
  C acc = Compute<T>::in(in.p[0][i]);
  for (int s = 1; s < in.count; ++s) acc = combine<Op, C>(acc, Compute<T>::in(in.p[s][i]));
  if constexpr (Op == ReduceOp::Avg) acc /= static_cast<C>(in.count);
  return Compute<T>::out(acc);
}

// Grid-stride over groups of N elements, each group one 16-byte load per source when N > 1 (the
// launch checks the alignment); the tail past the last full group goes element by element.
template <typename T, ReduceOp Op, int N>
__global__ void reduce_kernel(Sources<T> in, T* out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t groups = n / N;
  for (std::int64_t g = first; g < groups; g += stride) {
    using V = cuda::Vec<T, N>;
    using C = typename Compute<T>::type;
    C acc[N];
    const V v0 = reinterpret_cast<const V*>(in.p[0])[g];
    for (int k = 0; k < N; ++k) acc[k] = Compute<T>::in(v0.v[k]);
    for (int s = 1; s < in.count; ++s) {
      const V v = reinterpret_cast<const V*>(in.p[s])[g];
      for (int k = 0; k < N; ++k) acc[k] = combine<Op, C>(acc[k], Compute<T>::in(v.v[k]));
    }
    V r;
    for (int k = 0; k < N; ++k) {
      if constexpr (Op == ReduceOp::Avg) acc[k] /= static_cast<C>(in.count);
      r.v[k] = Compute<T>::out(acc[k]);
    }
    reinterpret_cast<V*>(out)[g] = r;
  }
  for (std::int64_t i = groups * N + first; i < n; i += stride) out[i] = reduce_one<T, Op>(in, i);
}

template <typename T, ReduceOp Op>
void launch(const std::vector<const void*>& srcs, void* dst, std::int64_t n, cudaStream_t stream) {
  Sources<T> in{};
  in.count = static_cast<int>(srcs.size());
  bool aligned = cuda::aligned16(dst);
  for (std::size_t s = 0; s < srcs.size(); ++s) {
    in.p[s] = static_cast<const T*>(srcs[s]);
    aligned = aligned && cuda::aligned16(srcs[s]);
  }
  constexpr int kThreads = 256;
  constexpr int kVec = cuda::kVec16<T>;
  if (aligned && kVec > 1) {
    reduce_kernel<T, Op, kVec><<<cuda::grid_size(n / kVec + 1, kThreads), kThreads, 0, stream>>>(
        in, static_cast<T*>(dst), n);
  } else {
    reduce_kernel<T, Op, 1>
        <<<cuda::grid_size(n, kThreads), kThreads, 0, stream>>>(in, static_cast<T*>(dst), n);
  }
  cuda::check_launch("local: the reduction kernel");
}

template <typename T>
void launch_op(ReduceOp op, const std::vector<const void*>& srcs, void* dst, std::int64_t n,
               cudaStream_t stream) {
  switch (op) {
    case ReduceOp::Sum:
      return launch<T, ReduceOp::Sum>(srcs, dst, n, stream);
    case ReduceOp::Prod:
      return launch<T, ReduceOp::Prod>(srcs, dst, n, stream);
    case ReduceOp::Min:
      return launch<T, ReduceOp::Min>(srcs, dst, n, stream);
    case ReduceOp::Max:
      return launch<T, ReduceOp::Max>(srcs, dst, n, stream);
    case ReduceOp::Avg:
      if constexpr (std::is_integral_v<T>)
        throw Error(ErrorCode::InvalidArgument, "local: avg needs a floating dtype");
      else
        return launch<T, ReduceOp::Avg>(srcs, dst, n, stream);
  }
}

}  // namespace

void cuda_reduce_buffers(DType dtype, ReduceOp op, const std::vector<const void*>& srcs, void* dst,
                         std::int64_t n, const Stream& stream) {
  if (n == 0) return;
  const cudaStream_t s = cuda::native(stream);
  switch (dtype) {
    case DType::F32:
      return launch_op<float>(op, srcs, dst, n, s);
    case DType::F64:
      return launch_op<double>(op, srcs, dst, n, s);
    case DType::F16:
      return launch_op<__half>(op, srcs, dst, n, s);
    case DType::BF16:
      return launch_op<__nv_bfloat16>(op, srcs, dst, n, s);
    case DType::I32:
      return launch_op<std::int32_t>(op, srcs, dst, n, s);
    case DType::I64:
      return launch_op<std::int64_t>(op, srcs, dst, n, s);
    case DType::U8:
      return launch_op<std::uint8_t>(op, srcs, dst, n, s);
    case DType::U32:
      return launch_op<std::uint32_t>(op, srcs, dst, n, s);
    case DType::Bool:
      break;
  }
  throw Error(ErrorCode::InvalidArgument,
              "local: cannot reduce " + std::string(to_string(dtype)) + " tensors");
}

}  // namespace meshfuse::detail
