// Host time per call of the ops' C++ entries on a GPU, on tiny inputs (4 x 4096 bf16) where the
// kernels take a few microseconds and the host's work decides, against the floor of one launch (a
// kernel that does nothing, behind the same device guard and launch check). Each op also runs on
// no rows: its checks and dispatch without the launch. Outputs are allocated once: this is the
// library's share of a Python call's time (bench/python_overhead.py times the whole call).
// Rounds of `calls` calls on one stream, synchronised at the round's end; median [p20, p80].
//
//   op_overhead [--json] [--rounds R] [--calls C]
#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda/runtime.h"
#include "meshfuse/meshfuse.h"
#include "meshfuse/testing.h"

namespace {

using namespace meshfuse;

struct Row {
  std::string name;
  double us[3];  // median, p20, p80 per call
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int rounds = 15, calls = 2000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json"))
      json = true;
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc)
      rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--calls") && i + 1 < argc)
      calls = std::atoi(argv[++i]);
    else {
      fmt::print(stderr, "usage: op_overhead [--json] [--rounds R] [--calls C]\n");
      return 2;
    }
  }
  if (cuda_device_count() == 0) {
    fmt::print(stderr, "op_overhead: no CUDA device; nothing to measure\n");
    return 0;
  }
  const CudaStream stream(0);
  const Device gpu{DeviceType::CUDA, 0};
  const std::int64_t n = 4, h = 4096;
  const auto make = [&](Shape shape, DType dtype, std::uint64_t seed) {
    Tensor t(shape, dtype);
    if (dtype == DType::I64)
      testing::fill_uniform_int(t, seed, 0, h);
    else
      testing::fill_normal(t, seed);
    return t.to(gpu, stream);
  };
  const Tensor x = make({n, h}, DType::BF16, 1), w = make({h}, DType::BF16, 2),
               up = make({n, h}, DType::BF16, 3), labels = make({n}, DType::I64, 0);
  const Tensor y({n, h}, DType::BF16, gpu, stream), loss({}, DType::F32, gpu, stream);
  const TensorView x0 = x.view().narrow(0, 0, 0), y0 = y.view().narrow(0, 0, 0),
                   up0 = up.view().narrow(0, 0, 0), labels0 = labels.view().narrow(0, 0, 0);
  CrossEntropyOptions assert_options;
  assert_options.label_check = LabelCheck::DeviceAssert;

  const std::vector<std::pair<std::string, std::function<void()>>> cases{
      {"one launch (floor)", [&] { detail::cuda_hold(stream, 0); }},
      {"rmsnorm", [&] { rmsnorm(x, w, y, {}, 1e-5, stream); }},
      {"rmsnorm, 0 rows", [&] { rmsnorm(x0, w, y0, {}, 1e-5, stream); }},
      {"softmax", [&] { softmax(x, y, 1.0, stream); }},
      {"softmax, 0 rows", [&] { softmax(x0, y0, 1.0, stream); }},
      {"swiglu", [&] { swiglu(x, up, y, stream); }},
      {"swiglu, 0 rows", [&] { swiglu(x0, up0, y0, stream); }},
      {"cross_entropy (raise)", [&] { cross_entropy(x, labels, loss, {}, {}, stream); }},
      {"cross_entropy (device_assert)",
       [&] { cross_entropy(x, labels, loss, {}, assert_options, stream); }},
      {"cross_entropy, 0 rows", [&] { cross_entropy(x0, labels0, loss, {}, {}, stream); }},
  };
  const auto round = [&](const std::function<void()>& call) {
    return testing::host_us_per_call(call, calls, stream);
  };
  std::vector<std::vector<double>> samples(cases.size());
  for (const auto& c : cases) round(c.second);  // warm-up: plans, the memory pool
  for (int r = 0; r < rounds; ++r)  // interleaved, so a slow stretch of the host hits every case
    for (std::size_t i = 0; i < cases.size(); ++i) samples[i].push_back(round(cases[i].second));
  std::vector<Row> rows;
  for (std::size_t i = 0; i < cases.size(); ++i)
    rows.push_back({cases[i].first,
                    {testing::quantile(samples[i], 0.5), testing::quantile(samples[i], 0.2),
                     testing::quantile(samples[i], 0.8)}});

  if (json) {
    std::vector<std::string> records;
    for (const Row& r : rows)
      records.push_back(fmt::format(
          R"({{"op": "{}", "dtype": "bf16", "device": "cuda", "shape": [{}, {}], "us": {:.3f}, "p20_us": {:.3f}, "p80_us": {:.3f}, "per_floor": {:.3f}}})",
          r.name, n, h, r.us[0], r.us[1], r.us[2], r.us[0] / rows[0].us[0]));
    fmt::print("[\n  {}\n]\n", fmt::join(records, ",\n  "));
    return 0;
  }
  fmt::print(
      "C++ entry, {} x {} bf16 on a GPU: host us per call, median [p20, p80] of {} rounds "
      "of {} calls\n",
      n, h, rounds, calls);
  for (const Row& r : rows)
    fmt::print("{:<32} {:8.2f} [{:6.2f}, {:6.2f}] {:6.2f}x floor\n", r.name, r.us[0], r.us[1],
               r.us[2], r.us[0] / rows[0].us[0]);
  return 0;
}
