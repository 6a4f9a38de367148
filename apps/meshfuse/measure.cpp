#include "measure.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse::cli {
namespace {

// Copies n bytes, each OpenMP thread its own contiguous slice.
void parallel_copy(char* dst, const char* src, std::int64_t n) {
#pragma omp parallel
  {
#ifdef _OPENMP
    const std::int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const std::int64_t threads = 1, t = 0;
#endif
    const std::int64_t begin = n * t / threads, end = n * (t + 1) / threads;
    std::memcpy(dst + begin, src + begin, static_cast<std::size_t>(end - begin));
  }
}

}  // namespace

std::vector<Timing> time_interleaved(const std::vector<std::function<void()>>& fns,
                                     const TimingPolicy& policy, const Stream& stream) {
  // Warm-up: caches, page faults of fresh outputs, thread pools. Heavy calls stop early; the
  // first round always runs.
  StreamTimer timer(stream);
  std::vector<double> warm_ms(fns.size(), 0);
  double warm_total = 0;
  for (int i = 0; i < policy.warmup; ++i) {
    for (std::size_t f = 0; f < fns.size(); ++f) {
      timer.start();
      fns[f]();
      warm_ms[f] = timer.stop();
      warm_total += warm_ms[f];
    }
    if (warm_total > 1e3 * policy.warmup_budget_s) break;
  }
  // On a GPU a sample is a burst of back-to-back calls (as a training step queues them), so the
  // host's per-call work overlaps the previous call's kernels instead of idling the GPU between
  // two events; a call is the burst / its length.
  std::vector<int> burst(fns.size(), 1);
  if (stream.device.type != DeviceType::CPU)
    for (std::size_t f = 0; f < fns.size(); ++f)
      burst[f] = static_cast<int>(std::clamp(policy.burst_ms / std::max(warm_ms[f], 1e-3), 1.0,
                                             static_cast<double>(policy.max_burst)));
  std::vector<std::vector<double>> samples(fns.size());
  double total_ms = 0;
  for (int i = 0; i < policy.repeats; ++i) {
    for (std::size_t f = 0; f < fns.size(); ++f) {
      timer.start();
      for (int b = 0; b < burst[f]; ++b) fns[f]();
      const double ms = timer.stop();
      samples[f].push_back(ms / burst[f]);
      total_ms += ms;
    }
    if (i + 1 >= policy.min_repeats && total_ms > 1e3 * policy.budget_s) break;
  }
  std::vector<Timing> out;
  for (std::size_t f = 0; f < fns.size(); ++f)
    out.push_back({quantile(samples[f], 0.5), quantile(samples[f], 0.2),
                   quantile(samples[f], 0.8), static_cast<int>(samples[f].size()), burst[f]});
  return out;
}

std::int64_t last_level_cache_bytes(const std::filesystem::path& cpu_root,
                                    const std::vector<int>& cpus) {
  // Per instance of the highest cache level seen (keyed by its id and CPUs): its size.
  int top_level = 0;
  std::map<std::string, std::int64_t> instances;
  for (int cpu : cpus) {
    std::error_code ec;
    const auto dir = cpu_root / ("cpu" + std::to_string(cpu)) / "cache";
    for (const auto& index : std::filesystem::directory_iterator(dir, ec)) {
      const auto read = [&](const char* name) {
        std::ifstream in(index.path() / name);
        std::string value;
        std::getline(in, value);
        return value;
      };
      if (read("type") == "Instruction") continue;
      const std::string level_text = read("level"), size_text = read("size");
      int level = 0;
      std::int64_t size = 0;
      char unit = 0;
      if (std::sscanf(level_text.c_str(), "%d", &level) != 1 ||
          std::sscanf(size_text.c_str(), "%" SCNd64 "%c", &size, &unit) < 1 || size <= 0)
        continue;
      if (unit == 'K') size <<= 10;
      if (unit == 'M') size <<= 20;
      if (level > top_level) {
        top_level = level;
        instances.clear();
      }
      // One instance per id (where sysfs gives one) and set of CPUs sharing it.
      if (level == top_level) instances[read("id") + "/" + read("shared_cpu_list")] = size;
    }
  }
  std::int64_t total = 0;
  for (const auto& [instance, size] : instances) total += size;
  return total;
}

std::int64_t last_level_cache_bytes() {
  // sysfs first: glibc's sysconf reads CPUID, which in some VMs reports the host's whole L3 (256
  // MiB on a 2-core Zen 2 guest whose sysfs and lscpu say 16 MiB).
#ifdef __linux__
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    std::vector<int> cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
    if (const std::int64_t bytes = last_level_cache_bytes("/sys/devices/system/cpu", cpus))
      return bytes;
  }
#endif
  for (int name : {_SC_LEVEL4_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long bytes = sysconf(name);
    if (bytes > 0) return bytes;
  }
  return 0;
}

CopyBandwidth measure_copy_bandwidth(Device device) {
  constexpr std::int64_t kGiB = std::int64_t{1} << 30;
  const std::int64_t n = std::max(kGiB, 4 * last_level_cache_bytes());
  TimingPolicy policy;
  policy.warmup = 2;
  policy.repeats = 7;
  policy.min_repeats = 3;
  policy.budget_s = 1.5;
  std::function<void()> copy_once;
  Tensor device_src, device_dst;
  if (device.type == DeviceType::CPU) {
    // Tensors: the same allocation (and pages) as the ops' operands.
    const Tensor src({n}, DType::U8), dst({n}, DType::U8);
    char* s = static_cast<char*>(src.view().data());
    char* d = static_cast<char*>(dst.view().data());
    // First touch from the threads that copy, so each slice's pages are faulted in before timing.
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; i += 4096) s[i] = d[i] = static_cast<char>(i);
    copy_once = [s, d, n, src, dst] { parallel_copy(d, s, n); };  // the Tensors: kept alive
  } else {
    device_src = Tensor::zeros({n}, DType::U8, device);
    device_dst = Tensor({n}, DType::U8, device);
    copy_once = [&] { copy(device_src, device_dst, Stream{device}); };
  }
  const Timing t = time_interleaved({copy_once}, policy, Stream{device})[0];
  return {2.0 * static_cast<double>(n) / (t.median_ms * 1e-3) / 1e9, n};
}

}  // namespace meshfuse::cli
