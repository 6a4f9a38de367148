#include "run.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <vector>

#include "bench.h"
#include "launch.h"
#include "measure.h"
#include "meshfuse/core/error.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/distributed/bootstrap.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/autodiff.h"
#include "meshfuse/exec/executor.h"
#include "meshfuse/testing.h"
#include "model_config.h"

namespace meshfuse::cli {
namespace {

struct Setup {
  ModelConfig model;
  LaunchInfo launch;
  CommunicatorBackend backend = CommunicatorBackend::Local;
  Device device;
  DType dtype = DType::BF16;
  std::int64_t tokens = 0;
  int ranks = 1;
  OverlapParams overlap;
};

Setup check_options(const RunOptions& o) {
  Setup s;
  s.launch = launch_info_from_env();
  s.model = load_model_config(o.model);
  s.device = parse_bench_device(o.device);
  s.backend = command_backend(o.backend, s.launch, s.device.type, "--ranks", o.ranks);
  const bool cuda = s.device.type == DeviceType::CUDA;
  if (cuda && s.launch.world_size > 1) s.device.index = s.launch.cuda_device();
  MESHFUSE_CHECK(o.dtype == "bf16" || o.dtype == "f32", ErrorCode::InvalidArgument,
                 "--dtype: expected bf16 or f32, got '{}'", o.dtype);
  s.dtype = o.dtype == "f32" ? DType::F32 : DType::BF16;
  s.tokens = o.tokens ? o.tokens : cuda ? 4096 : 256;
  MESHFUSE_CHECK(s.tokens >= 1, ErrorCode::InvalidArgument, "--tokens: expected >= 1, got {}",
                 s.tokens);
  MESHFUSE_CHECK(o.repeats >= 1, ErrorCode::InvalidArgument, "--repeats: expected >= 1, got {}",
                 o.repeats);
  MESHFUSE_CHECK(o.format == "table" || o.format == "json", ErrorCode::InvalidArgument,
                 "--format: expected table or json, got '{}'", o.format);
  s.overlap = {parse_overlap(o.overlap), o.chunks, o.streams};
  MESHFUSE_CHECK(o.chunks >= 0, ErrorCode::InvalidArgument, "--chunks: expected >= 0, got {}",
                 o.chunks);
  MESHFUSE_CHECK(o.streams >= 1, ErrorCode::InvalidArgument, "--streams: expected >= 1, got {}",
                 o.streams);
  MESHFUSE_CHECK(o.chunks == 0 || s.overlap.overlap == Overlap::Collective,
                 ErrorCode::InvalidArgument,
                 "--chunks {}: only --overlap collective takes chunks (ring moves one part per "
                 "rank), got --overlap {}",
                 o.chunks, o.overlap);
  if (s.backend == CommunicatorBackend::Local) {
    MESHFUSE_CHECK(!cuda || cuda_device_count() > 0, ErrorCode::BackendUnavailable,
                   "--device {}: this machine has no CUDA device", o.device);
    MESHFUSE_CHECK(o.ranks >= 0, ErrorCode::InvalidArgument,
                   "--ranks: expected a positive number, got {}", o.ranks);
    s.ranks = o.ranks ? o.ranks : 4;
  } else {
    s.ranks = s.launch.world_size;  // command_backend checked --ranks against it
  }
  return s;
}

// What the program's outputs are, in order: the forward's, then the gradients of `kWrt`.
const std::vector<std::string> kWrt = {"x",          "norm_weight", "gate_weight",
                                       "up_weight",  "down_weight", "head_norm_weight",
                                       "head_weight"};

Program build(const Setup& s, bool sharded) {
  const ModelConfig& m = s.model;
  const std::int64_t t = s.tokens, h = m.hidden_size, i = m.intermediate_size, v = m.vocab_size;
  Program p;
  const Value x = p.define_tensor("x", {t, h}, s.dtype);
  const Value norm = p.define_tensor("norm_weight", {h}, s.dtype);
  const Value gate = p.define_tensor("gate_weight", {i, h}, s.dtype);
  const Value up = p.define_tensor("up_weight", {i, h}, s.dtype);
  const Value down = p.define_tensor("down_weight", {h, i}, s.dtype);
  const Value head_norm = p.define_tensor("head_norm_weight", {h}, s.dtype);
  const Value head = p.define_tensor("head_weight", {v, h}, s.dtype);
  const Value labels = p.define_tensor("labels", {t}, DType::I64);
  const Value hidden = p.rmsnorm(x, norm, m.rms_norm_eps);
  const Value gated = p.linear(hidden, gate);
  const Value a = p.swiglu(gated, p.linear(hidden, up));
  const Value y = p.add(x, p.linear(a, down));
  // Vocabulary-parallel: each rank's rows of the head weight, its columns of the logits.
  const Value loss = p.fused_linear_cross_entropy(p.rmsnorm(y, head_norm, m.rms_norm_eps), head, {},
                                                  labels, {}, DType::F32);
  p.add_output(loss);
  if (sharded) {
    p.set_mesh(DeviceMesh::of_shape({s.ranks}));
    for (const Value v_ : {x, gate, up, head, labels}) p.set_placements(v_, {Shard{0}});
    p.set_placements(down, {Shard{1}});
    p.add_output(y, {Shard{0}});
  } else {
    p.add_output(y);
  }
  return grad(p, loss, {x, norm, gate, up, down, head_norm, head});
}

// The inputs whole, the same on every rank: activations normal(0, 1), weights normal(0, 0.02),
// norm weights 1, labels uniform over the vocabulary, the loss's upstream 1.
std::vector<Tensor> whole_inputs(const Program& p) {
  std::vector<Tensor> inputs;
  for (std::size_t i = 0; i < p.inputs().size(); ++i) {
    const ValueInfo& info = p.info(p.inputs()[i]);
    Tensor t(info.shape, info.dtype);
    if (info.name == "labels") {
      testing::fill_uniform_int(t, 7 + i, 0, p.info(p.inputs()[6]).shape[0]);
    } else if (info.name == "grad_loss" || info.name.find("norm") != std::string::npos) {
      fill(t, 1.0);
    } else {
      // In blocks of rows, each with its own seed, on every core: a vocabulary-sized weight is
      // hundreds of millions of values.
      const std::int64_t rows = info.shape[0], block = 256;
      const double std = info.name == "x" ? 1.0 : 0.02;
#pragma omp parallel for schedule(dynamic)
      for (std::int64_t r = 0; r < rows; r += block)
        testing::fill_normal(t.view().narrow(0, r, std::min(block, rows - r)),
                             (7 + i) * 1000003 + static_cast<std::uint64_t>(r), 0.0, std);
    }
    inputs.push_back(std::move(t));
  }
  return inputs;
}

std::vector<std::string> output_names() {
  std::vector<std::string> names{"loss", "y"};
  for (const std::string& w : kWrt) names.push_back("grad " + w);
  return names;
}

struct Collective {
  std::string what;
  std::int64_t bytes = 0;
  std::vector<double> ms;  // one per timed run
};

// One overlapped stretch of the plan: its steps' times without overlap, and its time overlapped.
struct Layer {
  std::string what;
  std::vector<double> comm_ms, compute_ms, overlapped_ms;  // one per timed run
};

struct Check {
  std::string name;
  double max_abs_err = 0, normwise_err = 0;
  bool pass = false;
};

// What rank 0 reports.
struct Report {
  std::vector<Timing> ranks;    // per rank: the whole run
  std::vector<double> comm_ms;  // per rank: median time in communication
  Timing single;
  std::vector<Collective> collectives;
  std::vector<Layer> layers;
  std::vector<Check> checks;
  std::string plan;
  std::size_t compute_steps = 0;
};

// `actual` against `expected` (contiguous CPU tensors of one shape), normwise, in chunks of
// doubles: whole double copies of a vocabulary-sized gradient would cost more than the run.
Check check(const std::string& name, const Tensor& actual, const Tensor& expected, double tol) {
  constexpr std::int64_t kChunk = std::int64_t{1} << 20;
  const std::int64_t n = expected.numel();
  const TensorView a = actual.view().reshape({n}), e = expected.view().reshape({n});
  Tensor a64({std::min(n, kChunk)}, DType::F64), e64({std::min(n, kChunk)}, DType::F64);
  double max_err = 0, max_value = 0;
  bool finite = true;
  for (std::int64_t begin = 0; begin < n; begin += kChunk) {
    const std::int64_t len = std::min(kChunk, n - begin);
    copy(a.narrow(0, begin, len), a64.view().narrow(0, 0, len));
    copy(e.narrow(0, begin, len), e64.view().narrow(0, 0, len));
    for (std::int64_t k = 0; k < len; ++k) {
      const double x = a64.data_ptr<double>()[k], y = e64.data_ptr<double>()[k];
      finite = finite && std::isfinite(x) && std::isfinite(y);
      max_err = std::max(max_err, std::abs(x - y));
      max_value = std::max(max_value, std::abs(y));
    }
  }
  const double normwise = max_value > 0 ? max_err / max_value : max_err;
  return {name, max_err, normwise, finite && normwise <= tol};
}

Timing timing_of(std::vector<double> ms) {
  return {quantile(ms, 0.5), quantile(ms, 0.2), quantile(ms, 0.8), static_cast<int>(ms.size()), 1};
}

// A CPU copy of `t`, queued on `stream` when `t` is on a GPU.
Tensor to_host(const TensorView& t, const Stream& stream) {
  Tensor host(t.shape(), t.dtype());
  copy(t, host, stream);
  return host;
}

// Copies `t` to `device` (or returns it when it is there).
Tensor on(const Tensor& t, Device device, const Stream& stream) {
  return t.device() == device ? t : t.to(device, stream);
}

// One rank's part of the run; `whole` are the inputs whole, on the CPU (shared by the threads of a
// local run).
void run_rank(const std::shared_ptr<Communicator>& comm, const Setup& s, const RunOptions& o,
              const std::vector<Tensor>& whole, const Stream& stream, Report* report) {
  const int rank = comm->rank(), n = comm->size();
  const Program sharded = build(s, true);
  MultiDeviceExecutorParams params;
  params.lowering.communicator_backend = s.backend;
  params.profile = true;
  params.overlap = s.overlap;
  MultiDeviceExecutor executor(sharded, comm, params);
  const Plan& plan = executor.plan(s.device.type);
  std::vector<Tensor> parts;
  for (std::size_t i = 0; i < whole.size(); ++i) {
    std::vector<Placement> pl = sharded.placements(sharded.inputs()[i]);
    if (pl.empty()) pl = {Replicate{}};
    parts.push_back(on(shard_tensor(whole[i], *sharded.mesh(), pl, rank), s.device, stream));
  }
  const std::vector<TensorView> views(parts.begin(), parts.end());

  std::vector<double> run_ms, comm_ms;
  std::vector<Collective> collectives;
  std::vector<Tensor> out;
  for (int r = 0; r <= o.repeats; ++r) {
    synchronize(stream);
    const auto start = std::chrono::steady_clock::now();
    out = executor.run(views, stream);
    synchronize(stream);
    if (r == 0) continue;  // the warm-up
    run_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
    double in_comm = 0;
    std::size_t c = 0;
    for (const StepProfile& step : executor.last_profile()) {
      if (!step.communication) continue;
      in_comm += step.ms;
      if (collectives.size() <= c)
        collectives.push_back(
            {std::get<Communication>(plan.steps[static_cast<std::size_t>(step.step)]).to_string(),
             step.bytes,
             {}});
      collectives[c++].ms.push_back(step.ms);
    }
    comm_ms.push_back(in_comm);
  }

  // Each overlapped stretch: its time as one step here, and its steps' times without overlap.
  std::vector<Layer> layers;
  if (s.overlap.overlap != Overlap::None) {
    for (const OverlapSegment& seg : find_overlap_segments(plan, s.overlap))
      layers.push_back({seg.to_string(), {}, {}, {}});
    MultiDeviceExecutorParams plain = params;
    plain.overlap = {};
    MultiDeviceExecutor sequential(sharded, comm, plain);
    for (int r = 0; r <= o.repeats; ++r) {
      out = executor.run(views, stream);
      sequential.run(views, stream);
      if (r == 0) continue;
      std::size_t k = 0;
      for (const StepProfile& step : executor.last_profile())
        if (step.overlapped_to >= 0) layers[k++].overlapped_ms.push_back(step.ms);
      k = 0;
      const std::vector<StepProfile>& steps = sequential.last_profile();
      for (const OverlapSegment& seg : find_overlap_segments(plan, s.overlap)) {
        double comm_ms = 0, compute_ms = 0;
        for (std::int64_t st = seg.first; st <= seg.last; ++st)
          (steps[static_cast<std::size_t>(st)].communication ? comm_ms : compute_ms) +=
              steps[static_cast<std::size_t>(st)].ms;
        layers[k].comm_ms.push_back(comm_ms);
        layers[k++].compute_ms.push_back(compute_ms);
      }
    }
  }

  // Every rank's median times, through the executor's own device and backend.
  Tensor mine({1, 2}, DType::F64);
  mine.data_ptr<double>()[0] = quantile(run_ms, 0.5);
  mine.data_ptr<double>()[1] = quantile(comm_ms, 0.5);
  const Tensor all_device(Shape{n, 2}, DType::F64, s.device, stream);
  std::shared_ptr<Communicator> timing_comm =
      comm->spec().backends.count(s.device.type) && comm->backend(s.device.type) == s.backend
          ? comm
          : comm->with_backends(BackendSpec{{{s.device.type, s.backend}}});
  if (n > 1) {
    timing_comm->all_gather(on(mine, s.device, stream), all_device, stream).wait();
  } else {
    copy(mine, all_device, stream);
  }
  const Tensor all = to_host(all_device, stream);

  // Every output whole, on every rank; rank 0 checks them.
  std::vector<Tensor> gathered;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const PlanValue& v = plan.values[static_cast<std::size_t>(plan.outputs[i])];
    gathered.push_back(to_host(gather_tensor(out[i], sharded.info(sharded.outputs()[i]).shape,
                                             *sharded.mesh(), v.placements, comm, stream),
                               stream));
  }
  if (rank != 0) return;

  const Program single = build(s, false);
  std::vector<Tensor> single_inputs;
  for (const Tensor& t : whole) single_inputs.push_back(on(t, s.device, stream));
  MultiDeviceExecutor one(single, comm);
  std::vector<double> single_ms;
  std::vector<Tensor> expected;
  for (int r = 0; r <= o.repeats; ++r) {
    synchronize(stream);
    const auto start = std::chrono::steady_clock::now();
    expected = one.run({single_inputs.begin(), single_inputs.end()}, stream);
    synchronize(stream);
    if (r > 0)
      single_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
  }
  report->single = timing_of(single_ms);
  const double tol = s.dtype == DType::F32 ? 1e-4 : 2e-2;
  const std::vector<std::string> names = output_names();
  for (std::size_t i = 0; i < gathered.size(); ++i) {
    report->checks.push_back(check(names[i], gathered[i], to_host(expected[i], stream), tol));
  }
  for (int r = 0; r < n; ++r) {
    report->ranks.push_back(timing_of({all.data_ptr<double>()[2 * r]}));
    report->comm_ms.push_back(all.data_ptr<double>()[2 * r + 1]);
  }
  // Rank 0's own spread.
  report->ranks[0] = timing_of(run_ms);
  report->collectives = std::move(collectives);
  report->layers = std::move(layers);
  report->plan = plan.to_string();
  report->compute_steps = static_cast<std::size_t>(
      std::count_if(plan.steps.begin(), plan.steps.end(),
                    [](const PlanStep& st) { return std::holds_alternative<Compute>(st); }));
}

// A stretch's medians.
struct LayerTimes {
  double comm = 0, compute = 0, overlapped = 0;
  double efficiency() const { return overlapped > 0 ? std::max(comm, compute) / overlapped : 0; }
};

LayerTimes times_of(const Layer& l) {
  return {quantile(l.comm_ms, 0.5), quantile(l.compute_ms, 0.5), quantile(l.overlapped_ms, 0.5)};
}

void print(std::ostream& out, const RunOptions& o, const Setup& s, const Report& r) {
  const double per_rank = r.ranks.empty() ? 0 : r.ranks[0].median_ms;
  const double efficiency = per_rank > 0 ? r.single.median_ms / (s.ranks * per_rank) : 0;
  const bool pass =
      std::all_of(r.checks.begin(), r.checks.end(), [](const Check& c) { return c.pass; });
  if (o.format == "json") {
    nlohmann::ordered_json j;
    j["model"] = s.model.name;
    j["tokens"] = s.tokens;
    j["dtype"] = o.dtype;
    j["device"] = s.device.str();
    j["backend"] = std::string(to_string(s.backend));
    j["ranks"] = s.ranks;
    j["repeats"] = o.repeats;
    for (std::size_t k = 0; k < r.ranks.size(); ++k)
      j["per_rank"].push_back(
          {{"rank", k}, {"median_ms", r.ranks[k].median_ms}, {"comm_ms", r.comm_ms[k]}});
    j["single_device_ms"] = r.single.median_ms;
    j["scaling_efficiency"] = efficiency;
    for (const Collective& c : r.collectives)
      j["collectives"].push_back(
          {{"communication", c.what}, {"bytes", c.bytes}, {"median_ms", quantile(c.ms, 0.5)}});
    j["overlap"] = {{"form", std::string(to_string(s.overlap.overlap))},
                    // As the table: the default (0) is one chunk per rank; none has none.
                    {"chunks", s.overlap.overlap == Overlap::None ? 0
                               : s.overlap.chunks                 ? s.overlap.chunks
                                                                  : s.ranks},
                    {"streams", s.overlap.number_of_streams}};
    j["layers"] = nlohmann::json::array();  // empty: no stretch to overlap in this plan
    for (const Layer& l : r.layers) {
      const LayerTimes t = times_of(l);
      j["layers"].push_back({{"stretch", l.what},
                             {"comm_ms", t.comm},
                             {"compute_ms", t.compute},
                             {"sequential_ms", t.comm + t.compute},
                             {"overlapped_ms", t.overlapped},
                             {"overlap_efficiency", t.efficiency()}});
    }
    for (const Check& c : r.checks)
      j["checks"].push_back({{"output", c.name},
                             {"max_abs_err", c.max_abs_err},
                             {"normwise_err", c.normwise_err},
                             {"pass", c.pass}});
    j["pass"] = pass;
    if (o.dump_plan) j["plan"] = r.plan;  // rank 0's, as text
    out << j.dump(2) << "\n";
    return;
  }
  out << fmt::format(
      "meshfuse run: {} MLP block (tensor + sequence parallel) and head (vocabulary parallel), {} "
      "tokens, {}, {} rank(s) on {} ({}), forward + backward, {} timed runs after a warm-up\n",
      s.model.name, s.tokens, o.dtype, s.ranks, to_string(s.backend), s.device.str(), o.repeats);
  if (o.dump_plan) out << r.plan;  // headed "plan of rank 0 on <mesh>, ..."
  out << fmt::format("plan: {} compute steps, {} communications (--dump-plan prints them)\n",
                     r.compute_steps, r.collectives.size());
  out << fmt::format("{:>6} {:>12} {:>12} {:>8}\n", "rank", "median ms", "comm ms", "comm %");
  for (std::size_t k = 0; k < r.ranks.size(); ++k)
    out << fmt::format("{:>6} {:>12.2f} {:>12.2f} {:>7.1f}%\n", k, r.ranks[k].median_ms,
                       r.comm_ms[k],
                       r.ranks[k].median_ms > 0 ? 100 * r.comm_ms[k] / r.ranks[k].median_ms : 0);
  out << fmt::format(
      "rank 0: {:.2f} ms [p20 {:.2f}, p80 {:.2f}]; one device: {:.2f} ms; scaling efficiency "
      "(one device / ({} x per rank)): {:.2f}\n",
      r.ranks[0].median_ms, r.ranks[0].p20_ms, r.ranks[0].p80_ms, r.single.median_ms, s.ranks,
      efficiency);
  out << fmt::format(
      "collectives of rank 0 (each run; times with the stream synchronised around them{}):\n",
      r.layers.empty() ? "" : "; those inside an overlapped stretch are timed with it below");
  for (const Collective& c : r.collectives)
    out << fmt::format("  {:>12} B {:>9.3f} ms  {}\n", c.bytes, quantile(c.ms, 0.5), c.what);
  if (r.layers.empty() && s.overlap.overlap != Overlap::None)
    out << fmt::format(
        "overlap {}: the plan has no stretch to overlap (no all_gather over tokens before a "
        "GEMM, nor a reduce_scatter after one; --dump-plan shows what the lowering chose)\n",
        to_string(s.overlap.overlap));
  if (!r.layers.empty()) {
    out << fmt::format(
        "overlap {} ({} chunks, {} streams): each stretch's comm and compute alone (without "
        "overlap, steps timed one by one), their sum, the stretch overlapped, and max(comm, "
        "compute) / overlapped:\n",
        to_string(s.overlap.overlap), s.overlap.chunks ? s.overlap.chunks : s.ranks,
        s.overlap.number_of_streams);
    out << fmt::format("  {:>10} {:>10} {:>10} {:>10} {:>6}  {}\n", "comm ms", "compute ms",
                       "sequential", "overlapped", "eff.", "stretch");
    bool above_one = false;
    for (const Layer& l : r.layers) {
      const LayerTimes t = times_of(l);
      above_one = above_one || t.efficiency() > 1;
      out << fmt::format("  {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>6.2f}  {}\n", t.comm,
                         t.compute, t.comm + t.compute, t.overlapped, t.efficiency(), l.what);
    }
    if (above_one)
      out << "  (above 1: the stretch took less than its longer part timed alone, whose steps "
             "each wait for the stream and their team; and times vary from run to run)\n";
  }
  out << fmt::format(
      "check against one device (normwise: max |sharded - one device| / max |one device|, "
      "tolerance {}):\n",
      s.dtype == DType::F32 ? "1e-4" : "2e-2");
  out << fmt::format("  {:<24} {:>10} {:>10}  {}\n", "output", "max abs", "normwise", "check");
  for (const Check& c : r.checks)
    out << fmt::format("  {:<24} {:>10.3e} {:>10.3e}  {}\n", c.name, c.max_abs_err, c.normwise_err,
                       c.pass ? "pass" : "FAIL");
}

}  // namespace

int run_model(const RunOptions& options, std::ostream& out) {
  const Setup s = check_options(options);
  Report report;
  if (s.backend == CommunicatorBackend::Local) {
    const std::vector<Tensor> whole = whole_inputs(build(s, false));
    run_local(s.ranks, [&](const std::shared_ptr<Communicator>& comm) {
      // On CUDA each rank a stream of its own on the one GPU.
      std::optional<CudaStream> cuda;
      if (s.device.type == DeviceType::CUDA) cuda.emplace(s.device.index);
      run_rank(comm, s, options, whole, cuda ? cuda->stream() : Stream{},
               comm->rank() == 0 ? &report : nullptr);
    });
  } else {
    CommOptions comm_options;
    comm_options.backend = fmt::format("{}:{}", s.device.type == DeviceType::CUDA ? "cuda" : "cpu",
                                       to_string(s.backend));
    const std::shared_ptr<Communicator> comm = init_communicator(comm_options);
    std::optional<CudaStream> cuda;
    if (s.device.type == DeviceType::CUDA) cuda.emplace(s.device.index);
    run_rank(comm, s, options, whole_inputs(build(s, false)), cuda ? cuda->stream() : Stream{},
             &report);
    if (comm->rank() != 0) return 0;
  }
  print(out, options, s, report);
  return std::all_of(report.checks.begin(), report.checks.end(),
                     [](const Check& c) { return c.pass; })
             ? 0
             : 1;
}

}  // namespace meshfuse::cli
