// `meshfuse bench`: every kernel of one transformer layer at a model's shapes, forward and
// backward, timed and checked against the `reference` backend.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include "meshfuse/core/device.h"

namespace meshfuse::cli {

// Tokens (rows) per call when --tokens is not given; see README "The CLI" for why.
inline constexpr std::int64_t kDefaultTokens = 512;

struct BenchOptions {
  std::string model;  // a shipped model name or the path of a config.json
  std::int64_t tokens = kDefaultTokens;
  std::int64_t seq_len = 0;    // 0: the recurrent and sequence cases' own default
  std::string dtype = "bf16";  // bf16 | f16 | f32
  std::string device = "cpu";
  std::string backend = "auto";  // auto (the device's) | reference | cpu | cuda
  std::string ops;               // comma-separated case or group names; empty: all
  std::string format = "table";  // table | csv | json
  int repeats = 20;              // timed calls per direction (fewer for slow calls)
};

// Runs the bench, printing the results to `out` and progress to stderr. Returns 0 when every
// check passes, 1 when one fails. Throws meshfuse::Error naming the option, what was expected and
// what came for a bad option, model config, device or backend, before running anything.
int run_bench(const BenchOptions& options, std::ostream& out);

// --device: "cpu" or "cuda[:N]", a device this build and machine have (BackendUnavailable
// otherwise, saying what is missing).
Device parse_bench_device(const std::string& name);

}  // namespace meshfuse::cli
