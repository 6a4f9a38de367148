// Placements: how a tensor of global shape lies on a DeviceMesh, one per mesh dimension (DTensor's
// Shard, Replicate and Partial).
//
//   Shard(dim)    the tensor is split along its dimension `dim` (negative counts from the end)
//                 over the ranks of that mesh dimension, as evenly as possible: with extent n over
//                 d ranks, the first n % d ranks hold ceil(n / d) rows and the others floor(n / d)
//                 (numpy.array_split; never an empty part while n >= d).
//   Replicate     every rank of that mesh dimension holds the whole tensor.
//   Partial(op)   every rank holds a term; the tensor is the reduction of the terms (sum for the
//                 output of a row-parallel linear).
//
// Several mesh dimensions may shard one tensor dimension: the parts are split again in mesh order.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/distributed/device_mesh.h"

namespace meshfuse {

struct Shard {
  std::int64_t dim = 0;
  friend bool operator==(Shard, Shard) = default;
};
struct Replicate {
  friend bool operator==(Replicate, Replicate) = default;
};
struct Partial {
  ReduceOp op = ReduceOp::Sum;
  friend bool operator==(Partial, Partial) = default;
};
using Placement = std::variant<Shard, Replicate, Partial>;

// A value made Partial(op) without communication (DTensor's partition of a replicated value): a
// sum's or product's terms are the value on the first rank of the mesh dimension and this
// identity (0, 1) on the others; an average's, maximum's or minimum's (none here) are the value on
// every rank.
std::optional<double> partial_identity(ReduceOp op);
// The term of such a value on the rank at `coordinate` along the mesh dimension: the identity, or
// none where the rank keeps the value itself.
std::optional<double> partition_term(ReduceOp op, std::int64_t coordinate);

// Whether the Partials among `placements` give one value in any order of their reductions: all
// of one op, or sums with averages (both linear). Partial(max) over Partial(sum) is not the sum
// of the maxes, so a tensor placed with both has no one value.
bool partials_commute(const std::vector<Placement>& placements);
// Throws InvalidArgument, the message headed by `what`, unless every Partial among `placements`
// reduces `dtype` (reducible: bool reduces nowhere, avg only floating dtypes) and they commute.
void check_partials(std::string_view what, DType dtype, const std::vector<Placement>& placements);

// "Shard(0)", "Replicate()", "Partial(sum)".
std::string to_string(const Placement& placement);
// One per mesh dimension: "[Shard(0), Replicate()]".
std::string to_string(const std::vector<Placement>& placements);

// The part of `index` when `extent` rows are split over `parts` (Shard's sizes above).
struct ShardRange {
  std::int64_t offset = 0;
  std::int64_t size = 0;
  friend bool operator==(ShardRange, ShardRange) = default;
};
ShardRange shard_range(std::int64_t extent, std::int64_t parts, std::int64_t index);

// The shape that `rank` holds of a tensor of global `shape` placed on `mesh` by `placements` (one
// per mesh dimension), and where it starts in each dimension of the global tensor.
// InvalidArgument: a placement count other than mesh.ndim(), a Shard dim outside the tensor, a
// rank outside the mesh.
struct LocalPart {
  Shape shape;
  std::vector<std::int64_t> offsets;
};
LocalPart local_part(const Shape& shape, const DeviceMesh& mesh,
                     const std::vector<Placement>& placements, int rank);

}  // namespace meshfuse
