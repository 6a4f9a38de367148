// Transparent huge pages for large CPU buffers: meshfuse's own Tensors and the fresh outputs the
// cpu kernels are given (ops/cpu_math.h output_write). Streaming kernels take fewer TLB misses,
// and populating a fresh buffer takes one fault per huge page instead of one per base page
// (docs/kernels/common.md).
#pragma once

#include <cstddef>

namespace meshfuse::detail {

// Buffers from this size on are advised: glibc serves them from their own mappings (its mmap
// threshold stops rising at 32 MiB), so the advice leaves with the buffer instead of staying on
// heap memory that small allocations reuse.
inline constexpr std::size_t kMinHugePageBuffer = std::size_t{32} << 20;

// madvise(MADV_HUGEPAGE) on the whole huge pages (the system's size: 2 MiB on x86-64, larger on
// Arm64 kernels with 16 or 64 KiB pages) inside [p, p + bytes), for a buffer of at least
// kMinHugePageBuffer. Advice only: it never changes the contents, a failure is ignored, and with
// THP "never" (or prctl(PR_SET_THP_DISABLE) in the process) no huge page is given. No-op off
// Linux.
void advise_huge_pages(void* p, std::size_t bytes);

}  // namespace meshfuse::detail
