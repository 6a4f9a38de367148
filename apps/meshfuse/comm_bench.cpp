#include "comm_bench.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cctype>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <vector>

#include "launch.h"
#include "measure.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::cli {
namespace {

struct Row {
  std::int64_t bytes = 0, count = 0;  // size (comm_bench.h) and elements of that buffer
  std::string backend;                // from the CommRecord of the timed calls
  double median_us = 0, p20_us = 0, p80_us = 0;
  double algbw = 0, busbw = 0;  // GB/s
};

// The nccl-tests bus bandwidth factor of `op` on n ranks.
double bus_factor(CommOp op, int n) {
  if (op == CommOp::Broadcast) return 1;
  const double ring = static_cast<double>(n - 1) / n;
  return op == CommOp::AllReduce ? 2 * ring : ring;
}

std::string_view bus_formula(CommOp op) {
  if (op == CommOp::AllReduce) return "busbw = algbw * 2(n-1)/n";
  if (op == CommOp::Broadcast) return "busbw = algbw";
  return "busbw = algbw * (n-1)/n";
}

CommOp parse_op(const std::string& name) {
  for (CommOp op : {CommOp::AllReduce, CommOp::AllGather, CommOp::ReduceScatter, CommOp::Broadcast,
                    CommOp::AllToAll})
    if (to_string(op) == name) return op;
  fail(ErrorCode::InvalidArgument,
       "--op: expected all_reduce, all_gather, reduce_scatter, broadcast or all_to_all, got '{}'",
       name);
}

struct Setup {
  CommunicatorBackend backend;
  CommOp op;
  DType dtype;
  std::int64_t min_bytes, max_bytes;
};

Setup check_options(const CommBenchOptions& o, const LaunchInfo& launch) {
  Setup s{};
  s.backend = command_backend(o.backend, launch, std::nullopt, "-n", o.nranks);
  s.op = parse_op(o.op);
  MESHFUSE_CHECK(o.dtype == "f32" || o.dtype == "bf16", ErrorCode::InvalidArgument,
                 "--dtype: expected f32 or bf16, got '{}'", o.dtype);
  s.dtype = o.dtype == "f32" ? DType::F32 : DType::BF16;
  s.min_bytes = parse_bytes(o.min_bytes, "--min-bytes");
  s.max_bytes = parse_bytes(o.max_bytes, "--max-bytes");
  MESHFUSE_CHECK(s.min_bytes <= s.max_bytes, ErrorCode::InvalidArgument,
                 "--min-bytes ({}) is larger than --max-bytes ({})", o.min_bytes, o.max_bytes);
  MESHFUSE_CHECK(o.iters >= 1, ErrorCode::InvalidArgument, "--iters: expected >= 1, got {}",
                 o.iters);
  MESHFUSE_CHECK(o.warmup >= 0, ErrorCode::InvalidArgument, "--warmup: expected >= 0, got {}",
                 o.warmup);
  MESHFUSE_CHECK(o.format == "table" || o.format == "csv" || o.format == "json",
                 ErrorCode::InvalidArgument, "--format: expected table, csv or json, got '{}'",
                 o.format);
  if (s.backend == CommunicatorBackend::Local)
    MESHFUSE_CHECK(o.nranks >= 0, ErrorCode::InvalidArgument,
                   "-n: expected a positive number of ranks, got {}", o.nranks);
  return s;
}

// One rank's run over every size; the rows hold the slowest rank's times.
std::vector<Row> bench_rank(Communicator& comm, const Setup& s, const CommBenchOptions& o,
                            Device device) {
  const bool cuda = device.type == DeviceType::CUDA;
  std::unique_ptr<CudaStream> cuda_stream;
  if (cuda) cuda_stream = std::make_unique<CudaStream>(device.index);
  const Stream stream = cuda ? cuda_stream->stream() : Stream{};
  comm.set_checks(o.check);

  const int n = comm.size();
  const std::int64_t element = static_cast<std::int64_t>(element_size(s.dtype));
  std::vector<Row> rows;
  std::vector<std::int64_t> tried;  // for the error when no size holds an element per rank
  for (std::int64_t target = s.min_bytes; target <= s.max_bytes; target *= 2) {
    tried.push_back(target);
    // Elements of the larger buffer, a multiple of n (nccl-tests rounds the same way).
    const std::int64_t count = target / element / n * n;
    if (count == 0) continue;
    const bool big_in = s.op != CommOp::AllGather, big_out = s.op != CommOp::ReduceScatter;
    const Tensor in = Tensor::zeros({big_in ? count : count / n}, s.dtype, device, stream);
    const bool in_place = s.op == CommOp::AllReduce || s.op == CommOp::Broadcast;
    const Tensor out =
        in_place ? in : Tensor::zeros({big_out ? count : count / n}, s.dtype, device, stream);
    const auto call = [&]() -> Work {
      switch (s.op) {
        case CommOp::AllReduce:
          return comm.all_reduce(in, ReduceOp::Sum, stream);
        case CommOp::AllGather:
          return comm.all_gather(in, out, stream);
        case CommOp::ReduceScatter:
          return comm.reduce_scatter(in, out, ReduceOp::Sum, stream);
        case CommOp::Broadcast:
          return comm.broadcast(in, 0, stream);
        default:
          return comm.all_to_all(in, out, {}, {}, stream);
      }
    };
    for (int i = 0; i < o.warmup; ++i) call().wait();

    StreamTimer timer(stream);
    Tensor samples({o.iters}, DType::F64);
    Row row;
    for (int i = 0; i < o.iters; ++i) {
      // On a GPU the barrier is not waited for: the stream starts the timer when the barrier
      // and the timer's hold complete, and the launch latency of the timed call stays out.
      Work barrier = comm.barrier(stream);
      if (!cuda) barrier.wait();
      timer.start();
      Work work = call();
      // On a GPU the end event goes in right behind the call (as with nccl-tests and torch.cuda
      // events): queued after a host-side wait, it would add the host's wake-up to every sample.
      if (!cuda) work.wait();
      samples.data_ptr<double>()[i] = timer.stop() * 1e3;  // us
      work.wait();
      row.backend = to_string(work.record().backend);
      row.bytes = work.record().bytes;
    }
    // The slowest rank's time of each iteration.
    const Tensor on_device = samples.to(device, stream);
    comm.all_reduce(on_device, ReduceOp::Max, stream).wait();
    copy(on_device, samples, stream);
    const std::vector<double> us(samples.data_ptr<double>(), samples.data_ptr<double>() + o.iters);
    row.count = count;
    row.median_us = quantile(us, 0.5);
    row.p20_us = quantile(us, 0.2);
    row.p80_us = quantile(us, 0.8);
    row.algbw = static_cast<double>(row.bytes) / (row.median_us * 1e3);  // B/us -> GB/s
    row.busbw = row.algbw * bus_factor(s.op, n);
    rows.push_back(row);
  }
  comm.barrier(stream).wait();
  MESHFUSE_CHECK(!rows.empty(), ErrorCode::InvalidArgument,
                 "comm-bench: no size tried (--min-bytes {} doubled up to --max-bytes {}: {} "
                 "bytes) holds an element of {} per rank ({} ranks need at least {} bytes)",
                 o.min_bytes, o.max_bytes, fmt::join(tried, ", "), o.dtype, n, n * element);
  return rows;
}

void print(std::ostream& out, const CommBenchOptions& o, const Setup& s, int n, Device device,
           const CopyBandwidth& copy_bw, const std::vector<Row>& rows) {
  const std::vector<std::string> columns{
      "op",        "backend", "device", "dtype",      "ranks",      "bytes",    "count",
      "median_us", "p20_us",  "p80_us", "algbw_gbps", "busbw_gbps", "copy_gbps"};
  const std::string op(to_string(s.op));
  if (o.format == "json") {
    nlohmann::ordered_json records = nlohmann::ordered_json::array();
    for (const Row& r : rows)
      records.push_back({{"op", op},
                         {"backend", r.backend},
                         {"device", device.str()},
                         {"dtype", o.dtype},
                         {"ranks", n},
                         {"bytes", r.bytes},
                         {"count", r.count},
                         {"median_us", r.median_us},
                         {"p20_us", r.p20_us},
                         {"p80_us", r.p80_us},
                         {"algbw_gbps", r.algbw},
                         {"busbw_gbps", r.busbw},
                         {"copy_gbps", copy_bw.gbps > 0 ? nlohmann::ordered_json(copy_bw.gbps)
                                                        : nlohmann::ordered_json()}});
    out << records.dump(2) << "\n";
    return;
  }
  if (o.format == "csv") {
    out << fmt::format("{}\n", fmt::join(columns, ","));
    for (const Row& r : rows)
      out << fmt::format("{},{},{},{},{},{},{},{:.3f},{:.3f},{:.3f},{:.4f},{:.4f},{}\n", op,
                         r.backend, device.str(), o.dtype, n, r.bytes, r.count, r.median_us,
                         r.p20_us, r.p80_us, r.algbw, r.busbw,
                         copy_bw.gbps > 0 ? fmt::format("{:.3f}", copy_bw.gbps) : "");
    return;
  }
  out << fmt::format(
      "comm-bench: {} {}, {} ranks on {} ({}), {} timed iterations after {} warm-up, a "
      "barrier before each{}\n",
      op, o.dtype, n, to_string(s.backend), device.str(), o.iters, o.warmup,
      o.check ? ", with the metadata check" : "");
  out << fmt::format(
      "time: the slowest rank's per iteration, median [p20, p80]; algbw = bytes / "
      "time; {} (nccl-tests); GB = 1e9 B\n",
      bus_formula(s.op));
  if (copy_bw.gbps > 0)
    out << fmt::format(
        "copy bandwidth ({}, STREAM-style, read + write, {} MiB buffers): {:.1f} GB/s\n",
        device.str(), copy_bw.buffer_bytes >> 20, copy_bw.gbps);
  out << fmt::format("{:>12} {:>11} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11}\n", "bytes", "count",
                     "backend", "median_us", "p20_us", "p80_us", "algbw_GB/s", "busbw_GB/s");
  for (const Row& r : rows)
    out << fmt::format("{:>12} {:>11} {:>8} {:>11.2f} {:>11.2f} {:>11.2f} {:>11.3f} {:>11.3f}\n",
                       r.bytes, r.count, r.backend, r.median_us, r.p20_us, r.p80_us, r.algbw,
                       r.busbw);
}

}  // namespace

std::int64_t parse_bytes(const std::string& text, const std::string& option) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit = text.substr(digits);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = -1;
  for (const auto& [names, bits] :
       std::vector<std::pair<std::vector<std::string>, int>>{{{"", "B"}, 0},
                                                             {{"K", "KB", "KIB"}, 10},
                                                             {{"M", "MB", "MIB"}, 20},
                                                             {{"G", "GB", "GIB"}, 30}})
    for (const std::string& name : names)
      if (unit == name) shift = bits;
  MESHFUSE_CHECK(digits > 0 && digits <= 12 && shift >= 0, ErrorCode::InvalidArgument,
                 "{}: expected a number of bytes such as 4096, 1K, 64M or 1G, got '{}'", option,
                 text);
  const std::int64_t bytes = std::stoll(text.substr(0, digits)) << shift;
  MESHFUSE_CHECK(bytes > 0, ErrorCode::InvalidArgument, "{}: expected at least 1 byte, got '{}'",
                 option, text);
  return bytes;
}

int run_comm_bench(const CommBenchOptions& options, std::ostream& out) {
  const LaunchInfo launch = launch_info_from_env();
  const Setup setup = check_options(options, launch);
  const bool cuda = setup.backend == CommunicatorBackend::Nccl;
  const Device device = cuda ? Device{DeviceType::CUDA, launch.cuda_device()} : Device{};
  // Measured by rank 0 before the ranks communicate, so that no waiting rank disturbs it.
  const CopyBandwidth copy_bw =
      launch.rank == 0 && options.copy_bandwidth ? measure_copy_bandwidth(device) : CopyBandwidth{};

  CommOptions comm_options;
  comm_options.backend = fmt::format("{}:{}", cuda ? "cuda" : "cpu", to_string(setup.backend));
  std::vector<Row> rows;
  int ranks = launch.world_size;
  if (setup.backend == CommunicatorBackend::Local) {
    ranks = options.nranks ? options.nranks : 2;
    comm_options.backend.clear();
    run_local(
        ranks,
        [&](Communicator& comm) {
          std::vector<Row> mine = bench_rank(comm, setup, options, device);
          if (comm.rank() == 0) rows = std::move(mine);
        },
        comm_options);
  } else {
    const std::shared_ptr<Communicator> comm = init_communicator(comm_options);
    rows = bench_rank(*comm, setup, options, device);
  }
  if (launch.rank == 0) print(out, options, setup, ranks, device, copy_bw, rows);
  return 0;
}

}  // namespace meshfuse::cli
