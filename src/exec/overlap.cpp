// Finding the stretches of a Plan that run chunk by chunk (overlap.h).
#include "meshfuse/exec/overlap.h"

#include <fmt/format.h>

#include <numeric>
#include <optional>

#include "core/names.h"
#include "exec/interpret.h"
#include "meshfuse/core/error.h"
#include "meshfuse/exec/lowering.h"

namespace meshfuse {

std::string_view to_string(Overlap overlap) {
  switch (overlap) {
    case Overlap::None:
      return "none";
    case Overlap::Collective:
      return "collective";
    case Overlap::Ring:
      return "ring";
  }
  return "?";
}

Overlap parse_overlap(std::string_view name) {
  constexpr Overlap kAll[] = {Overlap::None, Overlap::Collective, Overlap::Ring};
  return detail::parse_name("overlap", name, kAll);
}

std::string OverlapSegment::to_string() const {
  std::int64_t ops = last - first + 1 - (gather >= 0) - (scatter >= 0);
  std::string what = fmt::format("{} op{}", ops, ops == 1 ? "" : "s");
  if (gather >= 0) what = "all_gather + " + what;
  if (scatter >= 0) what += " + reduce_scatter";
  return fmt::format("steps {}..{}: {}, {}, {} {}", first, last, what, meshfuse::to_string(form),
                     chunks, form == Overlap::Ring ? "steps" : "chunks");
}

namespace {

bool is_rows_collective(const PlanStep& step, CommOp type) {
  const auto* c = std::get_if<Communication>(&step);
  return c && c->type == type && (type == CommOp::AllGather ? c->gather_dim : c->scatter_dim) == 0;
}

class Finder {
 public:
  Finder(const Plan& plan, const OverlapParams& params) : plan_(plan), params_(params) {
    readers_.assign(plan.values.size(), {});
    producer_.assign(plan.values.size(), -1);
    for (std::size_t s = 0; s < plan.steps.size(); ++s) {
      const auto step = static_cast<std::int64_t>(s);
      const auto one_to_one = [&](const auto& st) {  // a communication, slice or partition
        readers_[static_cast<std::size_t>(st.input)].push_back(step);
        producer_[static_cast<std::size_t>(st.output)] = step;
      };
      if (const auto* c = std::get_if<Compute>(&plan.steps[s])) {
        for (Value in : c->op.inputs)
          if (in.defined()) readers_[static_cast<std::size_t>(in.id)].push_back(step);
        for (Value out : c->op.outputs) producer_[static_cast<std::size_t>(out.id)] = step;
      } else if (const auto* c = std::get_if<Communication>(&plan.steps[s])) {
        one_to_one(*c);
      } else if (const auto* sl = std::get_if<Slice>(&plan.steps[s])) {
        one_to_one(*sl);
      } else {
        one_to_one(std::get<Partition>(plan.steps[s]));
      }
    }
    for (std::int64_t out : plan.outputs)
      readers_[static_cast<std::size_t>(out)].push_back(static_cast<std::int64_t>(plan.steps.size()));
  }

  std::vector<OverlapSegment> find() {
    std::vector<OverlapSegment> found;
    const auto n = static_cast<std::int64_t>(plan_.steps.size());
    for (std::int64_t s = 0; s < n;) {
      std::optional<OverlapSegment> seg = from(s);
      if (!seg) {
        ++s;
        continue;
      }
      s = seg->last + 1;
      if (seg->form == Overlap::Ring && seg->gather >= 0 && seg->scatter >= 0)
        split_ring(*seg, found);
      else
        found.push_back(std::move(*seg));
    }
    return found;
  }

 private:
  const Communication& comm(std::int64_t step) const {
    return std::get<Communication>(plan_.steps[static_cast<std::size_t>(step)]);
  }
  const PlanValue& value(std::int64_t id) const {
    return plan_.values[static_cast<std::size_t>(id)];
  }

  // Whether step s is a row-wise op over M rows that a segment [first, s] over mesh dimension
  // mesh_dim can hold: its row operands and results have M rows, whole along mesh_dim (so every
  // member of the team decides alike), and at least 2 dims where the op reduces over the last
  // (or, for matmul, any batch); its other operands come from before the segment.
  bool row_op(std::int64_t s, std::int64_t first, std::int64_t m, std::int64_t mesh_dim) const {
    const auto* c = std::get_if<Compute>(&plan_.steps[static_cast<std::size_t>(s)]);
    if (!c || c->mesh_dim >= 0) return false;
    const detail::RowRoles roles = detail::row_roles(c->op);
    if (!roles.row_wise) return false;
    const bool elementwise = c->op.type == OpType::Add || c->op.type == OpType::Swiglu ||
                             c->op.type == OpType::SwigluBackward;
    const auto rows_of = [&](Value v) {
      const PlanValue& pv = value(v.id);
      const auto ndim = static_cast<std::int64_t>(pv.shape.size());
      const auto* shard = std::get_if<Shard>(&pv.placements[static_cast<std::size_t>(mesh_dim)]);
      return ndim >= (elementwise ? 1 : 2) && pv.shape[0] == m &&
             !(shard && (shard->dim == 0 || shard->dim + ndim == 0));
    };
    for (std::size_t i = 0; i < c->op.inputs.size(); ++i) {
      const Value v = c->op.inputs[i];
      if (!v.defined()) continue;
      if (c->op.type == OpType::Matmul && value(v.id).shape.size() != 2) return false;
      if (roles.row_inputs[i] ? !rows_of(v) : producer_[static_cast<std::size_t>(v.id)] >= first)
        return false;
    }
    for (std::size_t j = 0; j < c->op.outputs.size(); ++j)
      if (roles.row_outputs[j] && !rows_of(c->op.outputs[j])) return false;
    return true;
  }

  // A summed result is whole only after the last chunk: nothing in the segment may read it.
  bool summed_read_inside(const Compute& c, std::int64_t last) const {
    const detail::RowRoles roles = detail::row_roles(c.op);
    for (std::size_t j = 0; j < c.op.outputs.size(); ++j)
      if (roles.summed_outputs[j])
        for (std::int64_t r : readers_[static_cast<std::size_t>(c.op.outputs[j].id)])
          if (r <= last) return true;
    return false;
  }

  // The longest segment that starts at step `first`, if any.
  std::optional<OverlapSegment> from(std::int64_t first) const {
    const auto n = static_cast<std::int64_t>(plan_.steps.size());
    const PlanStep& start = plan_.steps[static_cast<std::size_t>(first)];
    OverlapSegment seg;
    seg.first = first;
    seg.form = params_.overlap;
    std::int64_t next = first;
    std::int64_t m = -1;
    if (is_rows_collective(start, CommOp::AllGather)) {
      const Communication& ag = comm(first);
      seg.gather = first;
      seg.mesh_dim = ag.mesh_dim;
      seg.sizes = ag.sizes;
      m = std::accumulate(ag.sizes.begin(), ag.sizes.end(), std::int64_t{0});
      next = first + 1;
    } else {
      // A segment without an all_gather ends in a reduce_scatter: take its rows from the first
      // one that follows a run of ops.
      std::int64_t e = first;
      while (e < n && std::holds_alternative<Compute>(plan_.steps[static_cast<std::size_t>(e)]))
        ++e;
      if (e == first || e == n || !is_rows_collective(plan_.steps[static_cast<std::size_t>(e)],
                                                      CommOp::ReduceScatter))
        return std::nullopt;
      const Communication& rs = comm(e);
      seg.mesh_dim = rs.mesh_dim;
      seg.sizes = rs.sizes;
      m = std::accumulate(rs.sizes.begin(), rs.sizes.end(), std::int64_t{0});
    }
    std::int64_t ops = 0;
    while (next < n && row_op(next, first, m, seg.mesh_dim)) {
      ++next;
      ++ops;
    }
    if (next < n && is_rows_collective(plan_.steps[static_cast<std::size_t>(next)],
                                       CommOp::ReduceScatter)) {
      const Communication& rs = comm(next);
      const std::int64_t producer = producer_[static_cast<std::size_t>(rs.input)];
      const auto& readers = readers_[static_cast<std::size_t>(rs.input)];
      if (rs.mesh_dim == seg.mesh_dim && rs.sizes == seg.sizes && producer > seg.gather &&
          producer >= first && producer < next && readers.size() == 1 && readers[0] == next &&
          ops > 0) {
        seg.scatter = next;
        ++next;
      }
    }
    seg.last = next - 1;
    for (std::int64_t s = first; s <= seg.last; ++s)
      if (const auto* c = std::get_if<Compute>(&plan_.steps[static_cast<std::size_t>(s)]))
        if (summed_read_inside(*c, seg.last)) return std::nullopt;
    if (ops == 0 || (seg.gather < 0 && seg.scatter < 0)) return std::nullopt;
    const auto team = static_cast<int>(seg.sizes.size());
    seg.chunks = seg.form == Overlap::Ring ? team : (params_.chunks ? params_.chunks : team);
    return seg;
  }

  // A ring segment with both collectives: the gathered part up to the last op reading the
  // gathered tensor, then the rest with the reduce_scatter, when that rest computes its input
  // (otherwise the reduce_scatter runs whole, after the first part).
  void split_ring(const OverlapSegment& seg, std::vector<OverlapSegment>& found) const {
    std::int64_t k = seg.gather + 1;
    for (std::int64_t r : readers_[static_cast<std::size_t>(comm(seg.gather).output)])
      if (r <= seg.last) k = std::max(k, r);
    OverlapSegment head = seg, tail = seg;
    head.last = k;
    head.scatter = -1;
    found.push_back(head);
    if (producer_[static_cast<std::size_t>(comm(seg.scatter).input)] <= k) return;
    tail.first = k + 1;
    tail.gather = -1;
    found.push_back(tail);
  }

  const Plan& plan_;
  const OverlapParams& params_;
  std::vector<std::vector<std::int64_t>> readers_;  // per value, the steps reading it (outputs:
                                                    // the step count)
  std::vector<std::int64_t> producer_;              // per value, its step (-1: an input)
};

}  // namespace

void check_overlap_params(const OverlapParams& params) {
  MESHFUSE_CHECK(params.chunks >= 0, ErrorCode::InvalidArgument,
                 "MultiDeviceExecutorParams: chunks must be >= 1, or 0 for the team size; got {}",
                 params.chunks);
  MESHFUSE_CHECK(params.overlap != Overlap::Ring || params.chunks <= 1, ErrorCode::InvalidArgument,
                 "MultiDeviceExecutorParams: chunks {}: only overlap collective takes chunks (ring "
                 "moves one part per rank)",
                 params.chunks);
  MESHFUSE_CHECK(params.number_of_streams >= 1, ErrorCode::InvalidArgument,
                 "MultiDeviceExecutorParams: number_of_streams must be >= 1, got {}",
                 params.number_of_streams);
}

std::vector<OverlapSegment> find_overlap_segments(const Plan& plan, const OverlapParams& params) {
  check_overlap_params(params);
  if (params.overlap == Overlap::None) return {};
  return Finder(plan, params).find();
}

}  // namespace meshfuse
