// Measuring (docs/BENCHMARKING.md): timing a call (warm up, many calls, median and p20/p80), this
// machine's memory copy bandwidth and its last-level cache size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "meshfuse/core/device.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/testing.h"

namespace meshfuse::cli {

struct TimingPolicy {
  int warmup = 10;      // warm-up calls (fewer when they take longer than warmup_budget_s)
  int repeats = 20;     // timed calls (fewer when they take longer than budget_s)
  int min_repeats = 5;  // never fewer timed calls than this
  double warmup_budget_s = 0.5;
  double budget_s = 2.0;
  // GPU streams: calls per timed burst, about burst_ms of work (from the warm-up), at most
  // max_burst.
  double burst_ms = 1.0;
  int max_burst = 50;
};

struct Timing {
  double median_ms = 0;
  double p20_ms = 0;
  double p80_ms = 0;
  int calls = 0;  // timed samples
  int burst = 1;  // back-to-back calls per sample (GPU streams; 1 on the CPU)
};

// Times each function in `fns`, calling them interleaved (A B A B ...) so that they see the same
// machine state; each call is timed on its own with a StreamTimer on `stream` (the steady clock
// on the CPU, CUDA events on a GPU stream, where the functions queue their work; there a sample
// is a burst of back-to-back calls divided by their number). Returns one Timing per function.
std::vector<Timing> time_interleaved(const std::vector<std::function<void()>>& fns,
                                     const TimingPolicy& policy, const Stream& stream = {});

using testing::quantile;

// Bytes of the last-level cache that this process's CPUs (its affinity) reach: the instances of
// the highest cache level those CPUs have, each counted once; 0 when unknown.
std::int64_t last_level_cache_bytes();

// The same from a sysfs tree laid out as /sys/devices/system/cpu (cpuN/cache/indexM/{level, type,
// size, shared_cpu_list}) for the given CPUs; 0 when it has none.
std::int64_t last_level_cache_bytes(const std::filesystem::path& cpu_root,
                                    const std::vector<int>& cpus);

struct CopyBandwidth {
  double gbps = 0;                // (read + write bytes) / median time, in GB/s (1e9 B/s)
  std::int64_t buffer_bytes = 0;  // size of the source (and of the destination)
};

// STREAM-style copy: dst = src over buffers of max(1 GiB, 4 x the CPU's last-level cache), on the
// CPU split across the OpenMP threads (memcpy per thread), on a GPU one device-to-device copy;
// bytes counted as read + write, as STREAM counts them.
CopyBandwidth measure_copy_bandwidth(Device device);

}  // namespace meshfuse::cli
