// Core on CUDA devices: allocation, copies, streams, backend resolution. Skipped without a GPU.
#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::to_cpu;
using test::to_cuda;

TEST(CudaCore, HostDeviceRoundTripIsBitwiseForEveryDtype) {
  MESHFUSE_REQUIRE_CUDA();
  for (DType d : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
    const Tensor a = test::randn({37, 41}, d, 1);
    EXPECT_TRUE(testing::bitwise_equal(to_cpu(to_cuda(a)), a)) << to_string(d);
  }
  Tensor labels({1000}, DType::I64);
  testing::fill_uniform_int(labels, 2, -(std::int64_t{1} << 60), std::int64_t{1} << 60);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(to_cuda(labels)), labels));
}

TEST(CudaCore, StridedAndConvertingCopiesOnTheDeviceMatchTheHost) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor a = test::randn({33, 65}, DType::F32, 3);
  const Tensor on_gpu = to_cuda(a);
  // Transposed device view -> contiguous host copy.
  const Tensor t = to_cpu(on_gpu.view().transpose(0, 1));
  EXPECT_TRUE(testing::bitwise_equal(t, a.view().transpose(0, 1)));
  // f32 -> bf16 on the device rounds like the host conversion.
  Tensor bf_gpu(a.shape(), DType::BF16, kCuda);
  copy(on_gpu, bf_gpu);
  Tensor bf_host(a.shape(), DType::BF16);
  copy(a, bf_host);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(bf_gpu), bf_host));
  // Host -> strided device destination.
  Tensor dst = Tensor::zeros({65, 33}, DType::F32, kCuda);
  copy(a, dst.view().transpose(0, 1));
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(dst).view().transpose(0, 1), a));
}

TEST(CudaCore, WorkOnAnExplicitStreamIsOrdered) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor a = test::randn({1 << 20}, DType::F32, 4);
  const Tensor g = to_cuda(a, stream);
  Tensor h = Tensor::copy_of(g, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(h, stream), a));
}

TEST(CudaCore, BackendFollowsTheDeviceAndForcingCpuOnCudaTensorsIsAnError) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor x = to_cuda(test::randn({4, 8}, DType::F32, 5));
  EXPECT_EQ(resolved_backend("swiglu", {{"gate", x}}), KernelBackend::CUDA);
  ForceKernelBackend force(KernelBackend::CPU);
  test::expect_error([&] { resolved_backend("swiglu", {{"gate", x}}); }, ErrorCode::Unsupported,
                     {"swiglu", "'cpu'", "cuda:0", "f32"});
}

TEST(CudaCore, AllocationOnAMissingDeviceNamesIt) {
  MESHFUSE_REQUIRE_CUDA();
  const int n = cuda_device_count();
  test::expect_error([&] { Tensor({4}, DType::F32, Device{DeviceType::CUDA, n}); },
                     ErrorCode::BackendUnavailable, {"Tensor", fmt::format("cuda:{}", n)});
}

}  // namespace
}  // namespace meshfuse

namespace meshfuse {
namespace {

TEST(CudaCore, StreamTimerMeasuresDeviceTimeOfQueuedWork) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor a = Tensor::zeros({1 << 26}, DType::F32, test::kCuda, stream);  // 256 MiB
  Tensor b(a.shape(), DType::F32, test::kCuda, stream);
  StreamTimer timer(stream);
  timer.start();
  copy(a, b, stream);
  const double ms = timer.stop();
  // 512 MiB moved: more than 10 us on any GPU, less than a second.
  EXPECT_GT(ms, 0.01);
  EXPECT_LT(ms, 1000.0);
}

}  // namespace
}  // namespace meshfuse
