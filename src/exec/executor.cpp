// MultiDeviceExecutor: plan cache, the teams of the mesh dimensions, and the interpreter of a
// Plan's steps.
#include "meshfuse/exec/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>
#include <string>

#include "exec/interpret.h"
#include "meshfuse/core/error.h"

namespace meshfuse {
namespace {

// The view with dims 0 and d swapped: a collective moves rows of dim 0, so another dim is moved
// there (a contiguous copy) and back.
Tensor dim_first(const TensorView& t, std::int64_t d, const Stream& stream) {
  return Tensor::copy_of(t.transpose(0, d), stream);
}

Shape swapped(Shape shape, std::int64_t d) {
  std::swap(shape[0], shape[static_cast<std::size_t>(d)]);
  return shape;
}

// Whether result j of op may be left undefined (the kernel then skips it): rmsnorm's rstd.
bool optional_result(const ProgramOp& op, std::size_t j) {
  return (op.type == OpType::RmsNorm && j == 1) ||
         (op.type == OpType::FusedResidualAddRmsNorm && j == 2);
}

std::int64_t sum(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

// Runs a Plan's steps on one rank.
class Interpreter {
 public:
  Interpreter(const Plan& plan, const std::vector<std::int64_t>& last_use,
              const std::vector<std::shared_ptr<Communicator>>& teams, Device device,
              const Stream& stream, std::vector<StepProfile>* profile)
      : plan_(plan),
        last_use_(last_use),
        teams_(teams),
        device_(device),
        stream_(stream),
        profile_(profile),
        views_(plan.values.size()),
        owned_(plan.values.size()) {}

  std::vector<Tensor> run(const std::vector<TensorView>& inputs) {
    for (std::size_t i = 0; i < inputs.size(); ++i)
      views_[static_cast<std::size_t>(plan_.inputs[i])] = inputs[i];
    if (profile_) profile_->clear();
    for (std::size_t s = 0; s < plan_.steps.size(); ++s) {
      if (profile_) synchronize(stream_);
      const auto start = std::chrono::steady_clock::now();
      std::visit([&](const auto& step) { run_step(step); }, plan_.steps[s]);
      if (profile_) {
        synchronize(stream_);
        const auto* c = std::get_if<Communication>(&plan_.steps[s]);
        profile_->push_back(
            {static_cast<std::int64_t>(s), c != nullptr, c ? bytes(*c) : 0,
             std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                 .count()});
      }
      release_after(static_cast<std::int64_t>(s));
    }
    std::vector<Tensor> outputs;
    for (std::int64_t out : plan_.outputs) {
      const auto o = static_cast<std::size_t>(out);
      // An input returned as it came is copied: outputs never alias the caller's tensors.
      outputs.push_back(owned_[o].defined() ? owned_[o] : Tensor::copy_of(views_[o], stream_));
    }
    return outputs;
  }

 private:
  const TensorView& view(std::int64_t id) const { return views_[static_cast<std::size_t>(id)]; }

  const TensorView& allocate(std::int64_t id) {
    const PlanValue& v = plan_.values[static_cast<std::size_t>(id)];
    Tensor& t = owned_[static_cast<std::size_t>(id)];
    t = Tensor(v.shape, v.dtype, device_, stream_);
    return views_[static_cast<std::size_t>(id)] = t.view();
  }

  void release_after(std::int64_t step) {
    for (std::size_t id = 0; id < owned_.size(); ++id)
      if (owned_[id].defined() && last_use_[id] <= step) {
        owned_[id] = Tensor();
        views_[id] = TensorView();
      }
  }

  void run_step(const Compute& c) {
    std::vector<TensorView> in, out;
    for (Value v : c.op.inputs) in.push_back(v.defined() ? view(v.id) : TensorView());
    for (std::size_t j = 0; j < c.op.outputs.size(); ++j) {
      const std::int64_t id = c.op.outputs[j].id;
      // A statistic saved for a backward that this plan does not run is not computed.
      const bool unused = last_use_[static_cast<std::size_t>(id)] < 0 && optional_result(c.op, j);
      out.push_back(unused ? TensorView() : allocate(id));
    }
    if (c.mesh_dim >= 0)
      return detail::run_collective_op(c.op, in, out, *teams_[static_cast<std::size_t>(c.mesh_dim)],
                                       stream_);
    detail::run_op(c.op, in, out, stream_);
  }

  void run_step(const Slice& s) {
    copy(view(s.input).narrow(s.dim, s.offset, s.size), allocate(s.output), stream_);
  }

  void run_step(const Communication& c) {
    Communicator& team = *teams_[static_cast<std::size_t>(c.mesh_dim)];
    const TensorView& in = view(c.input);
    const TensorView& out = allocate(c.output);
    switch (c.type) {
      case CommOp::AllReduce:
        copy(in, out, stream_);
        team.all_reduce(out, *c.reduction, stream_).wait();
        return;
      case CommOp::AllGather:
        if (c.gather_dim == 0 && in.is_contiguous()) {
          team.all_gather(in, out, c.sizes, stream_).wait();
        } else {
          const Tensor moved = dim_first(in, c.gather_dim, stream_);
          const Tensor gathered(swapped(out.shape(), c.gather_dim), out.dtype(), device_, stream_);
          team.all_gather(moved, gathered, c.sizes, stream_).wait();
          copy(gathered.view().transpose(0, c.gather_dim), out, stream_);
        }
        return;
      case CommOp::ReduceScatter:
        if (c.scatter_dim == 0 && in.is_contiguous()) {
          team.reduce_scatter(in, out, c.sizes, *c.reduction, stream_).wait();
        } else {
          const Tensor moved = dim_first(in, c.scatter_dim, stream_);
          const Tensor part(swapped(out.shape(), c.scatter_dim), out.dtype(), device_, stream_);
          team.reduce_scatter(moved, part, c.sizes, *c.reduction, stream_).wait();
          copy(part.view().transpose(0, c.scatter_dim), out, stream_);
        }
        return;
      case CommOp::AllToAll:
        all_to_all(team, c, in, out);
        return;
      default:
        fail(ErrorCode::Internal, "MultiDeviceExecutor: no step runs {}", c.to_string());
    }
  }

  // Shard(i) -> Shard(j): the scattered dim j goes first, so that member s's rows are one block;
  // what comes back from member r is its part along i, which lands at r's offset along i. The
  // blocks differ in shape along i, so the exchange runs on flat buffers.
  void all_to_all(Communicator& team, const Communication& c, const TensorView& in,
                  const TensorView& out) {
    const std::int64_t i = c.gather_dim, j = c.scatter_dim;
    const Tensor moved = dim_first(in, j, stream_);
    const std::int64_t per_row_in = in.size(j) == 0 ? 0 : in.numel() / in.size(j);
    const std::int64_t mine = out.size(j);
    std::vector<std::int64_t> send, receive;
    for (std::int64_t rows : c.sizes) send.push_back(rows * per_row_in);
    const std::int64_t others =
        mine == 0 || out.size(i) == 0 ? 0 : out.numel() / (mine * out.size(i));
    for (std::int64_t rows : c.gather_sizes) receive.push_back(mine * rows * others);
    const Tensor received({sum(receive)}, out.dtype(), device_, stream_);
    team.all_to_all(moved.view().reshape({moved.numel()}), received, send, receive, stream_).wait();
    // In the dim-j-first layout, dim i sits where dim 0 was swapped to (j) when i is 0.
    const std::int64_t i_moved = i == 0 ? j : i;
    const TensorView out_moved = out.transpose(0, j);
    std::int64_t element = 0, offset = 0;
    for (std::size_t r = 0; r < c.gather_sizes.size(); ++r) {
      Shape block = out_moved.shape();
      block[static_cast<std::size_t>(i_moved)] = c.gather_sizes[r];
      const std::int64_t n = shape_numel(block);
      copy(received.view().narrow(0, element, n).reshape(block),
           out_moved.narrow(i_moved, offset, c.gather_sizes[r]), stream_);
      element += n;
      offset += c.gather_sizes[r];
    }
  }

  std::int64_t bytes(const Communication& c) const {
    const auto of = [&](std::int64_t id) {
      const PlanValue& v = plan_.values[static_cast<std::size_t>(id)];
      return shape_numel(v.shape) * static_cast<std::int64_t>(element_size(v.dtype));
    };
    return std::max(of(c.input), of(c.output));
  }

  const Plan& plan_;
  const std::vector<std::int64_t>& last_use_;  // the last step that reads each value
  const std::vector<std::shared_ptr<Communicator>>& teams_;
  Device device_;
  Stream stream_;
  std::vector<StepProfile>* profile_;  // null: not profiling
  std::vector<TensorView> views_;
  std::vector<Tensor> owned_;
};

// The last step that reads each value of `plan` (-1: none; an output: past the last step), so
// that a run frees each intermediate as soon as it can.
std::vector<std::int64_t> last_uses(const Plan& plan) {
  std::vector<std::int64_t> last(plan.values.size(), -1);
  const auto uses = [&](std::int64_t id, std::int64_t step) {
    auto& u = last[static_cast<std::size_t>(id)];
    u = std::max(u, step);
  };
  for (std::size_t s = 0; s < plan.steps.size(); ++s) {
    const auto step = static_cast<std::int64_t>(s);
    if (const auto* c = std::get_if<Compute>(&plan.steps[s])) {
      for (Value in : c->op.inputs)
        if (in.defined()) uses(in.id, step);
    } else if (const auto* c = std::get_if<Communication>(&plan.steps[s])) {
      uses(c->input, step);
    } else {
      uses(std::get<Slice>(plan.steps[s]).input, step);
    }
  }
  for (std::int64_t out : plan.outputs) uses(out, static_cast<std::int64_t>(plan.steps.size()));
  return last;
}

// Whether the plan talks to its teams: a Communication, or an op that communicates itself (the
// vocabulary-parallel loss).
bool has_communication(const Plan& plan) {
  return std::any_of(plan.steps.begin(), plan.steps.end(), [](const PlanStep& s) {
    const auto* c = std::get_if<Compute>(&s);
    return std::holds_alternative<Communication>(s) || (c && c->mesh_dim >= 0);
  });
}

}  // namespace

MultiDeviceExecutor::MultiDeviceExecutor(Program program,
                                         std::shared_ptr<Communicator> communicator,
                                         MultiDeviceExecutorParams params)
    : program_(std::move(program)),
      communicator_(std::move(communicator)),
      params_(std::move(params)),
      mesh_(program_.mesh().value_or(DeviceMesh(std::vector<int>{communicator_->rank()}))) {
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

// Ranks whose programs differ would meet in different collectives, or wait in one that the
// others never call: before the first communication of a backend, the ranks compare a hash of
// the program's text (ops, shapes, placements) and fail together when one differs.
void MultiDeviceExecutor::check_same_program(Communicator& world, DeviceType type,
                                             const Stream& stream) const {
  const Device device = type == DeviceType::CPU ? Device{} : stream.device;
  Tensor mine({1}, DType::I64);
  mine.data_ptr<std::int64_t>()[0] =
      static_cast<std::int64_t>(std::hash<std::string>{}(program_.to_string()));
  const int n = world.size();
  const Tensor all({n}, DType::I64, device, stream);
  world.all_gather(mine.to(device, stream), all, stream).wait();
  Tensor host({n}, DType::I64);
  copy(all, host, stream);
  for (int r = 0; r < n; ++r)
    MESHFUSE_CHECK(host.data_ptr<std::int64_t>()[r] == host.data_ptr<std::int64_t>()[0],
                   ErrorCode::InvalidArgument,
                   "MultiDeviceExecutor: rank {} runs another program than rank 0 (every rank "
                   "must build the same program: ops, shapes, dtypes, mesh and placements)",
                   world.team()[static_cast<std::size_t>(r)]);
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
    std::vector<std::int64_t> last_use = last_uses(plan);
    const bool communicates = has_communication(plan);
    it = plans_
             .emplace(std::pair(backend, type),
                      Lowered{std::move(plan), std::move(last_use), communicates})
             .first;
  }
  return it->second;
}

const Plan& MultiDeviceExecutor::plan(DeviceType type) { return lowered(type).plan; }

const std::vector<std::shared_ptr<Communicator>>& MultiDeviceExecutor::teams(
    CommunicatorBackend backend, DeviceType type, const Stream& stream) {
  auto it = teams_.find({backend, type});
  if (it != teams_.end()) return it->second;
  const auto& spec = communicator_->spec().backends;
  const auto served = spec.find(type);
  std::shared_ptr<Communicator> world =
      served != spec.end() && served->second == backend
          ? communicator_
          : communicator_->with_backends(BackendSpec{{{type, backend}}});
  check_same_program(*world, type, stream);
  std::vector<std::shared_ptr<Communicator>> teams;
  const int rank = world->rank();
  const std::vector<std::int64_t> at = mesh_.coordinates(rank);
  for (std::int64_t m = 0; m < mesh_.ndim(); ++m) {
    std::vector<int> in_order(static_cast<std::size_t>(world->size()));
    std::iota(in_order.begin(), in_order.end(), 0);
    if (mesh_.ndim() == 1 && mesh_.ranks() == in_order) {
      teams.push_back(world);
      continue;
    }
    // The team of m: the ranks that share every other coordinate, ordered along m.
    std::int64_t color = 0;
    for (std::int64_t d = 0; d < mesh_.ndim(); ++d)
      if (d != m)
        color =
            color * mesh_.shape()[static_cast<std::size_t>(d)] + at[static_cast<std::size_t>(d)];
    teams.push_back(
        world->split(static_cast<int>(color), static_cast<int>(at[static_cast<std::size_t>(m)])));
  }
  return teams_.emplace(std::pair(backend, type), std::move(teams)).first->second;
}

std::vector<Tensor> MultiDeviceExecutor::run(const std::vector<TensorView>& inputs,
                                             const Stream& stream) {
  const std::vector<Value>& declared = program_.inputs();
  MESHFUSE_CHECK(inputs.size() == declared.size(), ErrorCode::InvalidArgument,
                 "MultiDeviceExecutor.run: {} inputs given, the program takes {}", inputs.size(),
                 declared.size());
  const Device device = inputs.empty() ? stream.device : inputs[0].device();
  const Lowered& lowered = this->lowered(device.type);
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
  static const std::vector<std::shared_ptr<Communicator>> kNone;
  const auto& teams = lowered.communicates ? this->teams(plan.backend, device.type, stream) : kNone;
  return Interpreter(plan, lowered.last_use, teams, device, stream,
                     params_.profile ? &profile_ : nullptr)
      .run(inputs);
}

Tensor shard_tensor(const TensorView& tensor, const DeviceMesh& mesh,
                    const std::vector<Placement>& placements, int rank, const Stream& stream) {
  for (const Placement& p : placements)
    MESHFUSE_CHECK(!std::holds_alternative<Partial>(p), ErrorCode::InvalidArgument,
                   "shard_tensor: a whole tensor cannot be placed as {}", to_string(p));
  const LocalPart part = local_part(tensor.shape(), mesh, placements, rank);
  TensorView v = tensor;
  for (std::int64_t d = 0; d < v.dim(); ++d) {
    const auto di = static_cast<std::size_t>(d);
    v = v.narrow(d, part.offsets[di], part.shape[di]);
  }
  return Tensor::copy_of(v, stream);
}

Tensor gather_tensor(const TensorView& local, const Shape& shape, const DeviceMesh& mesh,
                     const std::vector<Placement>& placements,
                     std::shared_ptr<Communicator> communicator, const Stream& stream) {
  // The identity program, its output wanted whole.
  Program p;
  const Value v = p.define_tensor("tensor", shape, local.dtype());
  p.set_mesh(mesh);
  p.set_placements(v, placements);
  p.add_output(v, std::vector<Placement>(placements.size(), Replicate{}));
  return MultiDeviceExecutor(std::move(p), std::move(communicator)).run({local}, stream)[0];
}

}  // namespace meshfuse
