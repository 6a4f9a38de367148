// swiglu on CUDA tensors against the reference backend. Skipped without a GPU.
#include "meshfuse/meshfuse.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::kCuda;
using test::to_cpu;
using test::to_cuda;

struct Result {
  Tensor out, grad_gate, grad_up;
};

Result run(const TensorView& gate, const TensorView& up, const TensorView& dy, Device device) {
  Result r{Tensor(gate.shape(), gate.dtype(), device), Tensor(gate.shape(), gate.dtype(), device),
           Tensor(gate.shape(), gate.dtype(), device)};
  swiglu(gate, up, r.out);
  swiglu_backward(dy, gate, up, r.grad_gate, r.grad_up);
  return r;
}

void expect_close(const Result& gpu, const Result& expected) {
  test::expect_close(to_cpu(gpu.out), expected.out, "out");
  test::expect_close(to_cpu(gpu.grad_gate), expected.grad_gate, "grad_gate");
  test::expect_close(to_cpu(gpu.grad_up), expected.grad_up, "grad_up");
}

class CudaSwigluTest : public ::testing::TestWithParam<DType> {};

TEST_P(CudaSwigluTest, MatchesTheReferenceAtVectorAndOddWidths) {
  MESHFUSE_REQUIRE_CUDA();
  for (std::int64_t cols : {1, 7, 8, 33, 4104}) {
    const Tensor g = test::randn({9, cols}, GetParam(), 1, 3.0),
                 u = test::randn({9, cols}, GetParam(), 2),
                 dy = test::randn({9, cols}, GetParam(), 3);
    Result ref;
    {
      ForceKernelBackend force(KernelBackend::Reference);
      ref = run(g, u, dy, Device{});
    }
    expect_close(run(to_cuda(g), to_cuda(u), to_cuda(dy), kCuda), ref);
  }
}

TEST_P(CudaSwigluTest, RowsPastTheGridsSixtyFiveThousandAreCovered) {
  MESHFUSE_REQUIRE_CUDA();
  // 70000 rows: the grid's y dimension stops at 65535, the kernels loop over the rest; 8 and 3
  // columns take the vector and the one-element paths.
  for (std::int64_t cols : {8, 3}) {
    const Tensor g = test::randn({70000, cols}, GetParam(), 6, 3.0),
                 u = test::randn({70000, cols}, GetParam(), 7),
                 dy = test::randn({70000, cols}, GetParam(), 8);
    expect_close(run(to_cuda(g), to_cuda(u), to_cuda(dy), kCuda), run(g, u, dy, Device{}));
  }
}

TEST_P(CudaSwigluTest, PackedLayoutsMatchTheCpuBackend) {
  MESHFUSE_REQUIRE_CUDA();
  const Tensor x = test::randn({5, 2 * 40}, GetParam(), 4),
               dy = test::randn({5, 40}, GetParam(), 5);
  for (SwigluLayout layout : {SwigluLayout::Halves, SwigluLayout::Interleaved}) {
    Tensor out({5, 40}, GetParam()), grad_x(x.shape(), GetParam());
    swiglu_packed(x, layout, out);
    swiglu_packed_backward(dy, x, layout, grad_x);
    Tensor gout({5, 40}, GetParam(), kCuda), ggrad(x.shape(), GetParam(), kCuda);
    const Tensor gx = to_cuda(x), gdy = to_cuda(dy);
    swiglu_packed(gx, layout, gout);
    swiglu_packed_backward(gdy, gx, layout, ggrad);
    test::expect_close(to_cpu(gout), out, "out");
    test::expect_close(to_cpu(ggrad), grad_x, "grad_x");
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaSwigluTest, ::testing::ValuesIn(test::kFloatDTypes),
                         test::dtype_name);

TEST(CudaSwiglu, EmptyNonContiguousAndForcedReferenceOnCudaTensors) {
  MESHFUSE_REQUIRE_CUDA();
  Tensor empty_out({0, 8}, DType::BF16, kCuda);
  const Tensor empty = to_cuda(Tensor({0, 8}, DType::BF16));
  swiglu(empty, empty, empty_out);

  const Tensor g = test::randn({16, 24}, DType::F32, 6), u = test::randn({16, 24}, DType::F32, 7);
  const Tensor gg = to_cuda(g), gu = to_cuda(u);
  Tensor a({24, 16}, DType::F32, kCuda), b({24, 16}, DType::F32, kCuda);
  swiglu(gg.view().transpose(0, 1), gu.view().transpose(0, 1), a);
  {
    ForceKernelBackend force(KernelBackend::Reference);
    swiglu(gg.view().transpose(0, 1), gu.view().transpose(0, 1), b);
  }
  test::expect_close(to_cpu(a), to_cpu(b), "transposed, cuda vs reference staged on the host");
}

TEST(CudaSwiglu, DeterministicRunToRunOnAStream) {
  MESHFUSE_REQUIRE_CUDA();
  CudaStream stream(0);
  const Tensor g = to_cuda(test::randn({512, 4096}, DType::BF16, 8), stream);
  Tensor a(g.shape(), DType::BF16, kCuda, stream), b(g.shape(), DType::BF16, kCuda, stream);
  swiglu(g, g, a, stream);
  swiglu(g, g, b, stream);
  EXPECT_TRUE(testing::bitwise_equal(to_cpu(a, stream), to_cpu(b, stream)));
}

}  // namespace
}  // namespace meshfuse
