// MultiDeviceExecutor: the plan cache and the teams of the mesh dimensions; interpreter.cpp runs
// the plans.
#include "meshfuse/exec/executor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "exec/interpreter.h"
#include "meshfuse/core/error.h"

namespace meshfuse {

namespace {

// The ranks' programs or params differ: every rank throws it together once the comparison's
// collectives have completed, so the run is not counted as failed (count_failed_run), which would
// put ranks whose params name another backend out of step with the others.
class RanksDiffer : public Error {
 public:
  using Error::Error;
};

std::shared_ptr<Communicator> defined(std::shared_ptr<Communicator> communicator) {
  MESHFUSE_CHECK(communicator != nullptr, ErrorCode::InvalidArgument,
                 "MultiDeviceExecutor: communicator is null");
  return communicator;
}

// Every rank's words, gathered through `device` (the backend's device type) and read on the host.
Tensor gather_words(Communicator& world, const Tensor& mine, Device device, const Stream& stream) {
  const Tensor all({mine.numel() * world.size()}, DType::I64, device, stream);
  const Tensor sent = mine.to(device, stream);
  world.all_gather(sent, all, stream).keep_alive({sent, all}).wait();
  Tensor host({all.numel()}, DType::I64);
  copy(all, host, stream);
  return host;
}

// Every rank's text: the lengths, then the bytes padded to the longest in 8-byte words (I64, which
// every backend carries).
std::vector<std::string> gather_texts(Communicator& world, const std::string& text, Device device,
                                      const Stream& stream) {
  Tensor length({1}, DType::I64);
  length.data_ptr<std::int64_t>()[0] = static_cast<std::int64_t>(text.size());
  const Tensor lengths = gather_words(world, length, device, stream);
  const std::int64_t* l = lengths.data_ptr<std::int64_t>();
  const std::int64_t words = (*std::max_element(l, l + world.size()) + 7) / 8;
  Tensor mine({words}, DType::I64);
  std::fill_n(mine.data_ptr<std::int64_t>(), words, 0);
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(mine.data_ptr<std::int64_t>()));
  const Tensor all = gather_words(world, mine, device, stream);
  std::vector<std::string> texts;
  for (int r = 0; r < world.size(); ++r)
    texts.emplace_back(reinterpret_cast<const char*>(all.data_ptr<std::int64_t>()) + r * words * 8,
                       static_cast<std::size_t>(l[r]));
  return texts;
}

// Where `theirs` first differs from `ours` (rank 0's), line by line.
std::string first_difference(const std::string& theirs, const std::string& ours) {
  const auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t end = std::min(text.find('\n', at), text.size());
      out.push_back(text.substr(at, end - at));
      at = end + 1;
    }
    return out;
  };
  const std::vector<std::string> a = lines(theirs), b = lines(ours);
  std::size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  const auto line = [&](const std::vector<std::string>& v) {
    return i < v.size() ? fmt::format("`{}`", v[i]) : std::string("its end");
  };
  return fmt::format("its line {} is {} where rank 0's is {}", i + 1, line(a), line(b));
}

}  // namespace

MultiDeviceExecutor::MultiDeviceExecutor(Program program,
                                         std::shared_ptr<Communicator> communicator,
                                         MultiDeviceExecutorParams params)
    : program_(std::move(program)),
      communicator_(defined(std::move(communicator))),
      params_(std::move(params)),
      mesh_(program_.mesh().value_or(DeviceMesh(std::vector<int>{communicator_->rank()}))) {
  check_overlap_params(params_.overlap);
  if (!program_.mesh()) return;
  std::vector<int> ranks = mesh_.ranks();
  std::sort(ranks.begin(), ranks.end());
  std::vector<int> team(static_cast<std::size_t>(communicator_->size()));
  std::iota(team.begin(), team.end(), 0);
  MESHFUSE_CHECK(ranks == team, ErrorCode::InvalidArgument,
                 "MultiDeviceExecutor: the program's {} must be laid over the communicator's "
                 "ranks 0 .. {}, each once (rank {} of {})",
                 mesh_.to_string(), communicator_->size() - 1, communicator_->rank(),
                 communicator_->size());
}

// Ranks whose programs or executor params differ would meet in different collectives, or wait in
// one that the others never call: before the first communication of a backend, the ranks compare
// a hash of the program's text (ops, shapes, placements) and one of the params that decide which
// communications run, how and where, and fail together when one differs. Every rank sees every
// hash, so on a difference all gather the texts too, to show where the first differing rank parts
// from rank 0.
void MultiDeviceExecutor::check_same_program(Communicator& world, DeviceType type,
                                             const Stream& stream) const {
  const Device device = type == DeviceType::CPU ? Device{} : stream.device;
  const std::string params = fmt::format(
      "backend {}, overlap {}, chunks {}, streams {}, profile {}",
      params_.lowering.communicator_backend ? to_string(*params_.lowering.communicator_backend)
                                            : "the communicator's",
      to_string(params_.overlap.overlap), params_.overlap.chunks, params_.overlap.number_of_streams,
      params_.profile);
  const std::string program = program_.to_string();
  Tensor mine({2}, DType::I64);
  mine.data_ptr<std::int64_t>()[0] = static_cast<std::int64_t>(std::hash<std::string>{}(program));
  mine.data_ptr<std::int64_t>()[1] = static_cast<std::int64_t>(std::hash<std::string>{}(params));
  Tensor host;
  try {
    host = gather_words(world, mine, device, stream);
  } catch (const Error& e) {  // the first collective of a run, which the user did not write
    // Waited for, or met by another collective (the metadata check's InvalidArgument): some rank
    // is elsewhere.
    const bool elsewhere = e.code() == ErrorCode::Timeout ||
                           e.code() == ErrorCode::CommunicationFailure ||
                           e.code() == ErrorCode::InvalidArgument;
    throw Error(
        e.code(),
        fmt::format("MultiDeviceExecutor: {}: {}",
                    !elsewhere ? fmt::format("the first {} communication of {} tensors",
                                             to_string(world.backend(type)), to_string(type))
                    : params_set_
                        ? "comparing the program and params of the ranks after set_params() on "
                          "this rank (does every rank call it, and run()?)"
                        : "comparing the program and params of the ranks before the run's first "
                          "communication (does every rank call run()?)",
                    e.message()));
  }
  const std::int64_t* h = host.data_ptr<std::int64_t>();
  for (int r = 0; r < world.size(); ++r) {
    const int rank = world.team()[static_cast<std::size_t>(r)];
    if (h[2 * r] != h[0]) {
      const std::vector<std::string> texts = gather_texts(world, program, device, stream);
      throw RanksDiffer(
          ErrorCode::InvalidArgument,
          fmt::format("MultiDeviceExecutor: rank {} runs another program than rank 0 "
                      "(every rank must build the same program: ops, shapes, dtypes, mesh "
                      "and placements): {}",
                      rank, first_difference(texts[r], texts[0])));
    }
    if (h[2 * r + 1] != h[1]) {
      const std::vector<std::string> texts = gather_texts(world, params, device, stream);
      throw RanksDiffer(
          ErrorCode::InvalidArgument,
          fmt::format("MultiDeviceExecutor: rank {} has other executor params than rank 0 "
                      "(every rank must pass the same): {} where rank 0 has {}",
                      rank, texts[r], texts[0]));
    }
  }
}

void MultiDeviceExecutor::set_params(MultiDeviceExecutorParams params) {
  check_overlap_params(params.overlap);
  params_ = std::move(params);
  params_set_ = true;
  // Compared again before the next communication, on every rank: each rank calls set_params, and
  // one whose params did not change must still meet the one whose params did.
  checked_.clear();
}

CommunicatorBackend MultiDeviceExecutor::backend_for(DeviceType type) const {
  if (params_.lowering.communicator_backend) return *params_.lowering.communicator_backend;
  // A program without a mesh communicates nothing: any backend names its (empty) plan, also on a
  // device the communicator has none for.
  const auto& spec = communicator_->spec().backends;
  if (!program_.mesh() && !spec.count(type)) return CommunicatorBackend::Local;
  return communicator_->backend(type);
}

const MultiDeviceExecutor::Lowered& MultiDeviceExecutor::lowered(DeviceType type) {
  const CommunicatorBackend backend = backend_for(type);
  auto it = plans_.find({backend, type});
  if (it == plans_.end()) {
    Plan plan = lower(program_, communicator_->rank(), backend);
    detail::PlanFacts facts = detail::plan_facts(plan);
    it = plans_.emplace(std::pair(backend, type), Lowered{std::move(plan), std::move(facts), {}, {}})
             .first;
  }
  Lowered& l = it->second;
  if (!l.segments_for || *l.segments_for != params_.overlap) {
    l.segments = find_overlap_segments(l.plan, params_.overlap);
    l.segments_for = params_.overlap;
  }
  return l;
}

const Plan& MultiDeviceExecutor::plan(DeviceType type) { return lowered(type).plan; }

std::shared_ptr<Communicator> MultiDeviceExecutor::world(CommunicatorBackend backend,
                                                         DeviceType type) {
  const auto& spec = communicator_->spec().backends;
  const auto served = spec.find(type);
  return served != spec.end() && served->second == backend
             ? communicator_
             : communicator_->with_backends(BackendSpec{{{type, backend}}});
}

const std::vector<std::shared_ptr<Communicator>>& MultiDeviceExecutor::teams(
    CommunicatorBackend backend, DeviceType type, const Stream& stream) {
  const std::pair key(backend, type);
  auto it = teams_.find(key);
  if (it != teams_.end() && checked_.contains(key)) return it->second;
  // Compared on the communicator's own backend for the device type where it has one: a rank whose
  // params name another backend then meets the others there, where setting up that backend's team
  // (itself a collective of that backend) would leave every rank waiting for the others.
  check_same_program(
      communicator_->spec().backends.contains(type) ? *communicator_ : *this->world(backend, type),
      type, stream);
  const std::shared_ptr<Communicator> world = this->world(backend, type);
  checked_.insert(key);
  if (it == teams_.end()) it = teams_.emplace(key, world->mesh_teams(mesh_)).first;
  return it->second;
}

void MultiDeviceExecutor::count_failed_run(std::optional<DeviceType> given) {
  const DeviceType type = given.value_or(last_type_);
  const Lowered& l = lowered(type);
  if (!l.facts.communicates) return;
  const CommunicatorBackend backend = l.plan.backend;
  std::set<Communicator*> counted;  // a 1-D mesh's team is the world itself
  const auto count = [&](Communicator& c) {
    if (counted.insert(&c).second) c.count_failed_collective();
  };
  count(*world(backend, type));
  const auto it = teams_.find({backend, type});
  if (it != teams_.end())
    for (const std::shared_ptr<Communicator>& team : it->second) count(*team);
}

std::vector<Tensor> MultiDeviceExecutor::run(const std::vector<TensorView>& inputs,
                                             const Stream& stream) {
  const Device device = inputs.empty() ? stream.device : inputs[0].device();
  last_type_ = device.type;
  try {
    return run(lowered(device.type), inputs, device, stream);
  } catch (const RanksDiffer&) {
    throw;
  } catch (...) {
    try {
      count_failed_run(device.type);
    } catch (...) {  // the run's own error is the one to report
    }
    throw;
  }
}

std::vector<Tensor> MultiDeviceExecutor::run(const Lowered& lowered,
                                             const std::vector<TensorView>& inputs, Device device,
                                             const Stream& stream) {
  const std::vector<Value>& declared = program_.inputs();
  if (inputs.size() != declared.size()) {
    std::vector<std::string> names;  // in the order run() takes them
    for (const Value v : declared) names.push_back(program_.describe(v));
    fail(ErrorCode::InvalidArgument,
         "MultiDeviceExecutor.run: {} inputs given, the program takes {}, in this order: {}",
         inputs.size(), declared.size(), fmt::join(names, ", "));
  }
  const Plan& plan = lowered.plan;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const TensorView& t = inputs[i];
    const PlanValue& want = plan.values[static_cast<std::size_t>(plan.inputs[i])];
    const auto named = [&] {
      return fmt::format("MultiDeviceExecutor.run: input {} on rank {}",
                         program_.describe(declared[i]), communicator_->rank());
    };
    MESHFUSE_CHECK(t.defined(), ErrorCode::InvalidArgument, "{}: undefined", named());
    MESHFUSE_CHECK(t.device() == device, ErrorCode::DeviceMismatch,
                   "{}: on {}, the first input on {}", named(), t.device().str(), device.str());
    MESHFUSE_CHECK(t.dtype() == want.dtype, ErrorCode::DTypeMismatch, "{}: must be {}, got {}",
                   named(), to_string(want.dtype), to_string(t.dtype()));
    MESHFUSE_CHECK(t.shape() == want.shape, ErrorCode::ShapeMismatch,
                   "{}: this rank's part must be {} (placements as the plan says), got {}", named(),
                   shape_str(want.shape), shape_str(t.shape()));
  }
  // Before the ranks' first exchange, which runs on the stream: a CPU stream with CUDA inputs
  // compared the programs on the host through the device's backend and failed only later.
  MESHFUSE_CHECK(device.type == DeviceType::CPU ? stream.device.type == DeviceType::CPU
                                                : stream.device == device,
                 ErrorCode::DeviceMismatch,
                 "MultiDeviceExecutor.run on rank {}: the stream is on {} but the inputs are on {}",
                 communicator_->rank(), stream.device.str(), device.str());
  MESHFUSE_CHECK(device.type != DeviceType::CPU || stream.native == nullptr,
                 ErrorCode::InvalidArgument,
                 "MultiDeviceExecutor.run on rank {}: stream: a native stream handle ({}) came "
                 "with inputs on the CPU, where the program runs on the calling thread: pass none",
                 communicator_->rank(), stream.native);
  static const std::vector<std::shared_ptr<Communicator>> kNone;
  const auto& teams =
      lowered.facts.communicates ? this->teams(plan.backend, device.type, stream) : kNone;
  return detail::Interpreter(plan, lowered.facts, teams, lowered.segments,
                             chunk_streams(device, lowered.segments), device, stream,
                             params_.profile ? &profile_ : nullptr)
      .run(inputs);
}

// CUDA: the executor's own streams for the chunks of overlapped segments, made on first use.
const std::vector<Stream>& MultiDeviceExecutor::chunk_streams(
    Device device, const std::vector<OverlapSegment>& segments) {
  static const std::vector<Stream> kNone;
  if (device.type != DeviceType::CUDA || segments.empty()) return kNone;
  auto& [owned, streams] = chunk_streams_[device.index];
  const auto n = static_cast<std::size_t>(params_.overlap.number_of_streams);
  while (owned.size() < n) owned.push_back(std::make_shared<CudaStream>(device.index));
  streams.clear();
  for (std::size_t i = 0; i < n; ++i) streams.push_back(owned[i]->stream());
  return streams;
}

Tensor shard_tensor(const TensorView& tensor, const DeviceMesh& mesh,
                    const std::vector<Placement>& placements, int rank, const Stream& stream) {
  const LocalPart part = [&] {
    try {
      return local_part(tensor.shape(), mesh, placements, rank);
    } catch (const Error& e) {  // its checks are of shard_tensor's arguments: say so
      std::string message = e.message();
      if (message.starts_with("local_part: "))
        message.erase(0, std::string_view("local_part: ").size());
      throw Error(e.code(), "shard_tensor: " + message);
    }
  }();
  TensorView v = tensor;
  for (std::int64_t d = 0; d < v.dim(); ++d) {
    const auto di = static_cast<std::size_t>(d);
    v = v.narrow(d, part.offsets[di], part.shape[di]);
  }
  // Partial: the value partitioned as the lowering's Partition steps do it.
  check_partials("shard_tensor", tensor.dtype(), placements);
  const std::vector<std::int64_t> at = mesh.coordinates(rank);
  std::optional<double> term;
  for (std::size_t m = 0; m < placements.size(); ++m)
    if (const auto* p = std::get_if<Partial>(&placements[m]))
      if (const std::optional<double> identity = partition_term(p->op, at[m])) term = identity;
  if (!term) return Tensor::copy_of(v, stream);
  Tensor t(v.shape(), v.dtype(), v.device(), stream);
  fill(t, *term, stream);
  return t;
}

Tensor gather_tensor(const TensorView& local, const Shape& shape, const DeviceMesh& mesh,
                     const std::vector<Placement>& placements,
                     std::shared_ptr<Communicator> communicator, const Stream& stream) {
  // The identity program, its output wanted whole. Its errors name gather_tensor's arguments.
  std::optional<MultiDeviceExecutor> executor;
  try {
    check_partials("placements", local.dtype(), placements);  // not in the program's words
    Program p;
    const Value v = p.define_tensor("local", shape, local.dtype());
    p.set_mesh(mesh);
    p.set_placements(v, placements);
    p.add_output(v, std::vector<Placement>(placements.size(), Replicate{}));
    const int rank = communicator ? communicator->rank() : 0;
    executor.emplace(std::move(p), communicator);
    if (local.defined()) {
      const Plan& plan = executor->plan(local.device().type);
      const Shape& part = plan.values[static_cast<std::size_t>(plan.inputs[0])].shape;
      MESHFUSE_CHECK(local.shape() == part, ErrorCode::ShapeMismatch,
                     "'local' on rank {} must be {}, this rank's part of a {} tensor placed as {} "
                     "on {}, got {}",
                     rank, shape_str(part), shape_str(shape), to_string(placements),
                     mesh.to_string(), shape_str(local.shape()));
    }
  } catch (const Error& e) {
    // Refused on this rank before its communications: counted as the run they would have been
    // (MultiDeviceExecutor::count_failed_run), so that the others fail out of step instead of
    // pairing their call with this rank's next one.
    try {
      if (executor)
        executor->count_failed_run(local.defined() ? std::optional(local.device().type)
                                                   : std::nullopt);
      else if (communicator)
        communicator->count_failed_collective();
    } catch (...) {  // the refusal is the error to report
    }
    throw Error(e.code(), "gather_tensor: " + e.message());
  }
  try {
    return executor->run({local}, stream)[0];
  } catch (const Error& e) {
    // The executor's words are of a program and run(), which the caller never wrote.
    const bool elsewhere = e.code() == ErrorCode::InvalidArgument ||
                           e.code() == ErrorCode::Timeout ||
                           e.code() == ErrorCode::CommunicationFailure;
    throw Error(e.code(), fmt::format("gather_tensor: {}{}",
                                      elsewhere ? "every rank must call it, with the same shape, "
                                                  "dtype, mesh and placements (it runs as an "
                                                  "executor's program): "
                                                : "",
                                      e.message()));
  }
}

}  // namespace meshfuse
