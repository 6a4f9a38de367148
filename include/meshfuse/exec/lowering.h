// Lowering: a Program on a DeviceMesh (program.h) turned into one rank's Plan, the steps that
// rank runs: compute on its local parts and the Communications between them.
//
// Propagation. Inputs lie as Program::set_placements says (default Replicate). Op by op and mesh
// dimension by mesh dimension, the lowering takes the op's sharding strategy (sharding.h) whose
// redistributions of the operands, as they lie, move the fewest bytes (the first listed on a tie;
// Replicate is first), and the results lie as that strategy says. So a column-parallel linear
// (weight Shard(0)) gives Shard(-1), the row-parallel one after it Partial, and a row-wise op
// after a Partial takes the reduce-scatter to tokens (Megatron-LM's sequence parallelism). A
// value that no strategy can take as it lies is an error naming the op, the value and the
// placements. Outputs end as set_placements says, by default as propagated with Partial made
// Replicate. Only outputs are made Partial by a Partition: the strategies' costs have no rule
// for it, so an operand is never partitioned to fit a strategy that takes a Partial.
//
// Redistribution, along one mesh dimension (DTensor's transitions):
//   Shard(i) -> Replicate    all_gather along dim i
//   Partial  -> Replicate    all_reduce
//   Partial  -> Shard(i)     reduce_scatter along dim i
//   Replicate -> Shard(i)    a local slice (a Slice step: no communication)
//   Shard(i) -> Shard(j)     all_to_all (gathers dim i, scatters dim j)
//   Replicate -> Partial     a local Partition (DTensor's partition of a value): the team's
//                            first rank keeps the value and the others hold the reduction's
//                            identity (sum, prod), or every rank keeps it (avg, max, min)
//   Shard(i) -> Partial      sum, prod: a local Partition, the shard at its offset in the
//                            identity (DTensor has no rule), unless another mesh dimension shards
//                            dim i too (then gathered first); avg, max, min: all_gather, then as
//                            from Replicate
//   Partial -> Partial(other op)  all_reduce, then as from Replicate
// Parts are numpy.array_split's (placement.h), so extents that the mesh does not divide go
// through the collectives' uneven splits. Several mesh dimensions change inner (last) first for
// gathers and reductions, then outer first for slices, then partitions.
// A shard of tensor dim d on a mesh dimension splits the part its outer mesh dimensions left, so
// where an outer mesh dimension changes how it shards d, the inner shards of d are gathered
// first and sliced again afterwards (more bytes than a direct reduce_scatter or all_to_all, but
// the parts stay those local_part gives). A value redistributed once is reused by every later op
// that wants it so.
//
// Every Communication names the communicator backend that runs it: LoweringParams's, or the one
// the executor's communicator has for the tensors' device type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/placement.h"
#include "meshfuse/exec/program.h"

namespace meshfuse {

struct LoweringParams {
  // The backend of every Communication; none: the communicator's for the inputs' device type
  // (BackendSpec), which is `local` for a process started without a launcher.
  std::optional<CommunicatorBackend> communicator_backend;
  friend bool operator==(const LoweringParams&, const LoweringParams&) = default;
};

// A value of a Plan: one program value as it lies on this rank.
struct PlanValue {
  Value global;                       // the program's value
  std::vector<Placement> placements;  // one per mesh dimension
  Shape shape;                        // this rank's part
  DType dtype = DType::F32;
};

// An op of the program on this rank's parts; op.inputs and op.outputs are Plan value indices.
// A cross_entropy on a vocabulary shard has its options' vocab_start and vocab_size set; one
// whose strategy is collective (the vocabulary-parallel forward) communicates over mesh_dim.
struct Compute {
  ProgramOp op;
  std::int64_t mesh_dim = -1;  // -1: no communication of its own
  std::vector<int> team;       // the ranks of mesh_dim through this rank
};

// A collective over the ranks of one mesh dimension.
struct Communication {
  CommOp type = CommOp::AllGather;  // all_gather, all_reduce, reduce_scatter or all_to_all
  std::int64_t mesh_dim = 0;
  std::vector<int> team;              // the ranks of that mesh dimension through this rank
  int root = -1;                      // -1: no root (every collective here)
  std::optional<ReduceOp> reduction;  // all_reduce, reduce_scatter
  std::int64_t gather_dim = -1;       // all_gather, all_to_all: the tensor dim concatenated
  std::int64_t scatter_dim = -1;      // reduce_scatter, all_to_all: the tensor dim split
  // all_gather / reduce_scatter / all_to_all: each team member's extent along the gathered
  // (or scattered) dim, in team order; all_to_all: along scatter_dim, with gather_sizes along
  // gather_dim.
  std::vector<std::int64_t> sizes, gather_sizes;
  CommunicatorBackend backend = CommunicatorBackend::Local;
  std::int64_t input = -1, output = -1;  // Plan value indices

  // e.g. "all_gather(dim 0) on gloo, mesh dim 0, team [0 1 2 3], sizes [3 3 2 2]".
  std::string to_string() const;
};

// Replicate -> Shard along one mesh dimension: this rank's rows of dim `dim`, no communication.
struct Slice {
  std::int64_t mesh_dim = 0;
  std::int64_t dim = 0;
  std::int64_t offset = 0, size = 0;  // in the input's extent along dim
  std::int64_t input = -1, output = -1;
};

// Replicate or Shard -> Partial(reduction) along one mesh dimension, no communication: the output
// (the input's extent along `dim` made whole) holds the reduction's identity, 0 or 1, with the
// input at `offset` along `dim`; or, with dim -1, the input where `holds`, else the identity.
struct Partition {
  std::int64_t mesh_dim = 0;
  ReduceOp reduction = ReduceOp::Sum;
  std::int64_t dim = -1;  // Shard(dim) -> Partial; -1: Replicate -> Partial
  std::int64_t offset = 0;
  bool holds = true;  // Replicate -> Partial: whether this rank's term is the value
  std::int64_t input = -1, output = -1;
};

using PlanStep = std::variant<Compute, Communication, Slice, Partition>;

struct Plan {
  int rank = 0;
  DeviceMesh mesh{std::vector<int>{0}};
  CommunicatorBackend backend = CommunicatorBackend::Local;
  std::vector<PlanValue> values;
  std::vector<PlanStep> steps;
  std::vector<std::int64_t> inputs;   // per program input, in Program::inputs() order
  std::vector<std::int64_t> outputs;  // per program output

  // One line per input, step and output, each value with its placements and local shape, e.g.
  //   $0 = input %0 'x' [Shard(0)] [3, 2048] f32
  //   $4 = all_gather(dim 0) on local, mesh dim 0, team [0 1 2 3], sizes [3 3 2 2] ($0)
  //        -> %0 [Replicate()] [10, 2048] f32
  std::string to_string() const;
};

// `rank`'s plan of `program` (on its mesh; on a one-rank mesh [rank] when it has none), with its
// communications on `backend`. Errors: InvalidArgument (a rank outside the mesh, a value no
// strategy can take as it lies).
Plan lower(const Program& program, int rank, CommunicatorBackend backend);

}  // namespace meshfuse
