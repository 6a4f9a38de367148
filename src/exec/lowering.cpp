// Lowering: propagation of placements through the ops by the cheapest strategy, and the
// redistributions between them (see the header).
#include "meshfuse/exec/lowering.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "meshfuse/core/error.h"
#include "meshfuse/exec/sharding.h"

namespace meshfuse {
namespace {

constexpr double kNoRule = std::numeric_limits<double>::infinity();

template <typename T>
bool is(const Placement& p) {
  return std::holds_alternative<T>(p);
}

std::int64_t shard_dim(const Placement& p) { return std::get<Shard>(p).dim; }

// Bytes moved per rank, roughly, to bring a tensor of `bytes` from `from` to `to` along one mesh
// dimension: what the strategy choice minimises.
double transition_cost(const Placement& from, const Placement& to, double bytes) {
  if (from == to) return 0;
  if (is<Partial>(to)) return kNoRule;
  if (is<Replicate>(to)) return is<Partial>(from) ? 2 * bytes : bytes;  // all_reduce, all_gather
  return is<Replicate>(from) ? 0 : bytes;  // a local slice; reduce_scatter or all_to_all
}

std::string sizes_text(const std::vector<std::int64_t>& sizes) {
  return fmt::format("[{}]", fmt::join(sizes, " "));
}

// Where a loss op's vocabulary lies: its operand and dimension (input -1: not a loss op).
struct VocabularyOperand {
  std::int64_t input = -1, dim = -1;
};
VocabularyOperand vocabulary_operand(const ProgramOp& op) {
  switch (op.type) {
    case OpType::CrossEntropy:
      return {0, 1};
    case OpType::CrossEntropyBackward:
      return {1, 1};
    case OpType::FusedLinearCrossEntropy:
      return {1, 0};
    default:
      return {};
  }
}

class Lowering {
 public:
  Lowering(const Program& p, int rank, CommunicatorBackend backend)
      : p_(p), mesh_(p.mesh().value_or(DeviceMesh(std::vector<int>{rank}))) {
    MESHFUSE_CHECK(mesh_.contains(rank), ErrorCode::InvalidArgument, "lower: rank {} is outside {}",
                   rank, mesh_.to_string());
    plan_.rank = rank;
    plan_.mesh = mesh_;
    plan_.backend = backend;
    home_.assign(p.values().size(), -1);
  }

  Plan run() {
    for (Value in : p_.inputs()) {
      std::vector<Placement> pl = p_.placements(in);
      if (pl.empty()) pl.assign(static_cast<std::size_t>(mesh_.ndim()), Replicate{});
      home_[static_cast<std::size_t>(in.id)] = add_value(in, pl);
      plan_.inputs.push_back(home_[static_cast<std::size_t>(in.id)]);
    }
    for (const ProgramOp& op : p_.ops()) lower_op(op);
    for (std::size_t i = 0; i < p_.outputs().size(); ++i) {
      const std::int64_t at = home_[static_cast<std::size_t>(p_.outputs()[i].id)];
      std::vector<Placement> want = p_.output_placements()[i];
      if (want.empty()) {
        want = plan_.values[static_cast<std::size_t>(at)].placements;
        for (Placement& pl : want)
          if (is<Partial>(pl)) pl = Replicate{};
      }
      plan_.outputs.push_back(redistribute(at, want));
    }
    return std::move(plan_);
  }

 private:
  std::int64_t add_value(Value global, std::vector<Placement> placements) {
    const ValueInfo& info = p_.info(global);
    Shape local = local_part(info.shape, mesh_, placements, plan_.rank).shape;
    const auto id = static_cast<std::int64_t>(plan_.values.size());
    known_[{global.id, to_string(placements)}] = id;
    plan_.values.push_back({global, std::move(placements), std::move(local), info.dtype});
    return id;
  }

  const PlanValue& value(std::int64_t id) const {
    return plan_.values[static_cast<std::size_t>(id)];
  }

  // Each team member's extent along `dim` of the value placed as `placements`.
  std::vector<std::int64_t> extents(const PlanValue& v, const std::vector<Placement>& placements,
                                    std::int64_t mesh_dim, std::int64_t dim) const {
    std::vector<std::int64_t> sizes;
    for (int member : mesh_.team(mesh_dim, plan_.rank))
      sizes.push_back(local_part(p_.info(v.global).shape, mesh_, placements, member)
                          .shape[static_cast<std::size_t>(dim)]);
    return sizes;
  }

  // Plan value `id` as `want` says, reusing an earlier redistribution of the same value.
  std::int64_t redistribute(std::int64_t id, const std::vector<Placement>& want) {
    const Value global = value(id).global;
    if (auto it = known_.find({global.id, to_string(want)}); it != known_.end()) return it->second;
    std::vector<Placement> now = value(id).placements;
    const std::vector<Placement> start = now;
    // A shard of tensor dim d on mesh dimension m splits the part that the mesh dimensions before
    // m left (local_part): it means something else once one of those changes its sharding of d.
    const auto outer_changes = [&](std::int64_t m, const Placement& p) {
      if (!is<Shard>(p)) return false;
      for (std::int64_t j = 0; j < m; ++j) {
        const auto ji = static_cast<std::size_t>(j);
        if (!(start[ji] == want[ji]) && (start[ji] == p || want[ji] == p)) return true;
      }
      return false;
    };
    // A shard of a sum's or product's term on mesh dimension m can be padded to the part without
    // m's split, unless inner mesh dimensions shard the same tensor dim (their shards would then
    // split another extent).
    const auto pads_shard = [&](std::int64_t m, const Placement& p, ReduceOp op) {
      if (!is<Shard>(p) || !partial_identity(op) || outer_changes(m, p)) return false;
      for (std::int64_t j = m + 1; j < mesh_.ndim(); ++j) {
        const auto ji = static_cast<std::size_t>(j);
        if (start[ji] == p || want[ji] == p) return false;
      }
      return true;
    };
    // Gathers and reductions, inner mesh dimensions first. A shard whose meaning an outer change
    // would alter is gathered first, and a shard that an outer change will split again is made
    // by a slice afterwards (Replicate here). A Partial wanted is made last, by a Partition, from
    // a Replicate or a shard of a sum or product (a term padded with the identity).
    for (std::int64_t m = mesh_.ndim() - 1; m >= 0; --m) {
      const auto mi = static_cast<std::size_t>(m);
      Placement target = want[mi];
      if (outer_changes(m, now[mi]) || outer_changes(m, target)) target = Replicate{};
      if (const auto* partial = std::get_if<Partial>(&want[mi]); partial && !(now[mi] == target))
        target = pads_shard(m, now[mi], partial->op) ? now[mi] : Placement{Replicate{}};
      if (now[mi] == target || (is<Replicate>(now[mi]) && is<Shard>(target))) continue;
      std::vector<Placement> next = now;
      next[mi] = target;
      id = communicate(id, next, m);
      now = next;
    }
    // Slices, outer mesh dimensions first: each splits the part the ones before it left.
    for (std::int64_t m = 0; m < mesh_.ndim(); ++m) {
      const auto mi = static_cast<std::size_t>(m);
      if (now[mi] == want[mi] || is<Partial>(want[mi])) continue;
      std::vector<Placement> next = now;
      next[mi] = want[mi];
      const std::int64_t dim = shard_dim(want[mi]);
      const LocalPart before = local_part(p_.info(global).shape, mesh_, now, plan_.rank);
      const LocalPart after = local_part(p_.info(global).shape, mesh_, next, plan_.rank);
      const auto di = static_cast<std::size_t>(dim);
      const std::int64_t out = add_value(global, next);
      plan_.steps.push_back(
          Slice{m, dim, after.offsets[di] - before.offsets[di], after.shape[di], id, out});
      id = out;
      now = next;
    }
    // Partitions: their order does not matter, as Program admits only Partials that commute.
    for (std::int64_t m = 0; m < mesh_.ndim(); ++m) {
      const auto mi = static_cast<std::size_t>(m);
      if (now[mi] == want[mi]) continue;
      std::vector<Placement> next = now;
      next[mi] = want[mi];
      Partition step{m, std::get<Partial>(want[mi]).op};
      if (is<Shard>(now[mi])) {
        step.dim = shard_dim(now[mi]);
        const auto di = static_cast<std::size_t>(step.dim);
        step.offset = local_part(p_.info(global).shape, mesh_, now, plan_.rank).offsets[di] -
                      local_part(p_.info(global).shape, mesh_, next, plan_.rank).offsets[di];
      } else {
        step.holds = !partition_term(step.reduction, mesh_.coordinates(plan_.rank)[mi]);
      }
      step.input = id;
      step.output = add_value(global, next);
      id = step.output;
      plan_.steps.push_back(step);
      now = next;
    }
    return id;
  }

  // One transition along mesh dimension m (not Replicate -> Shard: that is a Slice).
  std::int64_t communicate(std::int64_t id, const std::vector<Placement>& next, std::int64_t m) {
    const PlanValue& v = value(id);
    const Placement& from = v.placements[static_cast<std::size_t>(m)];
    const Placement& to = next[static_cast<std::size_t>(m)];
    Communication c;
    c.mesh_dim = m;
    c.team = mesh_.team(m, plan_.rank);
    c.backend = plan_.backend;
    c.input = id;
    if (is<Partial>(from)) {
      c.reduction = std::get<Partial>(from).op;
      if (is<Replicate>(to)) {
        c.type = CommOp::AllReduce;
      } else {
        c.type = CommOp::ReduceScatter;
        c.scatter_dim = shard_dim(to);
        c.sizes = extents(v, next, m, c.scatter_dim);
      }
    } else if (is<Replicate>(to)) {
      c.type = CommOp::AllGather;
      c.gather_dim = shard_dim(from);
      c.sizes = extents(v, v.placements, m, c.gather_dim);
    } else {
      c.type = CommOp::AllToAll;
      c.gather_dim = shard_dim(from);
      c.scatter_dim = shard_dim(to);
      c.gather_sizes = extents(v, v.placements, m, c.gather_dim);
      c.sizes = extents(v, next, m, c.scatter_dim);
    }
    const Value global = v.global;  // add_value may move v
    c.output = add_value(global, next);
    const std::int64_t out = c.output;
    plan_.steps.push_back(std::move(c));
    return out;
  }

  void lower_op(const ProgramOp& op) {
    const std::vector<ShardingStrategy> strategies = sharding_strategies(p_, op);
    // The strategy of each mesh dimension, and the best one without a collective (a
    // vocabulary-parallel loss) with what it costs over the chosen one.
    std::vector<const ShardingStrategy*> chosen, plain;
    std::vector<double> plain_extra;
    for (std::int64_t m = 0; m < mesh_.ndim(); ++m) {
      const auto mi = static_cast<std::size_t>(m);
      const ShardingStrategy* best = nullptr;
      const ShardingStrategy* best_plain = nullptr;
      double best_cost = kNoRule, plain_cost = kNoRule;
      for (const ShardingStrategy& s : strategies) {
        double cost = 0;
        for (std::size_t i = 0; i < op.inputs.size(); ++i) {
          if (!op.inputs[i].defined()) continue;
          const PlanValue& v = value(home_[static_cast<std::size_t>(op.inputs[i].id)]);
          const ValueInfo& info = p_.info(op.inputs[i]);
          const double bytes = static_cast<double>(shape_numel(info.shape)) *
                               static_cast<double>(element_size(info.dtype));
          cost += transition_cost(v.placements[mi], s.inputs[i], bytes);
        }
        if (cost < best_cost) best = &s, best_cost = cost;
        if (!s.collective && cost < plain_cost) best_plain = &s, plain_cost = cost;
      }
      if (!best) {
        std::vector<std::string> operands;
        for (Value in : op.inputs)
          if (in.defined())
            operands.push_back(fmt::format(
                "{} as {}", p_.describe(in),
                to_string(value(home_[static_cast<std::size_t>(in.id)]).placements[mi])));
        fail(ErrorCode::InvalidArgument,
             "lower: {} (defining %{}) has no sharding rule for its operands as they lie on "
             "mesh dimension {}: {}",
             to_string(op.type), op.outputs[0].id, m, fmt::join(operands, ", "));
      }
      chosen.push_back(best);
      plain.push_back(best_plain);
      plain_extra.push_back(plain_cost - best_cost);  // infinite without one
    }
    // A vocabulary-parallel loss combines over one mesh dimension: where several dimensions chose
    // it on their own, the one it saves most on keeps it, and the others take their best strategy
    // without it.
    std::size_t keep = chosen.size();
    for (std::size_t m = 0; m < chosen.size(); ++m)
      if (chosen[m]->collective && (keep == chosen.size() || plain_extra[m] > plain_extra[keep]))
        keep = m;
    for (std::size_t m = 0; m < chosen.size(); ++m)
      if (m != keep && chosen[m]->collective && plain[m]) chosen[m] = plain[m];
    ProgramOp local = op;
    for (std::size_t i = 0; i < op.inputs.size(); ++i) {
      if (!op.inputs[i].defined()) continue;
      std::vector<Placement> want;
      for (const ShardingStrategy* s : chosen) want.push_back(s->inputs[i]);
      local.inputs[i].id = redistribute(home_[static_cast<std::size_t>(op.inputs[i].id)], want);
    }
    for (std::size_t j = 0; j < op.outputs.size(); ++j) {
      std::vector<Placement> placed;
      for (const ShardingStrategy* s : chosen) placed.push_back(s->outputs[j]);
      local.outputs[j].id = add_value(op.outputs[j], std::move(placed));
      home_[static_cast<std::size_t>(op.outputs[j].id)] = local.outputs[j].id;
    }
    Compute step{std::move(local), -1, {}};
    for (std::int64_t m = 0; m < mesh_.ndim(); ++m) {
      if (!chosen[static_cast<std::size_t>(m)]->collective) continue;
      MESHFUSE_CHECK(step.mesh_dim < 0, ErrorCode::InvalidArgument,
                     "lower: {} (defining %{}) has its vocabulary split over mesh dimensions {} "
                     "and {}: the vocabulary-parallel loss combines over one",
                     to_string(op.type), op.outputs[0].id, step.mesh_dim, m);
      step.mesh_dim = m;
      step.team = mesh_.team(m, plan_.rank);
    }
    on_vocabulary_shard(step.op);
    plan_.steps.push_back(std::move(step));
  }

  // A loss whose vocabulary this rank holds only part of (the logits' columns, the head weight's
  // rows) runs on that shard: the kernel's vocab_start and vocab_size say which.
  void on_vocabulary_shard(ProgramOp& op) const {
    const VocabularyOperand at = vocabulary_operand(op);
    if (at.input < 0) return;
    const PlanValue& v = value(op.inputs[static_cast<std::size_t>(at.input)].id);
    const Shape& whole = p_.info(v.global).shape;
    const auto dim = static_cast<std::size_t>(at.dim);
    if (v.shape[dim] == whole[dim]) return;
    op.loss.vocab_start = local_part(whole, mesh_, v.placements, plan_.rank).offsets[dim];
    op.loss.vocab_size = whole[dim];
  }

  const Program& p_;
  DeviceMesh mesh_;
  Plan plan_;
  std::vector<std::int64_t> home_;  // program value id -> plan value as defined
  std::map<std::pair<std::int64_t, std::string>, std::int64_t> known_;
};

}  // namespace

std::string Communication::to_string() const {
  std::string what;
  switch (type) {
    case CommOp::AllGather:
      what = fmt::format("all_gather(dim {})", gather_dim);
      break;
    case CommOp::AllReduce:
      what = fmt::format("all_reduce({})", meshfuse::to_string(*reduction));
      break;
    case CommOp::ReduceScatter:
      what =
          fmt::format("reduce_scatter({}, dim {})", meshfuse::to_string(*reduction), scatter_dim);
      break;
    default:
      what = fmt::format("{}(gather dim {}, scatter dim {})", meshfuse::to_string(type), gather_dim,
                         scatter_dim);
      break;
  }
  std::string text = fmt::format("{} on {}, mesh dim {}, team [{}]", what,
                                 meshfuse::to_string(backend), mesh_dim, fmt::join(team, " "));
  if (!sizes.empty()) text += fmt::format(", sizes {}", sizes_text(sizes));
  if (!gather_sizes.empty()) text += fmt::format(", gather sizes {}", sizes_text(gather_sizes));
  return text;
}

std::string Plan::to_string() const {
  const auto describe = [&](std::int64_t id) {
    const PlanValue& v = values[static_cast<std::size_t>(id)];
    return fmt::format("${} %{} {} {} {}", id, v.global.id, meshfuse::to_string(v.placements),
                       shape_str(v.shape), meshfuse::to_string(v.dtype));
  };
  std::string text = fmt::format("plan of rank {} on {}, communications on {}\n", rank,
                                 mesh.to_string(), meshfuse::to_string(backend));
  for (std::int64_t in : inputs) text += fmt::format("{} = input\n", describe(in));
  for (const PlanStep& step : steps) {
    if (const auto* c = std::get_if<Compute>(&step)) {
      std::vector<std::string> results, args;
      for (Value out : c->op.outputs) results.push_back(describe(out.id));
      for (Value in : c->op.inputs)
        args.push_back(in.defined() ? fmt::format("${}", in.id) : "none");
      if (c->op.loss.vocab_size != 0) {
        const VocabularyOperand at = vocabulary_operand(c->op);
        const Value v = c->op.inputs[static_cast<std::size_t>(at.input)];
        const std::int64_t here =
            values[static_cast<std::size_t>(v.id)].shape[static_cast<std::size_t>(at.dim)];
        args.push_back(fmt::format("vocab {}:{} of {}", c->op.loss.vocab_start,
                                   c->op.loss.vocab_start + here, c->op.loss.vocab_size));
      }
      std::string over;
      if (c->mesh_dim >= 0)
        over = fmt::format(" with all_gather of its row statistics on {}, mesh dim {}, team [{}]",
                           meshfuse::to_string(backend), c->mesh_dim, fmt::join(c->team, " "));
      text += fmt::format("{} = {}({}){}\n", fmt::join(results, ", "),
                          meshfuse::to_string(c->op.type), fmt::join(args, ", "), over);
    } else if (const auto* c = std::get_if<Communication>(&step)) {
      text += fmt::format("{} = {} (${})\n", describe(c->output), c->to_string(), c->input);
    } else if (const auto* s = std::get_if<Slice>(&step)) {
      text += fmt::format("{} = slice(dim {}, {}:{}) on mesh dim {} (${})\n", describe(s->output),
                          s->dim, s->offset, s->offset + s->size, s->mesh_dim, s->input);
    } else {
      const auto& pa = std::get<Partition>(step);
      const std::string term = pa.dim >= 0 ? fmt::format("dim {} at {}", pa.dim, pa.offset)
                               : pa.holds  ? "kept"
                                           : "identity";
      text += fmt::format("{} = partition({}, {}) on mesh dim {} (${})\n", describe(pa.output),
                          meshfuse::to_string(pa.reduction), term, pa.mesh_dim, pa.input);
    }
  }
  for (std::int64_t out : outputs) text += fmt::format("output {}\n", describe(out));
  return text;
}

Plan lower(const Program& program, int rank, CommunicatorBackend backend) {
  return Lowering(program, rank, backend).run();
}

}  // namespace meshfuse
