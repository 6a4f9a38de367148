// CUDA allocation, streams and copies for core.
#include <string>

#include "core/cuda/cuda_utils.cuh"
#include "core/cuda/memory_pool.h"
#include "core/cuda/runtime.h"

namespace meshfuse::detail {
namespace cuda {

void check(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky launch error so the next call starts clean
  const ErrorCode code =
      status == cudaErrorMemoryAllocation ? ErrorCode::OutOfMemory : ErrorCode::Internal;
  throw Error(code, std::string(what) + ": CUDA error " + cudaGetErrorName(status) + " (" +
                        cudaGetErrorString(status) + ")");
}

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

int sm_count() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  return sms;
}

unsigned grid_size(std::int64_t work, int threads) {
  const std::int64_t wanted = (work + threads - 1) / threads;
  return static_cast<unsigned>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(wanted, std::int64_t{sm_count()} * 16)));
}

}  // namespace cuda

namespace {

constexpr int kMaxRank = 8;

struct Layout {
  std::int64_t shape[kMaxRank];
  std::int64_t src_strides[kMaxRank];
  std::int64_t dst_strides[kMaxRank];
  int rank;
};

__device__ double load_any(const char* p, DType d) {
  switch (d) {
    case DType::F32: return *reinterpret_cast<const float*>(p);
    case DType::F64: return *reinterpret_cast<const double*>(p);
    case DType::F16: return __half2float(*reinterpret_cast<const __half*>(p));
    case DType::BF16: return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
    case DType::I32: return *reinterpret_cast<const std::int32_t*>(p);
    case DType::I64: return static_cast<double>(*reinterpret_cast<const std::int64_t*>(p));
    case DType::U8: return *reinterpret_cast<const std::uint8_t*>(p);
    case DType::U32: return *reinterpret_cast<const std::uint32_t*>(p);
    case DType::Bool: return *reinterpret_cast<const bool*>(p) ? 1.0 : 0.0;
  }
  return 0;
}

__device__ void store_any(char* p, DType d, double v) {
  switch (d) {
    case DType::F32: *reinterpret_cast<float*>(p) = static_cast<float>(v); break;
    case DType::F64: *reinterpret_cast<double*>(p) = v; break;
    // Rounded once from double, like the host conversion.
    case DType::F16: *reinterpret_cast<__half*>(p) = __double2half(v); break;
    case DType::BF16: *reinterpret_cast<__nv_bfloat16*>(p) = __double2bfloat16(v); break;
    case DType::I32: *reinterpret_cast<std::int32_t*>(p) = static_cast<std::int32_t>(v); break;
    case DType::I64: *reinterpret_cast<std::int64_t*>(p) = static_cast<std::int64_t>(v); break;
    // Unsigned types modulo 2^bits, as the host conversion.
    case DType::U8:
      *reinterpret_cast<std::uint8_t*>(p) = static_cast<std::uint8_t>(static_cast<std::int64_t>(v));
      break;
    case DType::U32:
      *reinterpret_cast<std::uint32_t*>(p) =
          static_cast<std::uint32_t>(static_cast<std::int64_t>(v));
      break;
    case DType::Bool: *reinterpret_cast<bool*>(p) = v != 0.0; break;
  }
}

// One thread per element; same dtypes copy the element's bytes (exact for int64 and NaN payloads).
__global__ void strided_copy_kernel(const char* src, DType src_dtype, int src_size, char* dst,
                                    DType dst_dtype, int dst_size, Layout layout,
                                    std::int64_t numel) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < numel; i += stride) {
    std::int64_t rest = i, so = 0, d_off = 0;
    for (int d = layout.rank - 1; d >= 0; --d) {
      const std::int64_t idx = rest % layout.shape[d];
      rest /= layout.shape[d];
      so += idx * layout.src_strides[d];
      d_off += idx * layout.dst_strides[d];
    }
    const char* s = src + so * src_size;
    char* t = dst + d_off * dst_size;
    if (src_dtype == dst_dtype) {
      for (int b = 0; b < src_size; ++b) t[b] = s[b];
    } else {
      store_any(t, dst_dtype, load_any(s, src_dtype));
    }
  }
}

// Device-to-device copy on one device, any strides and dtypes.
void device_copy(const TensorView& src, const TensorView& dst, const Stream& stream) {
  const std::int64_t n = src.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(dst.device().index);
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    cuda::check(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice,
                                cuda::native(stream)),
                "copy");
    return;
  }
  if (src.dim() > kMaxRank)
    throw Error(ErrorCode::Unsupported, "copy: strided CUDA copies support rank <= 8, got " +
                                            std::to_string(src.dim()));
  Layout layout{};
  layout.rank = static_cast<int>(src.dim());
  for (int d = 0; d < layout.rank; ++d) {
    layout.shape[d] = src.shape()[d];
    layout.src_strides[d] = src.strides()[d];
    layout.dst_strides[d] = dst.strides()[d];
  }
  const unsigned blocks = std::min<unsigned>(cuda::ceil_div(n, 256), 65535u * 8);
  strided_copy_kernel<<<blocks, 256, 0, cuda::native(stream)>>>(
      static_cast<const char*>(src.data()), src.dtype(),
      static_cast<int>(element_size(src.dtype())), static_cast<char*>(dst.data()), dst.dtype(),
      static_cast<int>(element_size(dst.dtype())), layout, n);
  cuda::check_launch("copy");
}

}  // namespace

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::shared_ptr<void> cuda_allocate(Device device, std::size_t bytes, const Stream& stream) {
  cuda::DeviceGuard guard(device.index);
  void* p = nullptr;
  const cudaStream_t s = cuda::native(stream);
  const cudaMemPool_t pool = memory_pool(device.index);
  cudaError_t status = cudaMallocFromPoolAsync(&p, bytes == 0 ? 1 : bytes, pool, s);
  if (status == cudaErrorMemoryAllocation) {
    // The pool keeps freed memory (memory_pool.h): hand all of it back, once every pending free
    // has run, and try again.
    cudaGetLastError();
    cuda::check(cudaDeviceSynchronize(), "Tensor: synchronising before retrying an allocation");
    cuda::check(cudaMemPoolTrimTo(pool, 0), "Tensor: trimming the memory pool");
    status = cudaMallocFromPoolAsync(&p, bytes == 0 ? 1 : bytes, pool, s);
  }
  cuda::check(status, "Tensor: allocating " + std::to_string(bytes) + " bytes on " + device.str());
  const int index = device.index;
  // A deleter must not throw: errors while freeing are ignored.
  return {p, [s, index](void* ptr) {
            int previous = 0;
            cudaGetDevice(&previous);
            cudaSetDevice(index);
            cudaFreeAsync(ptr, s);
            cudaSetDevice(previous);
          }};
}

void cuda_copy(const TensorView& src, const TensorView& dst, const Stream& stream) {
  const bool src_gpu = src.device().type == DeviceType::CUDA;
  const bool dst_gpu = dst.device().type == DeviceType::CUDA;
  if (src.numel() == 0) return;
  if (src_gpu && dst_gpu) {
    if (src.device() == dst.device()) return device_copy(src, dst, stream);
    // Across devices (rare: set-up and tests): a stream belongs to one device, so the source side
    // is gathered on the source's default stream and the whole copy is synchronous.
    cuda_synchronize(stream);
    const Stream src_stream{src.device()}, dst_stream{dst.device()};
    const Tensor a = src.is_contiguous() ? Tensor() : Tensor::copy_of(src, src_stream);
    const TensorView& from = a.defined() ? a.view() : src;
    Tensor b(src.shape(), src.dtype(), dst.device(), dst_stream);
    cuda::check(cudaMemcpyPeer(b.view().data(), dst.device().index, from.data(),
                               src.device().index, src.nbytes()),
                "copy");
    device_copy(b, dst, dst_stream);
    return cuda_synchronize(dst_stream);
  }
  if (dst_gpu) {  // host -> device: convert and gather on the host, one transfer, scatter on device
    const Tensor host = Tensor(src.shape(), dst.dtype());
    copy(src, host);
    Tensor staged = dst.is_contiguous() ? Tensor() : Tensor(dst.shape(), dst.dtype(), dst.device(), stream);
    const TensorView& target = staged.defined() ? staged.view() : dst;
    cuda::DeviceGuard guard(dst.device().index);
    // From pageable memory the call returns once the source has been read, so `host` may go.
    cuda::check(cudaMemcpyAsync(target.data(), host.view().data(), host.view().nbytes(),
                                cudaMemcpyHostToDevice, cuda::native(stream)),
                "copy");
    if (staged.defined()) device_copy(staged, dst, stream);
    return;
  }
  // device -> host: gather on the device, one transfer, convert and scatter on the host.
  const Tensor gathered = src.is_contiguous() ? Tensor() : Tensor::copy_of(src, stream);
  const TensorView& from = gathered.defined() ? gathered.view() : src;
  const Tensor host(src.shape(), src.dtype());
  cuda::DeviceGuard guard(src.device().index);
  cuda::check(cudaMemcpyAsync(host.view().data(), from.data(), src.nbytes(),
                              cudaMemcpyDeviceToHost, cuda::native(stream)),
              "copy");
  cuda::check(cudaStreamSynchronize(cuda::native(stream)), "copy");
  copy(host, dst);
}

void cuda_synchronize(const Stream& stream) {
  cuda::DeviceGuard guard(stream.device.index);
  cuda::check(cudaStreamSynchronize(cuda::native(stream)), "synchronize");
}

void* cuda_event_create(int device_index, bool timing) {
  cuda::DeviceGuard guard(device_index);
  cudaEvent_t e = nullptr;
  cuda::check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
              "cudaEventCreate");
  return e;
}

void cuda_event_destroy(void* event, int device_index) {
  // Called from a destructor: must not throw, so errors are ignored.
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_index);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
  cudaSetDevice(previous);
}

void cuda_event_record(void* event, const Stream& stream) {
  cuda::DeviceGuard guard(stream.device.index);
  cuda::check(cudaEventRecord(static_cast<cudaEvent_t>(event), cuda::native(stream)),
              "cudaEventRecord");
}

void cuda_stream_wait_event(const Stream& stream, void* event) {
  cuda::DeviceGuard guard(stream.device.index);
  cuda::check(cudaStreamWaitEvent(cuda::native(stream), static_cast<cudaEvent_t>(event), 0),
              "cudaStreamWaitEvent");
}

namespace {
__global__ void hold_kernel(std::uint64_t ns) {
  const auto now = [] {
    std::uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  };
  for (const std::uint64_t begin = now(); now() - begin < ns;) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(1000);
#endif
  }
}
}  // namespace

void cuda_hold(const Stream& stream, unsigned microseconds) {
  cuda::DeviceGuard guard(stream.device.index);
  hold_kernel<<<1, 1, 0, cuda::native(stream)>>>(std::uint64_t{1000} * microseconds);
  cuda::check_launch("StreamTimer");
}

double cuda_event_elapsed_ms(void* begin, void* end) {
  cuda::check(cudaEventSynchronize(static_cast<cudaEvent_t>(end)), "StreamTimer");
  float ms = 0;
  cuda::check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin),
                                   static_cast<cudaEvent_t>(end)),
              "StreamTimer");
  return ms;
}

void* cuda_stream_create(int device_index) {
  cuda::DeviceGuard guard(device_index);
  cudaStream_t s = nullptr;
  cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "CudaStream");
  return s;
}

void cuda_stream_destroy(void* stream, int device_index) {
  // Called from a destructor: must not throw, so errors are ignored.
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_index);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  cudaSetDevice(previous);
}

}  // namespace meshfuse::detail
