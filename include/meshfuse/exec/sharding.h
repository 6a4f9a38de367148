// Sharding strategies: the ways each op of a Program can run along one mesh dimension (DTensor's
// op strategies). A strategy lists the placement each operand must have (ProgramOp::inputs order;
// an absent optional operand's entry is ignored) and the placement of each result. The lowering
// (lowering.h) picks, per op and mesh dimension, the strategy whose redistributions of the
// operands as they lie move the fewest bytes. R = Replicate, S(d) = Shard(d), P = Partial(sum);
// "rows" means S(d) for every d but the last (tokens), with the weights R.
//
//   linear        R; rows -> S(d); column-parallel (R, S(0), S(0)) -> S(last); without a bias
//                 (a bias would be added once per rank) row-parallel (S(last), S(1)) -> P and
//                 (P, R) -> P
//   matmul        R; (S(rows), R) -> S(rows); (R, S(cols)) -> S(cols); (S(K), S(K)) -> P;
//                 batched: all S(0)
//   add           (p, p) -> p for R, P and every S(d)
//   swiglu        (p, p) -> p for R and every S(d) (not linear: no P)
//   rmsnorm, fused_residual_add_rmsnorm, softmax, swiglu_packed
//                 R and rows: the normalised dim stays whole; rstd follows the rows
//   cross_entropy R; rows S(0) with labels S(0): reduction none -> S(0), sum -> P (mean needs
//                 the global count of rows not ignored: not on rows); vocabulary-parallel
//                 (Megatron-LM): logits S(1), labels R -> loss R, lse R, collective: each rank's
//                 per-row statistics of its columns are all-gathered and combined (any
//                 reduction); its backward needs no communication (grad_logits S(1))
//   fused_linear_cross_entropy
//                 R; rows S(0) with labels S(0) (the head's weight R), as cross_entropy;
//                 vocabulary-parallel: weight (and bias) S(0), x and labels R -> loss R, grad_x P,
//                 grad_weight and grad_bias S(0), collective (a chunk of rows at a time)
// Each backward op mirrors its forward: the gradient of an operand lies as the operand did, but a
// replicated operand (a weight) used by sharded compute gets a Partial gradient, and a Partial
// result's gradient comes Replicate (linear_backward: rows -> weight grads P; column-parallel ->
// grad_x P; row-parallel -> grad_x S(last), grad_weight S(1)).
#pragma once

#include <vector>

#include "meshfuse/exec/placement.h"
#include "meshfuse/exec/program.h"

namespace meshfuse {

struct ShardingStrategy {
  std::vector<Placement> inputs;
  std::vector<Placement> outputs;
  // The op communicates over the mesh dimension itself (the vocabulary-parallel loss all-gathers
  // its per-row statistics), so it runs with that dimension's team.
  bool collective = false;
  friend bool operator==(const ShardingStrategy&, const ShardingStrategy&) = default;
};

// The strategies of `op` (an op of `program`), Replicate first.
std::vector<ShardingStrategy> sharding_strategies(const Program& program, const ProgramOp& op);

}  // namespace meshfuse
