// Target-independent math and output helpers for the cpu backend (internal); the SIMD code is in
// cpu_simd-inl.h. glibc declares its vector
// expf (libmvec) only under -ffast-math, which would also break NaN/inf semantics; declared for
// `omp simd` by hand it measured no faster inside the kernels, although faster alone, so the
// kernels use the exp below (figures: docs/kernels/common.md).
#pragma once

#ifdef __linux__
#include <sys/mman.h>
#endif
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/huge_pages.h"
#include "ops/common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace meshfuse::detail::cpu {

// exp(r) for |r| <= ln2/2 as 1 + r + c2 r^2 + ... + c6 r^6 (Horner from c6): minimax for the
// relative error, 2.0e-9 (fitted by reweighted least squares at Chebyshev points). It replaced the
// degree-7 Taylor polynomial (6e-9): one multiply-add less, and the AVX-512 VExp within 1.06 ulp
// against 0.94 (every float in [-103, 88.7]).
inline constexpr std::array<float, 7> kExpPoly = {1.384365140e-03f,
                                                  8.374156430e-03f,
                                                  4.166800156e-02f,
                                                  1.666643173e-01f,
                                                  4.999999404e-01f,
                                                  1.0f,
                                                  1.0f};

// exp(x) in float, within 2 ulp of the correctly rounded value (subnormal results included);
// 0 for x <= -104 (true value below half the smallest subnormal), +inf past ln(FLT_MAX), NaN for
// NaN. Branch-free, so `#pragma omp simd` loops vectorise.
// Method: x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by kExpPoly, then two
// exact scalings by 2^(n/2) so that neither factor leaves the normal range. The range ends need no
// selects: x is clamped to [-104, 89], where the scalings themselves round to 0 (below -103.97) or
// overflow to inf (above ln(FLT_MAX)), and a NaN passes through the clamps. Selecting the range
// ends after the fact made GCC compute every value under masks: this form is ~30% fewer vector
// ops.
inline float vexp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;         // ln2 with 9 trailing zero bits
  constexpr float kLn2Lo = 1.428606765330187045e-06f;  // ln2 - kLn2Hi
  constexpr float kRound = 12582912.0f;                // 1.5 * 2^23: adding rounds to integer
  constexpr float kMin = -104.0f, kMax = 89.0f;        // n = round(x / ln2) stays in [-150, 128]
  float xc = x < kMin ? kMin : x;
  xc = xc > kMax ? kMax : xc;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (std::size_t i = 1; i < kExpPoly.size(); ++i) p = p * r + kExpPoly[i];
  // 2^k for an integer-valued float k in [-126, 127]: k + 127 sits in the low mantissa bits of
  // (k + kRound + 127); shifting by 23 moves it into the exponent field.
  const auto pow2 = [](float k) {
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(k + (kRound + 127.0f)) << 23);
  };
  const float n1 = (n * 0.5f + kRound) - kRound;
  return (p * pow2(n1)) * pow2(n - n1);
}

// Elements below which a pass (element-wise, or over rows) stays on the calling thread: waking the
// OpenMP team and waiting for it costs more than the work saved (far more when the cores are
// busy), as PyTorch's at::internal::GRAIN_SIZE. 4 x 4096 bf16 rows, as in decoding, ran faster on
// one thread in every row kernel (bench/python_overhead.py --device cpu).
inline constexpr std::int64_t kParallelMin = std::int64_t{1} << 15;

// Runs body() on the OpenMP team when `parallel`, else on the calling thread without entering a
// parallel region: libgomp ends even a region of one thread (`#pragma omp parallel if (false)`)
// on a barrier that wakes its waiters with a futex syscall, a good part of a tiny call's host time
// (PyTorch's at::parallel_for runs small work inline for the same reason). Inside a caller's own
// active region body still gets a region (of one thread, unless `parallel` and nested parallelism
// is on): there an orphaned `#pragma omp for` or omp_get_num_threads() in body would bind to the
// caller's team and split one call's work among the caller's threads.
template <typename F>
void parallel_if(bool parallel, F&& body) {
#ifdef _OPENMP  // (also included by targets built without OpenMP)
  if (parallel || omp_in_parallel()) {
#pragma omp parallel if (parallel)
    body();
    return;
  }
#endif
  body();
}

// The rows [begin, end) of the calling thread of a parallel_if region: contiguous, as
// schedule(static) would give, so that a thread can read ahead into its next row.
inline std::pair<std::int64_t, std::int64_t> thread_rows(std::int64_t rows) {
#ifdef _OPENMP
  const std::int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
  const std::int64_t threads = 1, t = 0;
#endif
  return {rows * t / threads, rows * (t + 1) / threads};
}

inline std::int64_t max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// A function of a 16-bit float (bf16 or f16) as a table of its value at each of the 65536
// arguments, indexed by the argument's bits: one gather (Lookup, cpu_simd-inl.h) in place of the
// arithmetic. For silu (an exp and a division) it is faster (gates touch a few thousand entries,
// which stay in L1); for the exp alone, inside the softmax and cross_entropy forward loops, it
// measured slower than VExp. An entry E is a float (256 KiB) or the bits of a FloatPair as one
// std::uint64_t (512 KiB; LookupPair: two values from one 64-bit gather, which reads the entries
// as what they are).
struct alignas(8) FloatPair {
  float first, second;
};
template <typename T, typename E = float>
class Table16 {
  static_assert(kSixteenBit<T>);

 public:
  // Entry i = f(the value whose bits are i), f taking a float.
  template <typename F>
  requires std::is_invocable_r_v<E, F&, float>
  explicit Table16(F&& f) : entries_(kSize) {
    for (int i = 0; i < kSize; ++i)
      entries_[i] = f(to_float(std::bit_cast<T>(static_cast<std::uint16_t>(i))));
  }
  const E& operator[](T x) const { return entries_[std::bit_cast<std::uint16_t>(x)]; }
  const E* data() const { return entries_.data(); }  // for gathers

 private:
  static constexpr int kSize = 1 << 16;
  std::vector<E> entries_;
};

// Non-temporal (streaming) stores for large outputs. An ordinary store first reads the line it
// writes (read for ownership), so a kernel reading k streams and writing one moves k + 2 of them;
// streaming stores skip that read, as memcpy does for large copies (the copy the bandwidth figures
// are measured with). GCC 12 ignores `omp simd nontemporal`, hence Highway's Stream
// (cpu_simd-inl.h). A thread's streaming stores are weakly ordered: it calls hwy::FlushStream()
// before other threads may read what it wrote.

// How a kernel touching `bytes` in all (inputs and outputs) writes its output `out` (`out_bytes`
// long), when that does not fit in the threads' L2 caches (the L2 caches, not the L3 a VM reports,
// shared with other tenants, are what streaming pays off past):
//   stream  the output's pages are mapped: streaming stores.
//   fresh   they are not yet (large mallocs are fresh mappings; PyTorch's CPU tensors are). The OS
//           zeroes each page into the cache on first touch, and a streaming store would then
//           evict that line and write it again: ordinary stores. From 32 MiB on it is first
//           advised onto transparent huge pages, as meshfuse's own Tensors are
//           (core/huge_pages.h): 512 times fewer faults, which took about half of a softmax into
//           a fresh PyTorch tensor. Then each thread faults its share in with one madvise
//           (populate_rows): a fault per page from inside a kernel cost more, most on AVX-512 in
//           a VM.
// mincore() tells whether the page in the middle of the output is mapped yet (the first may hold
// the allocator's header). Figures: docs/kernels/common.md.
struct OutputWrite {
  bool stream = false;
  bool fresh = false;
};
inline OutputWrite output_write(std::int64_t bytes, const void* out, std::int64_t out_bytes) {
  static const std::int64_t l2 = [] {
    long size = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
    size = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return std::int64_t{size > 0 ? size : 1 << 20};
  }();
  if (bytes <= l2 * max_threads()) return {};
#ifdef __linux__
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t mid =
      reinterpret_cast<std::uintptr_t>(out) + static_cast<std::uintptr_t>(out_bytes / 2);
  unsigned char mapped = 1;
  if (mincore(reinterpret_cast<void*>(mid & ~(page - 1)), 1, &mapped) == 0 && !(mapped & 1)) {
    advise_huge_pages(const_cast<void*>(out), static_cast<std::size_t>(out_bytes));
    return {false, true};
  }
#else
  (void)out, (void)out_bytes;
#endif
  return {true, false};
}

// In a kernel's parallel region, for a fresh output (output_write) of `rows` rows of `row_bytes`,
// `row_stride` bytes apart: the whole pages of this thread's share of the rows (thread_rows'
// split; an omp for's differs by a row at most) faulted in, writable, by
// madvise(MADV_POPULATE_WRITE), which leaves their contents as they are. Without it (Linux before
// 5.14, headers without MADV_POPULATE_WRITE, other systems) the kernels take the faults as they
// write.
inline void populate_rows(const OutputWrite& w, void* out, std::int64_t rows,
                          std::int64_t row_stride, std::int64_t row_bytes) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  if (!w.fresh || rows <= 0) return;
  static std::atomic<bool> unsupported{false};
  if (unsupported.load(std::memory_order_relaxed)) return;
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  // A share starts at the page holding its first row's start (the first share: the first whole
  // page), so that every whole page of the output is some thread's; the last ends at the last
  // row's end, not a stride past it (a strided output's next bytes are not its own).
  const auto [first, last] = thread_rows(rows);
  const auto base = reinterpret_cast<std::uintptr_t>(out);
  // The page holding the start of `row` (rows: the last row's end).
  const auto page_of = [&](std::int64_t row) {
    return (base + static_cast<std::uintptr_t>(row < rows ? row * row_stride
                                                          : (rows - 1) * row_stride + row_bytes)) &
           ~(page - 1);
  };
  const std::uintptr_t begin = first == 0 ? (base + page - 1) & ~(page - 1) : page_of(first);
  const std::uintptr_t end = page_of(last);
  if (end > begin &&
      madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0 &&
      errno == EINVAL)
    unsupported.store(true, std::memory_order_relaxed);
#else
  (void)w, (void)out, (void)rows, (void)row_stride, (void)row_bytes;
#endif
}

// A kernel's second output (`bytes` from `out`), allocated as its first, whose output_write
// decided `w`: advised onto huge pages as output_write advises the first when that is fresh.
inline void advise_second_output(const OutputWrite& w, void* out, std::int64_t bytes) {
  if (w.fresh) advise_huge_pages(out, static_cast<std::size_t>(bytes));
}

// The cache level StreamOut (cpu_simd-inl.h) brings the next rows to. L2 (prefetcht2) suits a
// kernel whose next pass reads its rows once more from cache with few operands (rmsnorm forward:
// prefetches into L1 competed with the streaming stores for fill buffers); kernels that read two or
// three rows ahead measured faster with L1 (softmax and swiglu backward).
enum class PrefetchTo { L1, L2 };

// Values per block of StreamOutBlocks (cpu_simd-inl.h): its L1 buffer's size.
inline constexpr std::int64_t kStreamOutBlock = 1024;

// Up to three rows to bring into cache while StreamOut writes (null entries are skipped).
template <typename T>
struct Prefetch {
  std::array<const char*, 3> rows{};
  int count = 0;
  PrefetchTo to;
  Prefetch(std::initializer_list<const T*> next, std::int64_t offset, PrefetchTo level)
      : to(level) {
    for (const T* p : next)
      if (p && count < 3) rows[count++] = reinterpret_cast<const char*>(p + offset);
  }
  void operator()(std::int64_t byte) const {
    for (int k = 0; k < count; ++k) {
      if (to == PrefetchTo::L2)
        __builtin_prefetch(rows[k] + byte, 0, 1);
      else
        __builtin_prefetch(rows[k] + byte, 0, 3);
    }
  }
};

// The f64 kernels use the libm exp: double loops are not the fast path.
inline double vexp(double x) { return std::exp(x); }

}  // namespace meshfuse::detail::cpu
