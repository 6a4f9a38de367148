#include "meshfuse/exec/placement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "meshfuse/core/error.h"

namespace meshfuse {

std::string to_string(const Placement& placement) {
  if (const auto* s = std::get_if<Shard>(&placement)) return fmt::format("Shard({})", s->dim);
  if (const auto* p = std::get_if<Partial>(&placement))
    return fmt::format("Partial({})", to_string(p->op));
  return "Replicate()";
}

std::string to_string(const std::vector<Placement>& placements) {
  std::vector<std::string> names;
  for (const Placement& p : placements) names.push_back(to_string(p));
  return fmt::format("[{}]", fmt::join(names, ", "));
}

ShardRange shard_range(std::int64_t extent, std::int64_t parts, std::int64_t index) {
  MESHFUSE_CHECK(extent >= 0 && parts >= 1 && index >= 0 && index < parts,
                 ErrorCode::InvalidArgument,
                 "shard_range: part {} of {} parts of {} rows: want extent >= 0 and 0 <= part < "
                 "parts",
                 index, parts, extent);
  const std::int64_t base = extent / parts, longer = extent % parts;
  return {index * base + std::min(index, longer), base + (index < longer ? 1 : 0)};
}

std::optional<double> partial_identity(ReduceOp op) {
  if (op == ReduceOp::Sum) return 0.0;
  if (op == ReduceOp::Prod) return 1.0;
  return std::nullopt;
}

std::optional<double> partition_term(ReduceOp op, std::int64_t coordinate) {
  return coordinate == 0 ? std::nullopt : partial_identity(op);
}

bool partials_commute(const std::vector<Placement>& placements) {
  std::optional<ReduceOp> one;
  bool linear = true;
  for (const Placement& pl : placements)
    if (const auto* p = std::get_if<Partial>(&pl)) {
      if (!one) one = p->op;
      linear = linear && (p->op == ReduceOp::Sum || p->op == ReduceOp::Avg);
      if (p->op != *one && !linear) return false;
    }
  return true;
}

void check_partials(std::string_view what, DType dtype, const std::vector<Placement>& placements) {
  // Caught here, not at the run's all_reduce, which named neither the value nor the op.
  for (const Placement& pl : placements)
    if (const auto* p = std::get_if<Partial>(&pl))
      MESHFUSE_CHECK(reducible(dtype, p->op), ErrorCode::InvalidArgument,
                     "{}: {} cannot reduce {} values (bool reduces nowhere, avg only floating "
                     "dtypes)",
                     what, to_string(pl), to_string(dtype));
  MESHFUSE_CHECK(partials_commute(placements), ErrorCode::InvalidArgument,
                 "{}: {} mixes reductions that do not commute (the value would depend on the "
                 "order they are reduced in): one op, or sum with avg",
                 what, to_string(placements));
}

LocalPart local_part(const Shape& shape, const DeviceMesh& mesh,
                     const std::vector<Placement>& placements, int rank) {
  MESHFUSE_CHECK(static_cast<std::int64_t>(placements.size()) == mesh.ndim(),
                 ErrorCode::InvalidArgument,
                 "local_part: {} placements for {}: want one per mesh dimension", placements.size(),
                 mesh.to_string());
  const std::vector<std::int64_t> at = mesh.coordinates(rank);
  LocalPart part{shape, std::vector<std::int64_t>(shape.size(), 0)};
  for (std::size_t m = 0; m < placements.size(); ++m) {
    const auto* s = std::get_if<Shard>(&placements[m]);
    if (!s) continue;
    const auto rank_of_tensor = static_cast<std::int64_t>(shape.size());
    const std::int64_t d = s->dim < 0 ? s->dim + rank_of_tensor : s->dim;
    MESHFUSE_CHECK(d >= 0 && d < rank_of_tensor, ErrorCode::InvalidArgument,
                   "local_part: {} on mesh dimension {} is outside a tensor of shape {}",
                   to_string(placements[m]), m, shape_str(shape));
    const auto i = static_cast<std::size_t>(d);
    const ShardRange r = shard_range(part.shape[i], mesh.shape()[m], at[m]);
    part.offsets[i] += r.offset;
    part.shape[i] = r.size;
  }
  return part;
}

}  // namespace meshfuse
