// The interpreter of a Plan's steps (interpreter.h); the stretches that overlap communication with
// compute run in overlap_run.cpp.
#include "exec/interpreter.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "exec/interpret.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {
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

}  // namespace

PlanFacts plan_facts(const Plan& plan) {
  PlanFacts facts;
  facts.last_use.assign(plan.values.size(), -1);
  const auto uses = [&](std::int64_t id, std::int64_t step) {
    auto& u = facts.last_use[static_cast<std::size_t>(id)];
    u = std::max(u, step);
  };
  for (std::size_t s = 0; s < plan.steps.size(); ++s) {
    const auto step = static_cast<std::int64_t>(s);
    if (const auto* c = std::get_if<Compute>(&plan.steps[s])) {
      for (Value in : c->op.inputs)
        if (in.defined()) uses(in.id, step);
      facts.communicates |= c->mesh_dim >= 0;  // the vocabulary-parallel loss
    } else if (const auto* c = std::get_if<Communication>(&plan.steps[s])) {
      uses(c->input, step);
      facts.communicates = true;
    } else if (const auto* c = std::get_if<Slice>(&plan.steps[s])) {
      uses(c->input, step);
    } else {
      uses(std::get<Partition>(plan.steps[s]).input, step);
    }
  }
  for (std::int64_t out : plan.outputs) uses(out, static_cast<std::int64_t>(plan.steps.size()));
  return facts;
}

Interpreter::Interpreter(const Plan& plan, const PlanFacts& facts,
                         const std::vector<std::shared_ptr<Communicator>>& teams,
                         const std::vector<OverlapSegment>& segments,
                         const std::vector<Stream>& chunk_streams, Device device,
                         const Stream& stream, std::vector<StepProfile>* profile)
    : plan_(plan),
      facts_(facts),
      teams_(teams),
      segments_(segments),
      chunk_streams_(chunk_streams),
      device_(device),
      stream_(stream),
      profile_(profile),
      views_(plan.values.size()),
      owned_(plan.values.size()) {}

std::vector<Tensor> Interpreter::run(const std::vector<TensorView>& inputs) {
  for (std::size_t i = 0; i < inputs.size(); ++i)
    views_[static_cast<std::size_t>(plan_.inputs[i])] = inputs[i];
  if (profile_) profile_->clear();
  auto segment = segments_.begin();
  for (std::size_t s = 0; s < plan_.steps.size(); ++s) {
    const auto step = static_cast<std::int64_t>(s);
    if (profile_) {
      synchronize(stream_);
      // A communication starts when the whole team is there: its time is not another rank's
      // compute still running.
      if (const auto mesh_dim = communicates_over(step); mesh_dim >= 0) {
        teams_[static_cast<std::size_t>(mesh_dim)]->barrier(stream_).wait();
        synchronize(stream_);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    StepProfile entry{step};
    if (segment != segments_.end() && segment->first == step) {
      run_segment(*segment);
      entry.overlapped_to = segment->last;
      s = static_cast<std::size_t>(segment->last);
      ++segment;
    } else {
      std::visit([&](const auto& st) { run_step(st); }, plan_.steps[s]);
      if (const auto* c = std::get_if<Communication>(&plan_.steps[s])) {
        entry.communication = true;
        entry.bytes = bytes(*c);
      }
    }
    if (profile_) {
      synchronize(stream_);
      entry.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count();
      profile_->push_back(entry);
    }
    release_after(static_cast<std::int64_t>(s));
  }
  for (Work& w : pending_) w.wait();
  pending_.clear();
  std::vector<Tensor> outputs;
  for (std::size_t i = 0; i < plan_.outputs.size(); ++i) {
    const auto o = static_cast<std::size_t>(plan_.outputs[i]);
    // An input returned as it came is copied, and so is a value returned a second time: outputs
    // alias neither the caller's tensors nor each other.
    const bool again = std::find(plan_.outputs.begin(), plan_.outputs.begin() + i,
                                 plan_.outputs[i]) != plan_.outputs.begin() + i;
    outputs.push_back(owned_[o].defined() && !again ? owned_[o]
                                                    : Tensor::copy_of(views_[o], stream_));
  }
  return outputs;
}

std::int64_t Interpreter::communicates_over(std::int64_t step) const {
  for (const OverlapSegment& seg : segments_)
    if (seg.first == step) return seg.mesh_dim;
  const PlanStep& st = plan_.steps[static_cast<std::size_t>(step)];
  if (const auto* c = std::get_if<Communication>(&st)) return c->mesh_dim;
  if (const auto* c = std::get_if<Compute>(&st)) return c->mesh_dim;
  return -1;
}

const TensorView& Interpreter::allocate(std::int64_t id) {
  const PlanValue& v = plan_.values[static_cast<std::size_t>(id)];
  Tensor& t = owned_[static_cast<std::size_t>(id)];
  t = Tensor(v.shape, v.dtype, device_, stream_);
  return views_[static_cast<std::size_t>(id)] = t.view();
}

Tensor Interpreter::sendable(std::int64_t id) const {
  if (owner(id).defined()) return owner(id);
  return device_.type == DeviceType::CPU ? Tensor::copy_of(view(id), stream_) : Tensor();
}

void Interpreter::release_after(std::int64_t step) {
  for (std::size_t id = 0; id < owned_.size(); ++id)
    if (owned_[id].defined() && facts_.last_use[id] <= step) {
      owned_[id] = Tensor();
      views_[id] = TensorView();
    }
}

// A statistic saved for a backward that this plan does not run is not computed.
bool Interpreter::unused_result(const ProgramOp& op, std::size_t j) const {
  return facts_.last_use[static_cast<std::size_t>(op.outputs[j].id)] < 0 && optional_result(op, j);
}

void Interpreter::finish(Work work) {
  if (device_.type == DeviceType::CUDA)
    pending_.push_back(std::move(work));
  else
    work.wait();
}

void Interpreter::run_step(const Compute& c) {
  std::vector<TensorView> in, out;
  for (Value v : c.op.inputs) in.push_back(v.defined() ? view(v.id) : TensorView());
  for (std::size_t j = 0; j < c.op.outputs.size(); ++j)
    out.push_back(unused_result(c.op, j) ? TensorView() : allocate(c.op.outputs[j].id));
  if (c.mesh_dim >= 0)
    return run_collective_op(c.op, in, out, *teams_[static_cast<std::size_t>(c.mesh_dim)],
                             stream_);
  run_op(c.op, in, out, stream_);
}

void Interpreter::run_step(const Slice& s) {
  copy(view(s.input).narrow(s.dim, s.offset, s.size), allocate(s.output), stream_);
}

void Interpreter::run_step(const Partition& p) {
  const TensorView& out = allocate(p.output);
  if (p.dim < 0 && p.holds) return copy(view(p.input), out, stream_);
  const std::optional<double> identity = partial_identity(p.reduction);
  MESHFUSE_CHECK(identity, ErrorCode::Internal, "partition: {} has no identity to pad with",
                 to_string(p.reduction));
  fill(out, *identity, stream_);
  if (p.dim >= 0)
    copy(view(p.input), out.narrow(p.dim, p.offset, view(p.input).size(p.dim)), stream_);
}

void Interpreter::run_step(const Communication& c) {
  Communicator& team = *teams_[static_cast<std::size_t>(c.mesh_dim)];
  const TensorView& in = view(c.input);
  const TensorView& out = allocate(c.output);
  switch (c.type) {
    case CommOp::AllReduce:
      copy(in, out, stream_);
      finish(team.all_reduce(out, *c.reduction, stream_).keep_alive({owner(c.output)}));
      return;
    case CommOp::AllGather:
      if (c.gather_dim == 0 && in.is_contiguous()) {
        const Tensor sent = sendable(c.input);
        finish(team.all_gather(sent.defined() ? sent.view() : in, out, c.sizes, stream_)
                   .keep_alive({sent, owner(c.output)}));
      } else {
        const Tensor moved = dim_first(in, c.gather_dim, stream_);
        const Tensor gathered(swapped(out.shape(), c.gather_dim), out.dtype(), device_, stream_);
        finish(team.all_gather(moved, gathered, c.sizes, stream_).keep_alive({moved, gathered}));
        copy(gathered.view().transpose(0, c.gather_dim), out, stream_);
      }
      return;
    case CommOp::ReduceScatter:
      if (c.scatter_dim == 0 && in.is_contiguous()) {
        const Tensor sent = sendable(c.input);
        finish(team.reduce_scatter(sent.defined() ? sent.view() : in, out, c.sizes, *c.reduction,
                                   stream_)
                   .keep_alive({sent, owner(c.output)}));
      } else {
        const Tensor moved = dim_first(in, c.scatter_dim, stream_);
        const Tensor part(swapped(out.shape(), c.scatter_dim), out.dtype(), device_, stream_);
        finish(team.reduce_scatter(moved, part, c.sizes, *c.reduction, stream_)
                   .keep_alive({moved, part}));
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
void Interpreter::all_to_all(Communicator& team, const Communication& c, const TensorView& in,
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
  finish(team.all_to_all(moved.view().reshape({moved.numel()}), received, send, receive, stream_)
             .keep_alive({moved, received}));
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

std::int64_t Interpreter::bytes(const Communication& c) const {
  const auto of = [&](std::int64_t id) {
    const PlanValue& v = plan_.values[static_cast<std::size_t>(id)];
    return shape_numel(v.shape) * static_cast<std::int64_t>(element_size(v.dtype));
  };
  return std::max(of(c.input), of(c.output));
}

}  // namespace meshfuse::detail
