// The MultiDeviceExecutor's cost over calling an op directly: a one-op program (rmsnorm) on one
// rank against rmsnorm called with an output allocated the same way (a Tensor per call), on the
// CPU and, where there is one, a GPU. Host time per call: a round is `calls` calls back to back
// (on a GPU queued on one stream and synchronised once at the end), timed with the steady clock;
// the figure is the median over rounds, with p20 and p80, direct and executor interleaved round by
// round. Prints a table, or JSON with --json.
//
//   executor_overhead [--json] [--rounds R] [--calls C]
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "meshfuse/testing.h"

namespace {

using namespace meshfuse;
using testing::quantile;

struct Row {
  std::string device;
  Shape shape;
  double direct_us[3], executor_us[3];  // median, p20, p80 per call
};

Row measure(Device device, const Stream& stream, Shape shape, int rounds, int calls) {
  const std::int64_t h = shape.back();
  Program p;
  const Value x = p.define_tensor("x", shape, DType::BF16);
  const Value w = p.define_tensor("w", {h}, DType::BF16);
  p.add_output(p.rmsnorm(x, w, 1e-5));
  LocalWorld world(1);
  MultiDeviceExecutor executor(p, world.communicator(0));

  Tensor xs(shape, DType::BF16), ws({h}, DType::BF16);
  testing::fill_normal(xs, 1);
  testing::fill_normal(ws, 2);
  const Tensor xd = xs.to(device, stream), wd = ws.to(device, stream);
  const std::vector<TensorView> inputs{xd, wd};
  const auto direct = [&] {
    const Tensor y(shape, DType::BF16, device, stream);
    rmsnorm(xd, wd, y, {}, 1e-5, stream);
  };
  const auto through_executor = [&] { executor.run(inputs, stream); };
  const auto round = [&](const std::function<void()>& call) {
    return testing::host_us_per_call(call, calls, stream);
  };
  round(direct);  // warm-up: caches, the memory pool, the plan
  round(through_executor);
  std::vector<double> d, e;
  for (int r = 0; r < rounds; ++r) {
    d.push_back(round(direct));
    e.push_back(round(through_executor));
  }
  return {device.str(), shape,
          {quantile(d, 0.5), quantile(d, 0.2), quantile(d, 0.8)},
          {quantile(e, 0.5), quantile(e, 0.2), quantile(e, 0.8)}};
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int rounds = 15, calls = 200;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--calls") && i + 1 < argc) calls = std::atoi(argv[++i]);
    else {
      fmt::print(stderr, "usage: executor_overhead [--json] [--rounds R] [--calls C]\n");
      return 2;
    }
  }
  std::vector<Row> rows;
  for (const Shape& shape : {Shape{4, 4096}, Shape{4096, 4096}})
    rows.push_back(measure(Device{}, Stream{}, shape, rounds, calls));
  std::optional<CudaStream> cuda;
  if (cuda_device_count() > 0) {
    cuda.emplace(0);
    for (const Shape& shape : {Shape{4, 4096}, Shape{16384, 4096}})
      rows.push_back(measure(Device{DeviceType::CUDA, 0}, *cuda, shape, rounds, calls));
  }
  if (json) {
    std::vector<std::string> records;
    for (const Row& r : rows)
      records.push_back(fmt::format(
          R"({{"op": "rmsnorm", "dtype": "bf16", "device": "{}", "shape": [{}], "direct_us": {:.3f}, "direct_p20_us": {:.3f}, "direct_p80_us": {:.3f}, "executor_us": {:.3f}, "executor_p20_us": {:.3f}, "executor_p80_us": {:.3f}}})",
          r.device, fmt::join(r.shape, ", "), r.direct_us[0], r.direct_us[1], r.direct_us[2],
          r.executor_us[0], r.executor_us[1], r.executor_us[2]));
    fmt::print("[\n  {}\n]\n", fmt::join(records, ",\n  "));
    return 0;
  }
  fmt::print("rmsnorm bf16, one rank: host time per call, median [p20, p80] of {} rounds of {} "
             "calls\n",
             rounds, calls);
  fmt::print("{:<8} {:<14} {:>24} {:>24} {:>10} {:>8}\n", "device", "shape", "direct us",
             "executor us", "extra us", "extra");
  for (const Row& r : rows)
    fmt::print("{:<8} {:<14} {:>8.2f} [{:.2f}, {:.2f}] {:>8.2f} [{:.2f}, {:.2f}] {:>10.2f} {:>7.1f}%\n",
               r.device, shape_str(r.shape), r.direct_us[0], r.direct_us[1], r.direct_us[2],
               r.executor_us[0], r.executor_us[1], r.executor_us[2],
               r.executor_us[0] - r.direct_us[0],
               100 * (r.executor_us[0] - r.direct_us[0]) / r.direct_us[0]);
  return 0;
}
