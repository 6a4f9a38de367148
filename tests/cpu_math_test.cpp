// The cpu backend's math helpers, the SIMD ones on every target this build has and the CPU allows
// (compiled here per target as the kernels compile them).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_math_test.cpp"
#include "ops/cpu_math.h"

#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "ops/cpu_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace meshfuse::detail::cpu::HWY_NAMESPACE {

// VExp of in[0, n) into out (n a multiple of the lanes, at most 16).
void VExpOf(const float* in, float* out, std::size_t n) {
  const DF d;
  for (std::size_t i = 0; i < n; i += hn::Lanes(d))
    hn::StoreU(VExp(d, hn::LoadU(d, in + i)), d, out + i);
}

// StreamOut of v[i] to dst[0, n) as T, then the fence.
template <typename T>
void StreamOutOf(const std::vector<float>& v, T* dst, std::int64_t n, bool stream, const T* next) {
  StreamOut(dst, n, stream, [&](std::int64_t i) { return v[i]; }, {next, nullptr});
  hwy::FlushStream();
}
void StreamOutBf16(const std::vector<float>& v, bfloat16* dst, std::int64_t n, bool stream,
                   const bfloat16* next) {
  StreamOutOf(v, dst, n, stream, next);
}
void StreamOutF16(const std::vector<float>& v, float16* dst, std::int64_t n, bool stream) {
  StreamOutOf(v, dst, n, stream, static_cast<const float16*>(nullptr));
}
void StreamOutF32(const std::vector<float>& v, float* dst, std::int64_t n, bool stream) {
  StreamOutOf(v, dst, n, stream, static_cast<const float*>(nullptr));
}

}  // namespace meshfuse::detail::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "meshfuse/ops/rmsnorm.h"
#include "test_util.h"

namespace meshfuse::detail::cpu {
HWY_EXPORT(VExpOf);
HWY_EXPORT(StreamOutBf16);
HWY_EXPORT(StreamOutF16);
HWY_EXPORT(StreamOutF32);
}  // namespace meshfuse::detail::cpu

namespace meshfuse {
namespace {

using detail::cpu::vexp;

// Runs f once on each target this build has and the CPU allows, that target pinned.
template <typename F>
void on_every_target(F&& f) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    f();
  }
  hwy::SetSupportedTargetsForTest(0);
}

// VExp of 16 values.
void vexp16(const float* in, float* out) { HWY_DYNAMIC_DISPATCH(detail::cpu::VExpOf)(in, out, 16); }

TEST(CpuMath, VexpIsWithinTwoUlpFromSubnormalToOverflow) {
  double worst = 0;
  for (float x = -103.9f; x < 88.72f; x += 0.000731f) {
    const double exact = std::exp(static_cast<double>(x));
    // ulp of the float nearest `exact`, never below the subnormal spacing 2^-149.
    const double ulp = std::ldexp(1.0, std::max(std::ilogb(exact), -126) - 23);
    worst = std::max(worst, std::fabs(vexp(x) - exact) / ulp);
  }
  EXPECT_LE(worst, 2.0);
}

TEST(CpuMath, VexpHandlesInfNanAndTheRangeEnds) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(vexp(-inf), 0.0f);
  EXPECT_EQ(vexp(inf), inf);
  EXPECT_EQ(vexp(100.0f), inf);
  EXPECT_EQ(vexp(-104.5f), 0.0f);
  EXPECT_NEAR(vexp(-100.0f), std::exp(-100.0), 1.5e-45);  // a subnormal float
  EXPECT_TRUE(std::isnan(vexp(std::nanf(""))));
  EXPECT_EQ(vexp(0.0f), 1.0f);
}

// VExp on every 997th float bit pattern (all exponents, both signs, NaNs; not the infinities,
// which the next test takes) against exp in double: within 2 ulp of the exact value; results
// below half the smallest subnormal give 0.
TEST(CpuMath, VExpIsWithinTwoUlpOverTheWholeFloatRangeOnEveryTarget) {
  on_every_target([] {
    double worst = 0;
    std::int64_t wrong_specials = 0;
    alignas(64) float in[16], out[16];
    for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 16 * 997) {
      for (int i = 0; i < 16; ++i)
        in[i] = std::bit_cast<float>(static_cast<std::uint32_t>(b + i * 997));
      vexp16(in, out);
      for (int i = 0; i < 16; ++i) {
        const double exact = std::exp(static_cast<double>(in[i]));
        if (std::isnan(in[i]) || exact > 3.4028234663852886e38) {
          wrong_specials += std::isnan(in[i]) ? !std::isnan(out[i]) : out[i] != INFINITY;
          continue;
        }
        const double ulp = std::ldexp(1.0, std::max(std::ilogb(exact), -126) - 23);
        worst = std::max(worst, std::fabs(out[i] - exact) / ulp);
      }
    }
    EXPECT_LE(worst, 2.0);
    EXPECT_EQ(wrong_specials, 0);
  });
}

TEST(CpuMath, VExpHandlesMinusInfNanSubnormalsAndTheRangeEndsOnEveryTarget) {
  on_every_target([] {
    const float inf = std::numeric_limits<float>::infinity();
    alignas(64) float in[16] = {-inf,  3e38f,          100.0f, -104.5f, -100.0f, std::nanf(""),
                                0.0f,  -0.0f,          88.72f, -87.5f,  -103.0f, 1.0f,
                                -1.0f, -std::nanf(""), 89.0f,  -104.0f};
    alignas(64) float out[16];
    vexp16(in, out);
    EXPECT_TRUE(std::isnan(out[5]));
    EXPECT_TRUE(std::isnan(out[13]));
    EXPECT_EQ(out[6], 1.0f);
    EXPECT_EQ(out[7], 1.0f);
    EXPECT_EQ(out[14], inf);   // past ln(FLT_MAX)
    EXPECT_EQ(out[15], 0.0f);  // below half the smallest subnormal
    EXPECT_GT(out[10], 0.0f);  // subnormal
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_EQ(out[1], inf);  // large finite inputs too (+inf is outside VExp's domain)
    EXPECT_EQ(out[2], inf);
    EXPECT_EQ(out[3], 0.0f);
    EXPECT_NEAR(out[4], std::exp(-100.0), 1.5e-45);  // a subnormal float
  });
}

// Every bf16 above and below each rounding boundary: ties, NaN payloads, inf, subnormals (which the
// AVX512-BF16 conversion would flush; StreamOut must not).
std::vector<float> bf16_boundary_values() {
  std::vector<float> v;
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      v.push_back(std::bit_cast<float>(hi << 16 | lo));
  return v;
}

TEST(CpuMath, StreamOutStoresAsStoreAsStreamedOrNotAtAnyAlignmentOnEveryTarget) {
  on_every_target([] {
    const std::vector<float> v = bf16_boundary_values();
    const auto n = static_cast<std::int64_t>(v.size());
    std::vector<bfloat16> next(v.size() + 1);
    for (const bool stream : {false, true})
      for (const std::int64_t skew : {0, 1, 7}) {  // out misaligned by `skew` elements
        std::vector<bfloat16> out(v.size() + 64);
        bfloat16* dst = out.data() + skew;
        HWY_DYNAMIC_DISPATCH(detail::cpu::StreamOutBf16)(v, dst, n - skew, stream, next.data());
        for (std::int64_t i = 0; i < n - skew; ++i)
          ASSERT_EQ(dst[i].bits, to_bfloat16(v[i]).bits)
              << "value bits " << std::hex << std::bit_cast<std::uint32_t>(v[i]);
      }
  });
}

TEST(CpuMath, StreamOutStoresF32AndF16AsStoreAsOnEveryTarget) {
  on_every_target([] {
    const std::vector<float> v = bf16_boundary_values();
    const auto n = static_cast<std::int64_t>(v.size()) - 3;
    std::vector<float> f32(v.size());
    std::vector<float16> f16(v.size());
    HWY_DYNAMIC_DISPATCH(detail::cpu::StreamOutF32)(v, f32.data() + 3, n, true);
    HWY_DYNAMIC_DISPATCH(detail::cpu::StreamOutF16)(v, f16.data() + 3, n, true);
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(f32[3 + i]), std::bit_cast<std::uint32_t>(v[i]));
      ASSERT_EQ(f16[3 + i].bits, to_float16(v[i]).bits);
    }
  });
}

#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
// A fresh anonymous mapping of `bytes`, unmapped when it goes.
struct FreshMapping {
  explicit FreshMapping(std::size_t bytes)
      : size(bytes),
        data(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) {}
  ~FreshMapping() { munmap(data, size); }
  // How many of the pages in [begin, end) (byte offsets) are mapped.
  std::size_t mapped_pages(std::size_t begin, std::size_t end) const {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> bits((end - begin) / page);
    EXPECT_EQ(mincore(static_cast<char*>(data) + begin, end - begin, bits.data()), 0);
    return static_cast<std::size_t>(
        std::count_if(bits.begin(), bits.end(), [](unsigned char b) { return b & 1; }));
  }
  std::size_t size;
  void* data;
};

TEST(CpuMath, OutputWriteStreamsIntoMappedOutputsAndPopulatesFreshOnesPastTheL2Caches) {
  constexpr std::size_t kBytes = std::size_t{256} << 20;  // past any L2 caches
  const FreshMapping out(kBytes);
  ASSERT_NE(out.data, MAP_FAILED);
  const auto bytes = static_cast<std::int64_t>(kBytes);
  const detail::cpu::OutputWrite small = detail::cpu::output_write(4096, out.data, 4096);
  EXPECT_FALSE(small.stream || small.fresh);
  detail::cpu::OutputWrite w = detail::cpu::output_write(2 * bytes, out.data, bytes);
  EXPECT_TRUE(w.fresh);
  EXPECT_FALSE(w.stream);
  {  // Where madvise does not populate (a kernel before 5.14, qemu-user) the kernels take faults.
    const FreshMapping probe(1 << 16);
    if (madvise(probe.data, probe.size, MADV_POPULATE_WRITE) != 0 ||
        probe.mapped_pages(0, probe.size) == 0)
      GTEST_SKIP() << "madvise(MADV_POPULATE_WRITE) populates nothing here";
  }
  // Rows of 3000 bytes (not page multiples), one written before: the populate keeps it.
  const std::int64_t row_bytes = 3000, rows = bytes / row_bytes;
  static_cast<char*>(out.data)[5 * row_bytes + 7] = 42;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
#pragma omp parallel num_threads(2)
  detail::cpu::populate_rows(w, out.data, rows, row_bytes, row_bytes);
  // Every whole page of the rows is mapped now (the last partial row's tail may not be).
  const std::size_t rows_end = static_cast<std::size_t>(rows * row_bytes) / page * page;
  EXPECT_EQ(out.mapped_pages(0, rows_end), rows_end / page);
  EXPECT_EQ(static_cast<char*>(out.data)[5 * row_bytes + 7], 42);
  EXPECT_EQ(static_cast<char*>(out.data)[5 * row_bytes + 8], 0);
  // Strided rows (swiglu's halves layout): nothing past the last row's end, whose stride's tail
  // is not the output's.
  const FreshMapping halves(kBytes);
  const std::int64_t half = std::int64_t{1} << 20, strided_rows = bytes / (2 * half);
#pragma omp parallel num_threads(2)
  detail::cpu::populate_rows(w, halves.data, strided_rows, 2 * half, half);
  const auto last_end = static_cast<std::size_t>((strided_rows - 1) * 2 * half + half);
  EXPECT_EQ(halves.mapped_pages(0, last_end), last_end / page);
  EXPECT_EQ(halves.mapped_pages(last_end, kBytes), 0u);
  w = detail::cpu::output_write(2 * bytes, out.data, bytes);
  EXPECT_TRUE(w.stream);
  EXPECT_FALSE(w.fresh);
}

// The VmFlags of the mapping holding `p` (/proc/self/smaps), empty if none holds it.
std::string vm_flags(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2)
      inside = begin <= at && at < end;
    else if (inside && line.starts_with("VmFlags:"))
      return line;
  }
  return {};
}

// A fresh output of 32 MiB or more is advised onto transparent huge pages before it is populated
// (core/huge_pages.h), a smaller one is not: VmFlags "hg" (VM_HUGEPAGE) says so whatever the THP
// mode, where the kernel has THP at all.
TEST(CpuMath, FreshOutputsFrom32MiBOnAreAdvisedOntoHugePages) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  const auto advised = [](std::size_t bytes) {
    const FreshMapping out(bytes);
    EXPECT_NE(out.data, MAP_FAILED);
    const auto n = static_cast<std::int64_t>(bytes);
    EXPECT_TRUE(detail::cpu::output_write(2 * n, out.data, n).fresh);
    const std::string flags = vm_flags(static_cast<char*>(out.data) + bytes / 2);
    EXPECT_FALSE(flags.empty());
    return flags.find(" hg") != std::string::npos;
  };
  EXPECT_TRUE(advised(std::size_t{64} << 20));
  EXPECT_FALSE(advised(std::size_t{16} << 20));
}

// A kernel's second output follows its first (advise_second_output): fused_residual_add_rmsnorm
// into fresh y and r of 32 MiB each advises both.
TEST(CpuMath, ASecondFreshOutputIsAdvisedWithTheFirst) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  const std::int64_t rows = 4096, cols = 4096;  // 32 MiB of bf16
  const Tensor x = test::randn({rows, cols}, DType::BF16, 1),
               res = test::randn({rows, cols}, DType::BF16, 2),
               weight = test::randn({cols}, DType::BF16, 3);
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * 2;
  const FreshMapping y(bytes), r(bytes);
  fused_residual_add_rmsnorm(x, res, weight, TensorView(y.data, DType::BF16, {rows, cols}),
                             TensorView(r.data, DType::BF16, {rows, cols}), TensorView(), 1e-6);
  EXPECT_NE(vm_flags(static_cast<char*>(y.data) + bytes / 2).find(" hg"), std::string::npos);
  EXPECT_NE(vm_flags(static_cast<char*>(r.data) + bytes / 2).find(" hg"), std::string::npos);
}
#endif

}  // namespace
}  // namespace meshfuse
#endif  // HWY_ONCE
