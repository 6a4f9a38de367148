// Communication overlapped with the GEMMs (exec/overlap.h), one tensor-parallel layer at a time, on
// ranks as threads of this process on the local backend (--device cuda: every rank on GPU 0, each
// with its own stream, the transfers on the copy engines), or with --backend NAME on the ranks of
// a launcher (meshfuse launch -n 2 -- overlap --backend nccl --device cuda: one GPU per rank):
//   ag_gemm  x [m, k] Shard(0), w [n, k] Shard(0): all_gather of x, then x w^T (column-parallel)
//   gemm_rs  x [m, k] Shard(1), w [n, k] Shard(1): x w^T on each rank's k, reduce_scatter to rows
// For each, the time per run (median [p20, p80] of --repeats; all ranks released together, the
// run over when the last is done, as ranks may share a device) with overlap none, collective
// (--chunks) and ring; comm alone and compute alone (rank 0's steps of a run without overlap,
// each timed with the stream synchronised, a communication from a barrier of the team), and the
// overlap efficiency max(comm, compute) / overlapped. Also the chunking cost on one device, no ranks: rank 0's GEMM
// as one call against chunks x ranks calls on row blocks. Prints a table, or JSON with --json.
//
//   overlap [--json] [--device cpu|cuda] [--backend local|NAME] [--spread] [--ranks D] [--m M]
//           [--k K] [--n N[,N...]] [--chunks S] [--repeats R] [--dtype bf16|f32]
// --spread: local ranks on CUDA one GPU each (rank r on GPU r % count).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "meshfuse/meshfuse.h"
#include "meshfuse/testing.h"

namespace {

using namespace meshfuse;
using testing::quantile;

struct Options {
  bool json = false;
  Device device{};
  std::string backend = "local";  // else a spec for init_communicator (the launcher's ranks)
  bool spread = false;            // local on CUDA: rank r on GPU r % count, not all on GPU 0
  int ranks = 2, chunks = 4, repeats = 10;
  std::int64_t m = 16384, k = 8192;
  std::vector<std::int64_t> n = {8192, 2048};
  DType dtype = DType::BF16;
};

struct Spread {
  double median = 0, p20 = 0, p80 = 0;
};
Spread spread(const std::vector<double>& v) {
  return {quantile(v, 0.5), quantile(v, 0.2), quantile(v, 0.8)};
}

struct Row {
  std::string layer, backend;
  std::int64_t n = 0;
  double comm = 0, compute = 0;  // medians, ms
  Spread none, collective, ring;
};

Program layer(const std::string& kind, const Options& o, std::int64_t n) {
  Program p;
  const Value x = p.define_tensor("x", {o.m, o.k}, o.dtype);
  const Value w = p.define_tensor("w", {n, o.k}, o.dtype);
  const Value y = p.linear(x, w);
  p.set_mesh(DeviceMesh::of_shape({o.ranks}));
  const std::int64_t dim = kind == "ag_gemm" ? 0 : 1;
  p.set_placements(x, {Shard{dim}});
  p.set_placements(w, {Shard{dim}});
  if (kind == "ag_gemm")
    p.add_output(y);
  else
    p.add_output(y, {Shard{0}});
  return p;
}

// One rank's part of a layer: times of each form; rank 0 fills `row`.
void run_rank(const std::shared_ptr<Communicator>& comm, const std::string& kind, std::int64_t n,
              const Options& o, Row* row) {
  Device device = o.device;
  if (o.spread && device.type == DeviceType::CUDA)
    device.index = comm->rank() % cuda_device_count();
  std::optional<CudaStream> cuda;
  if (device.type == DeviceType::CUDA) cuda.emplace(device.index);
  const Stream stream = cuda ? cuda->stream() : Stream{};
  const Program p = layer(kind, o, n);
  std::vector<Tensor> parts;
  MultiDeviceExecutor plain(p, comm);
  for (std::size_t i = 0; i < p.inputs().size(); ++i) {
    Tensor t(plain.plan(o.device.type).values[static_cast<std::size_t>(
                                                   plain.plan(o.device.type).inputs[i])]
                 .shape,
             o.dtype);
    testing::fill_normal(t, 10 * i + static_cast<std::uint64_t>(comm->rank()), 0.0,
                         i == 0 ? 1.0 : 0.02);
    parts.push_back(t.to(device, stream));
  }
  const std::vector<TensorView> views(parts.begin(), parts.end());
  const auto timed = [&](MultiDeviceExecutor& e) {
    std::vector<double> ms;
    for (int r = 0; r <= o.repeats; ++r) {
      synchronize(stream);
      comm->barrier(stream).wait();  // every rank starts together
      const auto start = std::chrono::steady_clock::now();
      e.run(views, stream);
      synchronize(stream);
      comm->barrier(stream).wait();  // until the last rank is done: ranks may share a device
      if (r > 0)
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count());
    }
    return ms;
  };
  MultiDeviceExecutorParams params;
  const std::vector<double> none = timed(plain);
  params.overlap = {Overlap::Collective, o.chunks, 2};
  MultiDeviceExecutor collective(p, comm, params);
  const std::vector<double> chunked = timed(collective);
  params.overlap = {Overlap::Ring, 0, 2};
  MultiDeviceExecutor ring(p, comm, params);
  const std::vector<double> rings = timed(ring);
  MultiDeviceExecutorParams profiled;
  profiled.profile = true;
  MultiDeviceExecutor steps(p, comm, profiled);
  std::vector<double> comm_ms, compute_ms;
  for (int r = 0; r <= o.repeats; ++r) {
    comm->barrier(stream).wait();
    steps.run(views, stream);
    if (r == 0) continue;
    double c = 0, g = 0;
    for (const StepProfile& s : steps.last_profile()) (s.communication ? c : g) += s.ms;
    comm_ms.push_back(c);
    compute_ms.push_back(g);
  }
  if (!row) return;
  *row = {kind,         std::string(to_string(comm->backend(o.device.type))),
          n,            quantile(comm_ms, 0.5),
          quantile(compute_ms, 0.5), spread(none),
          spread(chunked), spread(rings)};
}

// Rank 0's GEMM of ag_gemm on one device: one call, and chunks x ranks calls on row blocks.
std::pair<Spread, Spread> chunking_cost(const Options& o, std::int64_t n) {
  std::optional<CudaStream> cuda;
  if (o.device.type == DeviceType::CUDA) cuda.emplace(o.device.index);
  const Stream stream = cuda ? cuda->stream() : Stream{};
  const std::int64_t cols = (n + o.ranks - 1) / o.ranks, blocks = std::int64_t{o.chunks} * o.ranks;
  Tensor xh({o.m, o.k}, o.dtype), wh({cols, o.k}, o.dtype);
  testing::fill_normal(xh, 1);
  testing::fill_normal(wh, 2, 0.0, 0.02);
  const Tensor x = xh.to(o.device, stream), w = wh.to(o.device, stream);
  const Tensor y({o.m, cols}, o.dtype, o.device, stream);
  const auto time = [&](const std::function<void()>& f) {
    std::vector<double> ms;
    for (int r = 0; r <= o.repeats; ++r) {
      synchronize(stream);
      const auto start = std::chrono::steady_clock::now();
      f();
      synchronize(stream);
      if (r > 0)
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count());
    }
    return spread(ms);
  };
  const Spread one = time([&] { linear(x, w, {}, y, stream); });
  const Spread chunked = time([&] {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t first = o.m * b / blocks, rows = o.m * (b + 1) / blocks - first;
      linear(x.view().narrow(0, first, rows), w, {}, y.view().narrow(0, first, rows), stream);
    }
  });
  return {one, chunked};
}

std::vector<std::int64_t> numbers(const std::string& text) {
  std::vector<std::int64_t> v;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoll(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool value = i + 1 < argc;
    if (a == "--json") o.json = true;
    else if (a == "--device" && value) o.device = std::string(argv[++i]) == "cuda" ? Device{DeviceType::CUDA, 0} : Device{};
    else if (a == "--backend" && value) o.backend = argv[++i];
    else if (a == "--spread") o.spread = true;
    else if (a == "--ranks" && value) o.ranks = std::atoi(argv[++i]);
    else if (a == "--chunks" && value) o.chunks = std::atoi(argv[++i]);
    else if (a == "--repeats" && value) o.repeats = std::atoi(argv[++i]);
    else if (a == "--m" && value) o.m = std::atoll(argv[++i]);
    else if (a == "--k" && value) o.k = std::atoll(argv[++i]);
    else if (a == "--n" && value) o.n = numbers(argv[++i]);
    else if (a == "--dtype" && value) o.dtype = std::string(argv[++i]) == "f32" ? DType::F32 : DType::BF16;
    else {
      fmt::print(stderr,
                 "usage: overlap [--json] [--device cpu|cuda] [--backend local|NAME] [--spread] "
                 "[--ranks D] "
                 "[--m M] [--k K] [--n N[,N...]] [--chunks S] [--repeats R] [--dtype bf16|f32]\n");
      return 2;
    }
  }
  // With a launcher: this process's rank on the named backend, its GPU the local rank's.
  std::shared_ptr<Communicator> world;
  if (o.backend != "local") {
    CommOptions options;
    options.backend = o.backend;
    world = init_communicator(options);
    o.ranks = world->size();
    if (o.device.type == DeviceType::CUDA) o.device.index = launch_info_from_env().cuda_device();
  }
  const bool printer = !world || world->rank() == 0;
  std::vector<Row> rows;
  std::vector<std::pair<std::int64_t, std::pair<Spread, Spread>>> costs;
  for (const std::int64_t n : o.n) {
    if (printer) costs.emplace_back(n, chunking_cost(o, n));
    for (const std::string kind : {"ag_gemm", "gemm_rs"}) {
      Row row;
      if (world) {
        run_rank(world, kind, n, o, printer ? &row : nullptr);
      } else {
        run_local(o.ranks, [&](const std::shared_ptr<Communicator>& comm) {
          run_rank(comm, kind, n, o, comm->rank() == 0 ? &row : nullptr);
        });
      }
      rows.push_back(row);
    }
  }
  if (!printer) return 0;
  const auto eff = [](const Row& r, const Spread& s) {
    return std::max(r.comm, r.compute) / s.median;
  };
  const std::string dtype(to_string(o.dtype));
  if (o.json) {
    std::vector<std::string> records;
    for (const Row& r : rows)
      records.push_back(fmt::format(
          R"({{"layer": "{}", "device": "{}", "ranks": {}, "spread": {}, "backend": "{}", "dtype": "{}", "m": {}, "k": {}, "n": {}, "chunks": {}, "comm_ms": {:.4f}, "compute_ms": {:.4f}, "none_ms": {:.4f}, "none_p20_ms": {:.4f}, "none_p80_ms": {:.4f}, "collective_ms": {:.4f}, "collective_p20_ms": {:.4f}, "collective_p80_ms": {:.4f}, "ring_ms": {:.4f}, "ring_p20_ms": {:.4f}, "ring_p80_ms": {:.4f}, "collective_efficiency": {:.4f}, "ring_efficiency": {:.4f}}})",
          r.layer, o.device.str(), o.ranks, o.spread, r.backend, dtype, o.m, o.k, r.n, o.chunks, r.comm, r.compute,
          r.none.median, r.none.p20, r.none.p80, r.collective.median, r.collective.p20,
          r.collective.p80, r.ring.median, r.ring.p20, r.ring.p80, eff(r, r.collective),
          eff(r, r.ring)));
    for (const auto& [n, c] : costs)
      records.push_back(fmt::format(
          R"({{"layer": "chunked_gemm", "device": "{}", "ranks": {}, "dtype": "{}", "m": {}, "k": {}, "n": {}, "chunks": {}, "one_gemm_ms": {:.4f}, "one_gemm_p20_ms": {:.4f}, "one_gemm_p80_ms": {:.4f}, "chunked_ms": {:.4f}, "chunked_p20_ms": {:.4f}, "chunked_p80_ms": {:.4f}}})",
          o.device.str(), o.ranks, dtype, o.m, o.k, n, o.chunks, c.first.median, c.first.p20,
          c.first.p80, c.second.median, c.second.p20, c.second.p80));
    fmt::print("[\n  {}\n]\n", fmt::join(records, ",\n  "));
    return 0;
  }
  fmt::print("{} ranks on {} ({}), {}, m {} k {}; ms per run (to the last rank), median [p20, p80] of {}\n",
             o.ranks, rows.empty() ? o.backend : rows.front().backend, o.device.str(), dtype, o.m,
             o.k, o.repeats);
  fmt::print("{:<8} {:>6} {:>9} {:>9} {:>24} {:>24} {:>24} {:>6} {:>6}\n", "layer", "n", "comm",
             "compute", "none", fmt::format("collective ({})", o.chunks), "ring", "eff c",
             "eff r");
  for (const Row& r : rows)
    fmt::print("{:<8} {:>6} {:>9.3f} {:>9.3f} {:>8.3f} [{:.3f}, {:.3f}] {:>8.3f} [{:.3f}, {:.3f}] "
               "{:>8.3f} [{:.3f}, {:.3f}] {:>6.2f} {:>6.2f}\n",
               r.layer, r.n, r.comm, r.compute, r.none.median, r.none.p20, r.none.p80,
               r.collective.median, r.collective.p20, r.collective.p80, r.ring.median, r.ring.p20,
               r.ring.p80, eff(r, r.collective), eff(r, r.ring));
  for (const auto& [n, c] : costs)
    fmt::print("chunking cost, n {}: one GEMM {:.3f} ms, {} row blocks {:.3f} ms ({:+.1f}%)\n", n,
               c.first.median, std::int64_t{o.chunks} * o.ranks, c.second.median,
               100 * (c.second.median / c.first.median - 1));
  return 0;
}
