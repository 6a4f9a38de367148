#include "bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <ostream>
#include <set>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_cases/blas.h"
#include "bench_cases/case.h"
#include "measure.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/platform.h"
#include "meshfuse/core/stream.h"
#include "report.h"

namespace meshfuse::cli {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(sep, start), text.size());
    parts.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

// The options, checked and parsed.
struct Plan {
  BenchSetup setup;
  std::optional<KernelBackend> forced;  // empty for --backend auto
  std::vector<BenchCase> cases;
  std::map<std::string, std::string> backend_of;  // kernel -> backend that will run it
  std::vector<std::string> skipped;  // cases without a kernel for the backend (no --ops given)
  std::string format;
};

DType parse_bench_dtype(const std::string& name) {
  const std::optional<DType> dtype = parse_dtype(name);
  MESHFUSE_CHECK(dtype == DType::BF16 || dtype == DType::F16 || dtype == DType::F32,
                 ErrorCode::InvalidArgument, "--dtype: expected bf16, f16 or f32, got '{}'", name);
  return *dtype;
}

std::vector<BenchCase> select_cases(const std::string& ops) {
  std::vector<BenchCase> all = all_cases();
  if (ops.empty()) {
    std::erase_if(all, [](const BenchCase& c) { return !c.in_layer; });
    return all;
  }
  std::vector<std::string> names, groups;
  for (const BenchCase& c : all) {
    names.push_back(c.name);
    if (!c.group.empty() && std::find(groups.begin(), groups.end(), c.group) == groups.end())
      groups.push_back(c.group);
  }
  std::set<std::string> wanted;
  for (const std::string& op : split(ops, ',')) {
    const bool known = std::find(names.begin(), names.end(), op) != names.end() ||
                       std::find(groups.begin(), groups.end(), op) != groups.end();
    MESHFUSE_CHECK(known, ErrorCode::InvalidArgument,
                   "--ops: unknown op '{}'; expected a comma-separated list of: {} (or the "
                   "groups: {})",
                   op, fmt::join(names, ", "), fmt::join(groups, ", "));
    wanted.insert(op);
  }
  std::vector<BenchCase> selected;
  for (BenchCase& c : all)
    if (wanted.contains(c.name) || wanted.contains(c.group)) selected.push_back(std::move(c));
  return selected;
}

// Every kernel must run on this device, dtype and backend: fail now, with the op's own error,
// rather than after minutes of measuring. Without --ops, cases the backend has no kernel for are
// skipped (and listed); an error only when none is left.
void resolve_backends(Plan& plan, bool ops_named) {
  std::optional<ForceKernelBackend> guard;
  if (plan.forced) guard.emplace(*plan.forced);
  std::vector<BenchCase> runnable;
  std::optional<Error> first_error;
  for (BenchCase& c : plan.cases) {
    try {
      const TensorView probe(nullptr, c.kernel_dtype.value_or(plan.setup.dtype), {0},
                             plan.setup.device);
      for (const std::string& kernel : c.kernels)
        plan.backend_of[kernel] = to_string(resolved_backend(kernel, {{"input", probe}}));
      runnable.push_back(std::move(c));
    } catch (const Error& e) {
      const bool missing_kernel =
          e.code() == ErrorCode::BackendUnavailable || e.code() == ErrorCode::Unsupported;
      if (ops_named || !missing_kernel) throw;
      if (!first_error) first_error = e;
      plan.skipped.push_back(c.name);
    }
  }
  if (runnable.empty() && first_error) throw *first_error;
  plan.cases = std::move(runnable);
}

Plan make_plan(const BenchOptions& o) {
  Plan plan;
  MESHFUSE_CHECK(o.tokens > 0, ErrorCode::InvalidArgument,
                 "--tokens: expected a positive number of tokens, got {}", o.tokens);
  MESHFUSE_CHECK(o.seq_len >= 0, ErrorCode::InvalidArgument,
                 "--seq-len: expected a positive number of steps, got {}", o.seq_len);
  MESHFUSE_CHECK(o.repeats > 0, ErrorCode::InvalidArgument,
                 "--repeats: expected a positive number of timed calls, got {}", o.repeats);
  MESHFUSE_CHECK(o.format == "table" || o.format == "csv" || o.format == "json",
                 ErrorCode::InvalidArgument, "--format: expected table, csv or json, got '{}'",
                 o.format);
  plan.format = o.format;
  plan.setup.dtype = parse_bench_dtype(o.dtype);
  if (o.backend != "auto") plan.forced = parse_kernel_backend(o.backend);
  plan.setup.device = parse_bench_device(o.device);
  plan.cases = select_cases(o.ops);
  plan.setup.model = load_model_config(o.model);
  plan.setup.tokens = o.tokens;
  plan.setup.seq_len = o.seq_len;
  resolve_backends(plan, !o.ops.empty());
  return plan;
}

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

std::string bytes_text(double bytes) {
  return bytes >= 1024 * kMiB ? fmt::format("{:.2f} GiB", bytes / (1024 * kMiB))
                              : fmt::format("{:.1f} MiB", bytes / kMiB);
}

struct Peaks {
  CopyBandwidth copy;
  std::int64_t cache_bytes = 0;
};

// Times one direction (interleaved with its vendor GEMM, if any) and rates it.
Record time_direction(const Plan& plan, const Peaks& peaks, const std::string& op,
                      const Direction& d, const TimingPolicy& policy) {
  Record r{.op = op,
           .direction = d.direction,
           .backend = plan.backend_of.at(d.kernel),
           .device = plan.setup.device.str(),
           .dtype = std::string(to_string(plan.setup.dtype)),
           .shape = d.shape};
  std::vector<std::function<void()>> calls = {d.run};
  if (d.blas) calls.push_back(d.blas);  // interleaved with ours (docs/BENCHMARKING.md)
  // Ops run on the default stream of the tensors' device.
  const std::vector<Timing> t = time_interleaved(calls, policy, Stream{plan.setup.device});
  r.median_ms = t[0].median_ms;
  r.p20_ms = t[0].p20_ms;
  r.p80_ms = t[0].p80_ms;
  r.calls = t[0].calls;
  const double seconds = t[0].median_ms * 1e-3;
  if (d.bytes > 0) {
    r.gbps = d.bytes / seconds / 1e9;  // its fraction of the copy bandwidth is set at the end
    r.notes.push_back(fmt::format("bytes = {}", d.formula));
  }
  if (d.flops > 0) {
    r.tflops = d.flops / seconds / 1e12;
    r.notes.push_back(fmt::format("flops = {}", d.formula));
    if (d.blas) {
      r.fraction_of_peak = t[1].median_ms / t[0].median_ms;
      r.notes.push_back(fmt::format("{} at the same shape: {:.3f} TFLOP/s", vendor_gemm(),
                                    d.flops / (t[1].median_ms * 1e-3) / 1e12));
    }
  }
  if (d.steps > 0)
    r.notes.push_back(fmt::format("{:.2f} us per step ({} steps), {:.1f} KiB moved per step",
                                  t[0].median_ms * 1e3 / static_cast<double>(d.steps), d.steps,
                                  d.bytes / static_cast<double>(d.steps) / 1024));
  const double working_set = d.working_set > 0 ? d.working_set : d.bytes;
  if (working_set < static_cast<double>(peaks.cache_bytes))
    r.notes.push_back(fmt::format("working set {} < the {} last-level cache: a cache figure",
                                  bytes_text(working_set),
                                  bytes_text(static_cast<double>(peaks.cache_bytes))));
  r.notes.insert(r.notes.end(), d.notes.begin(), d.notes.end());
  return r;
}

// Runs the direction's reference check and records the errors and the verdict in r.
void check_direction(const Direction& d, Record& r) {
  r.pass = true;
  r.max_abs_err = 0;
  r.max_rel_err = 0;
  for (const Comparison& c : d.check()) {
    r.max_abs_err = std::max(*r.max_abs_err, c.diff.max_abs_err);
    r.max_rel_err = std::max(*r.max_rel_err, c.diff.max_rel_err);
    if (c.diff.violations == 0) continue;
    r.pass = false;
    r.notes.push_back(fmt::format(
        "FAILED {}: {} elements outside |ours - reference| <= {:.1e} + {:.1e}·|reference| ({} "
        "NaN/inf mismatches)",
        c.name, c.diff.violations, c.tolerance.atol, c.tolerance.rtol,
        c.diff.mismatched_nonfinite));
  }
}

std::string skipped_text(const Plan& plan) {
  return fmt::format(
      "skipped (no kernel for this backend, device and dtype; --ops names them to "
      "see the error): {}",
      fmt::join(plan.skipped, ", "));
}

std::vector<std::string> header_lines(const Plan& plan, const BenchOptions& o, const Peaks& peaks,
                                      const TimingPolicy& policy) {
  const ModelConfig& m = plan.setup.model;
  const double tol = testing::default_tolerance(plan.setup.dtype);
  std::vector<std::string> lines = {
      fmt::format("meshfuse {} bench: model {} ({}), {} tokens, dtype {}, device {}, backend {}, "
                  "{} threads",
                  version(), m.name, m.path.string(), plan.setup.tokens,
                  to_string(plan.setup.dtype), plan.setup.device.str(), o.backend, max_threads()),
      fmt::format("shapes: hidden {}, intermediate {}, heads {} (kv {}) x head_dim {}, vocab {}",
                  m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads,
                  m.head_dim, m.vocab_size),
      fmt::format("memory: copy bandwidth {:.1f} GB/s (STREAM-style copy of {}, read + write "
                  "bytes; the higher of two, before and after the ops); last-level cache {}",
                  peaks.copy.gbps, bytes_text(static_cast<double>(peaks.copy.buffer_bytes)),
                  bytes_text(static_cast<double>(peaks.cache_bytes))),
      fmt::format("timing: median (p20-p80) of up to {} samples after up to {} warm-up calls, "
                  "fewer for calls over {:.0f} ms (column 'calls' in csv/json); on a GPU a sample "
                  "is a burst of back-to-back calls (about {:g} ms, at most {}) / its length",
                  policy.repeats, policy.warmup, 1e3 * policy.budget_s / policy.repeats,
                  policy.burst_ms, policy.max_burst),
      fmt::format("of peak: memory-bound ops GB/s / copy bandwidth; GEMMs ours / {} at the same "
                  "shape, timed interleaved (16-bit GEMMs of the cpu backend widen to it)",
                  vendor_gemm()),
      fmt::format("check: against the reference backend on the same inputs; pass when every "
                  "|ours - reference| <= {:g}·m + {:g}·|reference| ({}), m the outputs' typical "
                  "size: 1, √k for sums of k products, 1/V for probabilities",
                  tol, tol, to_string(plan.setup.dtype))};
  if (!plan.skipped.empty()) lines.push_back(skipped_text(plan));
  return lines;
}

}  // namespace

int run_bench(const BenchOptions& options, std::ostream& out) {
  const Plan plan = make_plan(options);
  TimingPolicy policy;
  policy.repeats = options.repeats;

  const auto start = std::chrono::steady_clock::now();
  const auto seconds_since = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (!plan.skipped.empty()) fmt::print(stderr, "meshfuse bench: {}\n", skipped_text(plan));
  fmt::print(stderr, "meshfuse bench: measuring the memory copy bandwidth ...\n");
  // The CPU's last-level cache; for a GPU's L2 the CLI has no query (no cache notes there).
  const bool on_cpu = plan.setup.device.type == DeviceType::CPU;
  Peaks peaks{measure_copy_bandwidth(plan.setup.device), on_cpu ? last_level_cache_bytes() : 0};
  fmt::print(stderr, "  {:.1f} GB/s\n", peaks.copy.gbps);

  std::vector<Record> records;
  std::optional<ForceKernelBackend> guard;
  if (plan.forced) guard.emplace(*plan.forced);
  const std::size_t n = plan.cases.size();
  for (std::size_t i = 0; i < n; ++i) {
    const BenchCase& c = plan.cases[i];
    fmt::print(stderr, "[{}/{}] {}: preparing inputs\n", i + 1, n, c.name);
    for (Direction& d : c.make(plan.setup)) {
      fmt::print(stderr, "[{}/{}] {} {} {}: timing ...", i + 1, n, c.name, d.direction, d.shape);
      std::fflush(stderr);
      Record r = time_direction(plan, peaks, c.name, d, policy);
      d.blas = nullptr;  // frees the vendor GEMM's operands (GBs for the head) before the check
      fmt::print(stderr, " {:.3f} ms; checking ...", *r.median_ms);
      std::fflush(stderr);
      check_direction(d, r);
      fmt::print(stderr, " {} ({:.0f} s)\n", r.pass ? "pass" : "FAIL", seconds_since(start));
      records.push_back(std::move(r));
    }
  }

  // Measured again after the ops, the higher of the two taken: another tenant of the machine
  // slowing one measurement would otherwise inflate every fraction (a VM once gave 118%).
  fmt::print(stderr, "meshfuse bench: measuring the memory copy bandwidth again ...\n");
  peaks.copy.gbps = std::max(peaks.copy.gbps, measure_copy_bandwidth(plan.setup.device).gbps);
  fmt::print(stderr, "  {:.1f} GB/s (the higher of the two)\n", peaks.copy.gbps);
  for (Record& r : records)
    if (r.gbps && !r.fraction_of_peak) r.fraction_of_peak = *r.gbps / peaks.copy.gbps;

  if (plan.format == "json")
    print_json(out, records);
  else if (plan.format == "csv")
    print_csv(out, records);
  else
    print_table(out, header_lines(plan, options, peaks, policy), records);
  const auto failed =
      std::count_if(records.begin(), records.end(), [](const Record& r) { return !r.pass; });
  if (failed > 0)
    fmt::print(stderr, "meshfuse bench: {} of {} checks FAILED\n", failed, records.size());
  return failed > 0 ? 1 : 0;
}

Device parse_bench_device(const std::string& name) {
  const Device device = Device::parse(name);
  std::vector<std::string> available;
  for (const Device& d : available_devices()) {
    if (d == device) return device;
    available.push_back(d.str());
  }
  fail(ErrorCode::BackendUnavailable, "--device: device {} is not available{} (available: {})",
       device.str(), built_with_cuda() ? "" : ": this build has no cuda backend",
       fmt::join(available, ", "));
}

}  // namespace meshfuse::cli
